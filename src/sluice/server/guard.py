"""The door: request id, API key and body size, checked before any route or JSON parser sees the request.

Plain ASGI rather than a FastAPI dependency, so an oversized body is refused while it arrives (from
Content-Length, or by counting a chunked body) instead of after it has been read into memory, and
an unauthenticated caller learns nothing about the routes behind /v1.

Every response, refusals and streams included, carries `x-request-id`: the client's own when it sent
one that is short and plain (REQUEST_ID), else a new one. Routes read it from scope["state"], so a
log line about the request can name it; RequestIdFilter gives it to uvicorn's access line.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import logging
import re
import secrets

from .errors import ServerError

# What a client's x-request-id may be to be echoed: it goes back in a header and into log lines, so no
# control characters, no spaces (log parsing), and short. Anything else is replaced, not refused.
REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")


# The request being answered in this context: uvicorn writes its access line from inside the app's send,
# in the request's own task, where the Guard has set it.
CURRENT_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("sluice_request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Gives each record `request_id` (the x-request-id being answered, else "-"), for a log format."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = CURRENT_REQUEST_ID.get()
        return True


def request_id(given: bytes | None) -> str:
    """The client's x-request-id when REQUEST_ID takes it, else a new "req_" and 32 hex digits."""
    if given is not None and REQUEST_ID.fullmatch(given):
        return given.decode("ascii")
    return "req_" + secrets.token_hex(16)


async def send_error(send, err: ServerError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers() or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = request_id(headers.get(b"x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid  # request.state.request_id in a route
        CURRENT_REQUEST_ID.set(rid)
        send = _with_header(send, b"x-request-id", rid.encode())
        if self.api_key is not None and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.api_key):  # constant time: no guessing it byte by byte
                return await send_error(send, ServerError(
                    401, "a valid API key is required: send the header 'Authorization: Bearer <key>' (--api-key "
                         "or SLUICE_API_KEY on the server)", code="invalid_api_key", www_authenticate=True))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await send_error(send, self._too_big(length.decode("latin-1")))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # Read the whole body here, bounded, then hand it to the app as one message. What arrives
        # after it (http.disconnect) still comes from the real receive, for abort on disconnect.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await send_error(send, self._too_big(f"more than {size}"))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _too_big(self, size: str) -> ServerError:
        return ServerError(413, f"the request body is {size} bytes; this server takes at most "
                                f"{self.max_body_bytes} (--max-body-bytes)", code="request_too_large")


def _with_header(send, name: bytes, value: bytes):
    """send, adding one header to the response's start message."""
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)
    return wrapped
