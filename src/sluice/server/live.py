"""The live page: a chat or completion with the model, each generated token coloured by its
probability, and the four valves of the context beside it (docs/server.md, "The live page").

    GET  /                    redirects to /live/
    GET  /live/               the page: page/index.html, live.js, live.css, shipped in the package
                              (no build step, nothing fetched from elsewhere)
    POST /v1/sluice/valves    {"prompt": text or token ids, or "messages": [...], "completion": text}
                              -> observatory.context_valves of that context

The page streams from the server's own /v1/completions or /v1/chat/completions with logprobs (each
entry carries sluice's "entropy" extension) and asks for the valves as the text grows. The valves are
one observed forward of the whole context; it runs on the engine's worker thread between two steps
(BatchServingEngine.call), so it never runs beside a step on the same model, and its length is bounded
(MAX_VALVE_TOKENS) because the batch waits for it.
"""

from __future__ import annotations

from importlib import resources
from typing import Union

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import SluiceError
from .engine import Draining, GenerationRequest, NotReady, QueueFull
from .errors import RETRY_AFTER_S, ServerError, from_sluice, from_validation
from .prompts import prompt_ids
from .protocol import ChatMessage

# The batch waits while the valves are measured: a forward of this many tokens costs about one prefill
# chunk of the same size. The page sends the whole context.
MAX_VALVE_TOKENS = 1024


class ValvesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    prompt: Union[str, list[int], None] = None  # as /v1/completions takes it
    messages: list[ChatMessage] | None = None  # as /v1/chat/completions: rendered with the chat template
    completion: str = ""  # what the model wrote after it so far (tokenized and appended)


class TooLong(SluiceError):
    """The context passes MAX_VALVE_TOKENS."""


class NotHere(SluiceError):
    """The valves cannot be measured on this engine (tensor parallelism: every rank would have to join)."""


def context_ids(llm, req: ValvesRequest) -> list[int]:
    """The context as token ids: the prompt as a generation request would see it, then the completion."""
    if (req.prompt is None) == (req.messages is None):
        raise ServerError(400, "give either prompt or messages (exactly one)", param="prompt")
    messages = None if req.messages is None else [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    ids = prompt_ids(llm, GenerationRequest([], prompt=req.prompt, messages=messages))
    if req.completion:
        ids = ids + llm.tokenizer.encode(req.completion, add_special_tokens=False, max_tokens=llm.max_model_len)
    limit = min(MAX_VALVE_TOKENS, llm.max_model_len)  # past the model's context the forward means nothing
    if len(ids) > limit:
        raise TooLong(f"the context is {len(ids)} tokens; the live valves take at most {limit}")
    bad = next((i for i in ids if not 0 <= i < llm.config.vocab_size), None) if req.prompt is not None else None
    if bad is not None:
        raise ServerError(400, f"prompt: token id {bad} is outside the vocabulary (0..{llm.config.vocab_size - 1})",
                          param="prompt")
    return ids


def measure(llm, req: ValvesRequest) -> dict:
    """On the worker thread: the context's ids, then one observed forward (observatory/context_valves.py)."""
    from ..observatory.context_valves import context_valves
    if getattr(llm, "tp", None) is not None:
        raise NotHere("the live valves are not available under --tp (the observed forward would have to run "
                      "on every rank); the page still streams tokens with their probabilities")
    ids = context_ids(llm, req)
    return {"token_ids": ids, **context_valves(llm.model, ids)}


def add_live_page(app: FastAPI, engine) -> None:
    """The page's routes on `app`; the valves need an engine with call() (BatchServingEngine)."""
    page = resources.files("sluice.server") / "page"

    @app.get("/")
    async def root():
        return RedirectResponse("/live/")

    @app.post("/v1/sluice/valves")
    async def valves(request: Request):
        try:
            req = ValvesRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise from_validation(e) from None
        if not hasattr(engine, "call"):
            raise ServerError(501, "this engine does not run jobs on its model", code="unsupported")
        try:
            future = engine.call(lambda llm: measure(llm, req))
        except QueueFull as e:
            raise ServerError(429, f"the server is busy: {e}; retry later", code="queue_full",
                              retry_after=RETRY_AFTER_S) from None
        except (NotReady, Draining) as e:
            raise ServerError(503, str(e), code="unavailable", retry_after=RETRY_AFTER_S) from None
        try:
            return await future
        except TooLong as e:
            raise ServerError(400, str(e), param="prompt" if req.prompt is not None else "messages",
                              code="context_too_long") from None
        except (NotReady, Draining) as e:
            raise ServerError(503, str(e), code="unavailable", retry_after=RETRY_AFTER_S) from None
        except NotHere as e:
            raise ServerError(501, str(e), code="unsupported") from None
        except SluiceError as e:
            raise from_sluice(e, "prompt" if req.prompt is not None else "messages") from None

    app.mount("/live", StaticFiles(directory=str(page), html=True), name="live")
