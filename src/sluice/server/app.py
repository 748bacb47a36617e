"""The OpenAI-compatible HTTP API over a ServingEngine: `create_app(engine)` gives the ASGI app.

Routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics; the live page at /live/
with its /v1/sluice/valves (live.py). Every refusal is
OpenAI's error object (errors.py); FastAPI's own 422s and HTML pages never reach a client. Bodies
are parsed here with pydantic's strict JSON mode, not through FastAPI's body injection, so that the
400 names the parameter exactly and the body was already bounded by the Guard.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from .engine import Draining, NotReady, QueueFull, ServingEngine
from .errors import RETRY_AFTER_S, ServerError, from_validation, param_from_loc
from .guard import Guard
from .kernels import loading_message
from .live import add_live_page
from .metrics import render
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from .serving import Run, to_generation

log = logging.getLogger("sluice.server")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a full 32k-token context is ~130 KB of text; JSON and chat add little
# A request's line and headers: real ones are under 8 KiB (nginx's default buffers), a 1 MB header was taken.
MAX_HEADER_BYTES = 64 * 2**10
# How uvicorn serves create_app's app: with h11, whose parser stops buffering a request head past
# MAX_HEADER_BYTES and answers 400. httptools, uvicorn's choice when it is installed, buffers any size.
UVICORN_OPTIONS = {"http": "h11", "h11_max_incomplete_event_size": MAX_HEADER_BYTES}


def _error_response(err: ServerError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def create_app(engine: ServingEngine, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Guard:
    """The ASGI app: FastAPI routes behind the Guard (API key on /v1, body size on every route)."""
    app = FastAPI(title="sluice", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    created = int(time.time())

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, err: ServerError):
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):  # FastAPI would say 422
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        param = param_from_loc(tuple(first.get("loc", ())))
        return _error_response(ServerError(400, f"{param or 'request'}: {first.get('msg')}", param=param))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):  # unknown route, wrong method
        message = f"{request.method} {request.url.path}: {err.detail}"
        return _error_response(ServerError(err.status_code, message, code="not_found" if err.status_code == 404
                                           else None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        log.exception("internal error on %s %s (x-request-id %s)", request.method, request.url.path,
                      getattr(request.state, "request_id", None))
        return _error_response(ServerError(500, f"internal error: {type(err).__name__}: {err}"))

    @app.get("/health")
    async def health():
        if engine.draining:
            err = ServerError(503, "the server is shutting down", retry_after=RETRY_AFTER_S)
        elif engine.ready:
            return {"status": "ok"}
        elif engine.load_error is not None:
            err = ServerError(503, f"the model failed to load: {engine.load_error}")
        else:
            err = ServerError(503, loading_message("the model is loading"), retry_after=RETRY_AFTER_S)
        return _error_response(err)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render(engine.stats(), engine.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=engine.model_name, created=created)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(engine, model_id)
        return ModelCard(id=engine.model_name, created=created).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(engine, request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(engine, request, CompletionRequest)

    add_live_page(app, engine)
    return Guard(app, api_key, max_body_bytes)


def _check_model(engine: ServingEngine, name: str | None) -> None:
    if name is not None and name != engine.model_name:
        raise ServerError(404, f"the model '{name}' does not exist; this server serves '{engine.model_name}'",
                          param="model", code="model_not_found")


async def _complete(engine: ServingEngine, request: Request, kind):
    try:
        req = kind.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation(e) from None
    _check_model(engine, req.model)
    gen = to_generation(req)
    gen.request_id = getattr(request.state, "request_id", None)  # the Guard's
    try:
        run = Run(engine, req, gen, request.receive)
    except QueueFull as e:
        raise ServerError(429, f"the server is busy: {e}; retry later", code="queue_full",
                          retry_after=RETRY_AFTER_S) from None
    except (NotReady, Draining) as e:
        message = loading_message(str(e)) if isinstance(e, NotReady) and engine.load_error is None else str(e)
        raise ServerError(503, message, code="unavailable", retry_after=RETRY_AFTER_S) from None
    prompt_tokens = await run.started()  # a refused prompt raises its 400 here, before any header goes out
    if req.stream:
        return StreamingResponse(run.stream(prompt_tokens), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await run.collect(prompt_tokens))
