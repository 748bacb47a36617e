"""What a chat request's tools, tool_choice and response_format ask of the engine, and the conversation's
tool calls and results in the shape chat templates expect.

The output is kept to the request by constrained decoding (engine/constraints.py): response_format json_object
/ json_schema is that constraint as asked; tool_choice "required" is a JSON array of one or more calls of the
offered tools (at most one with parallel_tool_calls false), each {"name", "arguments"} with the arguments
under the tool's parameters schema; a named function is its arguments object alone. "auto" is free text, read
for Hermes / Qwen3 <tool_call> blocks; "none" offers no tools. tool_calls.py reads the calls back.

The legacy `functions` / `function_call` map onto tools / tool_choice (at most one call) and are answered
in the legacy `function_call` message field.
"""

from __future__ import annotations

import copy
import json
import secrets
from dataclasses import dataclass

from ..engine.constraints import Constraint
from ..errors import ConstraintError
from .errors import ServerError
from .protocol import ChatCompletionRequest
from .tool_calls import CLOSE, OPEN, CallReader
from .tool_protocol import NamedToolChoice, ToolDef

NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """template_tools: the tools the chat template sees (transformers' convention: OpenAI's tool dicts).
    mode: None (the output is plain text or JSON content), "auto", "required" or "named" (see tool_calls.py)."""
    template_tools: list[dict] | None = None
    constraint: Constraint | None = None
    mode: str | None = None
    name: str | None = None  # the named function
    limit: int | None = None  # most calls per choice
    legacy: bool = False  # answer in function_call, not tool_calls

    def reader(self) -> CallReader | None:
        return None if self.mode is None else CallReader(self.mode, self.name, self.limit)


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _bad(param: str, message: str) -> ServerError:
    return ServerError(400, f"{param}: {message}", param=param)


def _legacy(req: ChatCompletionRequest) -> tuple[list[ToolDef] | None, object, bool]:
    """(tools, tool_choice, legacy) with functions / function_call mapped onto the new fields."""
    if not (req.functions or req.function_call is not None):
        return req.tools, req.tool_choice, False
    if req.tools or req.tool_choice is not None:
        raise _bad("functions", "send tools and tool_choice, or the legacy functions and function_call, not both")
    choice = req.function_call
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=choice)
    tools = [ToolDef(type="function", function=f) for f in req.functions or []]
    return tools, choice, True


def _constraint(kind: str, spec, param: str) -> Constraint:
    try:
        return Constraint(kind, spec)
    except ConstraintError as e:  # the schema does not compile: say which field holds it
        raise _bad(param, str(e)) from None


def _parameters(tool: ToolDef, i: int, param: str) -> dict:
    """The tool's parameters schema, checked: an object's schema that compiles."""
    schema, where = tool.function.parameters, f"{param}.{i}.function.parameters"
    if schema is None:
        return NO_ARGUMENTS
    if schema.get("type", "object") != "object":
        raise _bad(where, f"must be a JSON Schema of an object (arguments are named), got type {schema.get('type')!r}")
    _constraint("json_schema", schema, where)
    return closed(schema)


def closed(schema):
    """The schema with additionalProperties false on each object that does not say: arguments are handed to a
    function, where a key it does not take is an error (a constrained small model adds keys freely)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and schema.get("type", "object") == "object":
        out.setdefault("additionalProperties", False)
    return out


def plan(req: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan; a 400 naming the field for what cannot be served."""
    tools, choice, legacy = _legacy(req)
    param, choice_param = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    fmt = _response_format(req)
    if not tools:
        if choice not in (None, "none"):
            raise _bad(choice_param, f"is only allowed when {param} are given")
        return ToolPlan(constraint=fmt)
    schemas = {t.function.name: _parameters(t, i, param) for i, t in enumerate(tools)}
    if len(schemas) < len(tools):
        raise _bad(param, "two tools have the same function name")
    limit = 1 if legacy or req.parallel_tool_calls is False else None
    offered = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan(constraint=fmt)
    if choice in (None, "auto"):
        # A response_format constrains every token, so no tool call can come: the answer is that format's text.
        return ToolPlan(offered, fmt, None if fmt else "auto", limit=limit, legacy=legacy)
    if fmt is not None:
        raise _bad("response_format", f"cannot be combined with a {choice_param} that forces a call")
    if choice == "required":
        return ToolPlan(offered, _constraint("json_schema", calls_schema(schemas, limit), param), "required",
                        limit=limit, legacy=legacy)
    name = choice.function.name
    if name not in schemas:
        raise _bad(choice_param, f"names the function {name!r}, which is not among the {param} "
                                 f"({', '.join(sorted(schemas))})")
    return ToolPlan(offered, _constraint("json_schema", schemas[name], param), "named", name=name, limit=1,
                    legacy=legacy)


def _response_format(req: ChatCompletionRequest) -> Constraint | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object", None)
    if fmt.json_schema is None:
        raise _bad("response_format.json_schema", "is required when response_format.type is 'json_schema'")
    schema = fmt.json_schema.schema_
    if schema is None:
        return Constraint("json_object", None)
    return _constraint("json_schema", schema, "response_format.json_schema.schema")


def calls_schema(schemas: dict[str, dict], limit: int | None) -> dict:
    """The JSON Schema of tool_choice "required"'s output: an array of calls, each {"name", "arguments"} with
    its tool's parameters. Each tool's $defs move to the root (renamed per tool), where its $refs point."""
    defs, options = {}, []
    for name, schema in schemas.items():
        schema = copy.deepcopy(schema)
        local = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
        renames = {f"#/{where}/{d}": f"#/$defs/{name}.{d}" for where in ("$defs", "definitions") for d in local}
        defs.update({f"{name}.{d}": _renamed(s, renames) for d, s in local.items()})
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                         "arguments": _renamed(schema, renames)},
                        "required": ["name", "arguments"], "additionalProperties": False})
    out = {"type": "array", "minItems": 1, "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if limit is not None:
        out["maxItems"] = limit
    return {**out, "$defs": defs} if defs else out


def _renamed(value, renames: dict[str, str]):
    if isinstance(value, dict):
        return {k: renames.get(v, v) if k == "$ref" and isinstance(v, str) else _renamed(v, renames)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, renames) for v in value]
    return value


# ------------------------------------------------------------------------------------- the conversation

def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages in transformers' apply_chat_template convention: an assistant's tool_calls with their
    arguments as dicts, a tool result with its tool_call_id (and the called function's name); legacy
    "function" results and function_call become the same."""
    out, names = [], {}
    for i, m in enumerate(req.messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        message = {"role": role, "content": m.text()}
        calls = [c.model_dump() for c in m.tool_calls or []]
        if m.function_call is not None:
            calls.append({"id": f"call_{i}", "type": "function", "function": m.function_call.model_dump()})
        for j, call in enumerate(calls):
            where = f"messages.{i}.tool_calls.{j}.function.arguments" if m.tool_calls else \
                f"messages.{i}.function_call.arguments"
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"] or "{}")
            except ValueError as e:
                raise _bad(where, f"is not valid JSON ({e})") from None
            names[call["id"]] = call["function"]["name"]
        if calls:
            message["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id is None:
                raise _bad(f"messages.{i}.tool_call_id", "is required in a tool message (the id of the call it "
                                                         "answers)")
            message["tool_call_id"] = m.tool_call_id
        name = m.name if m.name is not None else names.get(m.tool_call_id) if role == "tool" else None
        if name is not None:
            message["name"] = name
        out.append(message)
    return out


def for_template(messages: list[dict], template: str | None) -> list[dict]:
    """messages for a chat template that knows no tool_calls (the bundled model's): each assistant's calls
    written into its text as the <tool_call> blocks that "auto" reads, so the model still sees them."""
    if template is None or "tool_calls" in template or not any("tool_calls" in m for m in messages):
        return messages
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            blocks = [f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}" for call in calls]
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = "\n".join(filter(None, [m.get("content"), *blocks]))
        out.append(m)
    return out
