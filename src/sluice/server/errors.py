"""Every refusal as OpenAI's error object, {"error": {"message", "type", "param", "code"}}, with the
status a client can act on: 4xx for what the request can fix, 429/503 with Retry-After for "later",
and 500 only for a bug in sluice."""

from __future__ import annotations

import dataclasses
import re

from pydantic import ValidationError

from ..engine.sampling_params import SamplingParams
from ..errors import ContextExceeded, NumericsError, RequestError, SluiceError, TemplateError
from .protocol import FIELD_NAMES, ErrorDetail, ErrorResponse

# 401's type is what OpenAI's own API answers for a missing or wrong key (the client maps the status to
# AuthenticationError either way).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "model_error",
          429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}


RETRY_AFTER_S = 1  # what a 429 / 503 tells the client to wait, in seconds


class ServerError(Exception):
    """A refusal on its way to the client: status, message, and the parameter it is about."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None, www_authenticate: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after, self.www_authenticate = retry_after, www_authenticate

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=_TYPES.get(self.status, "invalid_request_error"),
                             param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def headers(self) -> dict[str, str] | None:
        out = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        if self.www_authenticate:  # RFC 6750: a 401 names the scheme it wants
            out["WWW-Authenticate"] = "Bearer"
        return out or None


class ContextOverflow(RequestError):
    """The prompt plus the tokens asked for do not fit the model's context. where: which prompt of a
    list ("prompt 2: "), else ""."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, where: str = ""):
        super().__init__(f"{where}this model's maximum context length is {limit} tokens, but "
                         f"{prompt_tokens + max_tokens} were requested ({prompt_tokens} in the prompt, {max_tokens} "
                         "for the completion); shorten the prompt or lower max_tokens")


# SamplingParams' messages start with the field's name: "temperature must be ...". Built from its
# fields, so a new sampling field's refusal names its parameter without an edit here.
_FIELD_FIRST = re.compile(r"^(%s) must be " % "|".join(f.name for f in dataclasses.fields(SamplingParams)))
# The engine's and tokenizer's refusals of a prompt that cannot fit (byte bound or token count).
_TOO_LONG = re.compile(r"fit the context|more than the context|leaves no room")


def from_sluice(err: SluiceError, prompt_field: str, aliases: dict[str, str] | None = None) -> ServerError:
    """A sluice error raised for a request -> the ServerError naming the request parameter."""
    if isinstance(err, ContextExceeded):  # the door's refusal, in OpenAI's words
        err = ContextOverflow(err.prompt_tokens, err.max_tokens, err.limit)
    message = str(err)
    if isinstance(err, ContextOverflow):
        return ServerError(400, message, param=prompt_field, code="context_length_exceeded")
    if isinstance(err, TemplateError):
        return ServerError(400, message, param="messages")
    if isinstance(err, NumericsError):
        return ServerError(422, message, code="nonfinite_logits")
    if isinstance(err, RequestError):
        field = _FIELD_FIRST.match(message)
        if field:
            name = (aliases or {}).get(field[1], field[1])
            return ServerError(400, message, param=name)
        if _TOO_LONG.search(message):
            return ServerError(400, message, param=prompt_field, code="context_length_exceeded")
        if "over the budget" in message:  # the request's KV cache would pass the server's memory budget
            return ServerError(400, message, param="max_tokens", code="kv_cache_budget")
        return ServerError(400, message, param=prompt_field)
    return ServerError(500, f"internal error: {type(err).__name__}: {message}")


def param_from_loc(loc: tuple) -> str | None:
    """pydantic's error location -> OpenAI's param: "messages.0.content", without union tags."""
    parts = [str(p) for p in loc if isinstance(p, int) or p in FIELD_NAMES]
    return ".".join(parts) or None


def from_validation(err: ValidationError) -> ServerError:
    """The first problem pydantic found, as a 400 naming the parameter and what was sent."""
    # A value that fits no branch of a union gets one error per branch; the deepest location is the
    # most specific ("messages.0.content.0.type: should be 'text'", not "content: should be a string").
    first = max(err.errors(include_url=False), key=lambda e: len(e["loc"]))
    kind, param = first["type"], param_from_loc(first["loc"])
    if kind == "json_invalid":
        return ServerError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    if param is None:
        return ServerError(400, f"the request body must be a JSON object: {first['msg']}")
    if kind == "missing":
        return ServerError(400, f"{param} is required", param=param)
    got = first.get("input")
    short = isinstance(got, (int, float, bool, type(None))) or (isinstance(got, str) and len(got) <= 40)
    shown = repr(got) if short else type(got).__name__
    return ServerError(400, f"{param}: {first['msg']} (got {shown})", param=param)
