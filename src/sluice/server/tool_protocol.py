"""The OpenAI wire format of tools and structured output: tool definitions, tool_choice, response_format,
the tool calls inside messages, and their shapes in responses and stream deltas.

Kept apart from protocol.py (which imports it) because these models nest: a tool's function, a call's
function, a schema's wrapper. Requests are strict as protocol's are, so `tools.0.function.name` that breaks
OpenAI's name rule is a 400 naming exactly that field (errors.param_from_loc keeps these field names).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# OpenAI's rule for function and json_schema names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDef(_Request):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of an object; None: a function without arguments
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Request):
    # populate_by_name: "schema" is BaseModel's own attribute name, so the field is schema_ with that alias
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CalledFunction(_Request):
    """A call inside an assistant message of the conversation: arguments is a JSON text, as OpenAI sends it."""
    name: str
    arguments: str


class MessageToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


# ---------------------------------------------------------------------------------------- responses

class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _present_only(self) -> dict:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first carries id, type, the name and arguments "", the rest
    only more of the arguments' text (OpenAI's shape; clients join the pieces by index)."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer
    def _present_only(self) -> dict:
        head = {k: v for k, v in (("id", self.id), ("type", self.type)) if v is not None}
        return {"index": self.index, **head, "function": self.function.model_dump()}


TOOL_MODELS = (FunctionDef, ToolDef, FunctionName, NamedToolChoice, JsonSchemaFormat, ResponseFormat, CalledFunction,
               MessageToolCall)
# What errors.param_from_loc must keep from a validation error's location: fields and their aliases.
TOOL_FIELD_NAMES = frozenset({name for m in TOOL_MODELS for name in m.model_fields}
                             | {f.alias for m in TOOL_MODELS for f in m.model_fields.values() if f.alias})
