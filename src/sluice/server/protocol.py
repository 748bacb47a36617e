"""The OpenAI wire format: request bodies, responses and streaming chunks, as pydantic models.

Requests validate in strict mode: "0.5" is not a temperature and true is not an n, as in OpenAI's
own API, so a client bug is named instead of guessed at. Unknown fields are ignored (clients send
"user", "store", "metadata"...), but fields this server knows and cannot honour yet (logit_bias,
suffix, best_of...) are refused by `unsupported()` rather than dropped silently, so nobody reads
made-up numbers. Ranges OpenAI documents (penalties in [-2, 2], top_logprobs 0..20, the legacy
logprobs 0..5) are pydantic constraints, so their 400 names the parameter.

The models of tools, tool calls and response_format are in tool_protocol.py (served by tools.py).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from .tool_protocol import (TOOL_FIELD_NAMES, CalledFunction, FunctionCallOut, FunctionDef, FunctionName,
                            MessageToolCall, NamedToolChoice, ResponseFormat, ToolCallDelta, ToolCallOut, ToolDef)

MAX_N = 16  # choices per request: each one is a full generation
MAX_STOPS = 16
# Holding back text that may start a stop string costs up to len(stop)**2 character compares per token
# (engine/streaming.py), so a megabyte-long stop string would stall the engine: bound it.
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs, as OpenAI
# A list of prompts in one completions request (lm-eval's local-completions sends its batch so): each
# choice is a sequence in the engine, so prompts x n is bounded, and so are the prompts' tokens together
# (never below one full context, which a single prompt may take).
MAX_CHOICES = 128
MAX_LIST_TOKENS = 2**16

# OpenAI's range; NaN fails both bounds. Checked again by SamplingParams.
Penalty = Annotated[float, Field(ge=-2, le=2)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    # "function" is the legacy "tool": a function's result, named by `name`
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # the assistant's
    tool_call_id: str | None = None  # a tool message's: which call it answers
    function_call: CalledFunction | None = None  # the legacy assistant's call

    def needs_content(self) -> bool:
        """OpenAI requires content on every message but the assistant's (whose tool calls may stand in)."""
        return self.content is None and self.role != "assistant"

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Sampling(_Request):
    """What chat and completions requests share."""

    model: str | None = None  # None: the one model this server serves
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = Field(default=None)
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> str | None:
        """The first field that asks for something this server cannot do yet, or None."""
        if self.logit_bias:
            return "logit_bias"
        return None

    def stop_problem(self) -> str | None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOPS:
            return f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}"
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            return f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}"
        return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None  # the legacy form of tools, with function_call as its tool_choice
    function_call: Union[Literal["none", "auto"], FunctionName, None] = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    # A text, token ids, or a list of either (several prompts: n choices each, prompt-major).
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, one or several; [] (no token ids) is one empty prompt, which the engine refuses."""
        if isinstance(self.prompt, str) or all(isinstance(t, int) for t in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of"
        return super().unsupported()


# ---------------------------------------------------------------------------------------- responses

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCallOut | None = None  # the legacy functions' answer

    @model_serializer(mode="wrap")
    def _calls_if_any(self, handler) -> dict:
        # content is always there (null beside tool calls); the call fields only when there are calls
        return {k: v for k, v in handler(self).items() if v is not None or k == "content"}


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]
    entropy: float | None = None  # sluice's extension: of the whole distribution at this position, nats


class ChatLogprobs(BaseModel):
    """Chat's logprobs: one entry per generated token, with its top_logprobs alternatives."""
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    """The legacy completions' logprobs: parallel lists, one entry per generated token (with echo, per
    prompt token first: the first one's logprob and top_logprobs are null, server/echo.py).

    top_logprobs[i] maps token text -> logprob for the top alternatives plus the chosen token (so up
    to logprobs + 1 entries, as OpenAI documents); text_offset[i] is where token i starts in the
    completion's text, counting the token texts before it."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    entropy: list[float | None] = Field(default_factory=list)  # sluice's extension, as ChatTokenLogprob's, one per token


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: dict | None = None  # the legacy functions' pieces: {"name"} first, then {"arguments"}

    @model_serializer
    def _present_only(self) -> dict:
        # OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}, then {}.
        calls = None if self.tool_calls is None else [c.model_dump() for c in self.tool_calls]
        return {k: v for k, v in (("role", self.role), ("content", self.content), ("tool_calls", calls),
                                  ("function_call", self.function_call)) if v is not None}


class ChunkChoice(BaseModel):
    # extra: a choice that ends with finish_reason "error" also says why, in "error"
    model_config = ConfigDict(extra="allow")
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # as ChunkChoice
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """Both the whole /v1/completions response and its streaming chunks (OpenAI uses one shape)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# Every field name a request model has: a validation error's location keeps these (and list indices)
# and drops pydantic's union tags such as "list[TextPart]" (see errors.param_from_loc).
FIELD_NAMES = frozenset(name for m in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart,
                                       StreamOptions) for name in m.model_fields) | TOOL_FIELD_NAMES
