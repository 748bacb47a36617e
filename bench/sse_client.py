"""A lean HTTP/1.1 client for one streaming POST, for the load test (bench/serve_load.py).

The load generator shares the machine's two cores with the server it measures. Through httpx each
streamed chunk cost the client ~0.18 ms of CPU (its async stack: anyio, h11 in Python, line
decoding), 0.2 cores at 8 clients taken from the server. This reads the response with asyncio's
own streams: one connection per request (Connection: close), the status line and headers, then the
body, de-chunked when the server sends Transfer-Encoding: chunked (uvicorn's streaming responses),
split into lines. Enough for the two servers measured; not a general HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from urllib.parse import urlsplit


class Stream:
    """async with Stream(url, body) as r: r.status, r.headers, then `async for line in r.lines()`
    or `await r.read()`."""

    def __init__(self, url: str, body: dict):
        self.url, self.body = urlsplit(url), body
        self.status, self.headers = 0, {}

    async def __aenter__(self) -> Stream:
        u = self.url
        self._reader, self._writer = await asyncio.open_connection(u.hostname, u.port)
        payload = json.dumps(self.body).encode()
        head = (f"POST {u.path or '/'} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
        self._writer.write(head.encode("latin-1") + payload)
        status = await self._reader.readline()  # b"HTTP/1.1 200 OK\r\n"
        parts = status.split()
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ConnectionError(f"not an HTTP response: {status[:80]!r}")
        self.status = int(parts[1])
        while (line := await self._reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        return self

    async def __aexit__(self, *exc) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def chunks(self):
        """The body's bytes as they arrive, de-chunked: all the chunks one read brought, joined."""
        r = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            # Parsed out of a buffer, one await per read instead of three per chunk (size line, data,
            # CRLF): at 8 streams a token is a chunk, and the client shares the server's two cores.
            buf, at = b"", 0
            while True:
                pieces = []
                while (eol := buf.find(b"\r\n", at)) >= 0:
                    size = int(buf[at:eol].split(b";")[0], 16)
                    if size == 0:  # the last chunk; trailers, if any, are not read
                        if pieces:
                            yield b"".join(pieces)
                        return
                    end = eol + 2 + size
                    if len(buf) < end + 2:
                        break  # this chunk's data (or its CRLF) is still on the way
                    pieces.append(buf[eol + 2:end])
                    at = end + 2
                if pieces:
                    yield b"".join(pieces)
                more = await r.read(1 << 16)
                if not more:
                    raise asyncio.IncompleteReadError(buf[at:], None)
                buf, at = buf[at:] + more, 0
        elif "content-length" in self.headers:
            yield await r.readexactly(int(self.headers["content-length"]))
        else:
            while data := await r.read(65536):
                yield data

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    async def lines(self):
        """The body as text lines, without their line endings (LF or CRLF)."""
        rest = b""
        async for data in self.chunks():
            *lines, rest = (rest + data).split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if rest:
            yield rest.rstrip(b"\r").decode()
