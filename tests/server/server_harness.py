"""What the server tests share: a real uvicorn server on a free loopback port in a background thread,
an LLM wrapper that can hold or slow the engine, and raw HTTP / SSE helpers (for what the openai
client hides: status codes, headers, the [DONE] line). No tests here. Its time limits (the server's
start, client and HTTP timeouts, wait_for) stop hangs, each 10x+ what it waits on takes here."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import sluice  # noqa: E402
from sluice.server import BatchServingEngine, create_app  # noqa: E402
from sluice.server.app import UVICORN_OPTIONS  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def one_torch_thread():
    """The server tests check behaviour, not speed: one torch thread keeps a busy shared runner from
    oversubscribing its cores (measured on a 2-core machine at load 9: 5 tok/s with 2 threads, 85 with 1)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class LiveServer:
    """create_app(engine, **kwargs) served by uvicorn on 127.0.0.1:<free port> in a daemon thread;
    server(config) makes the uvicorn.Server (`sluice serve`'s draining one, say)."""

    def __init__(self, engine, server=None, **app_kwargs):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # bound here and handed over: no race for the port
        self.port = sock.getsockname()[1]
        self.engine = engine
        config = uvicorn.Config(create_app(engine, **app_kwargs), log_level="warning", lifespan="off",
                                **UVICORN_OPTIONS)  # as `sluice serve` runs it
        self.server = (server or uvicorn.Server)(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "none"):
        import openai
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class SlowLLM:
    """An LLM whose step() then waits for `gate` and sleeps `delay`, so a test can hold the engine's
    worker after a request's first step (a full queue) or keep a stream open (a client that leaves
    mid-stream)."""

    def __init__(self, llm):
        self._llm = llm
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.0

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def step(self, *args, **kwargs):
        updates = self._llm.step(*args, **kwargs)
        self.gate.wait(60)
        time.sleep(self.delay)
        return updates


def make_engine(tiny_dir, slow: bool = False, max_queue: int = 8, **llm_kwargs):
    """The engine `sluice serve` runs (BatchServingEngine, continuous batching) on its own LLM over
    tiny_dir, loaded; returns (engine, llm). slow=True: over a SlowLLM, whose steps a test can hold
    or slow down."""
    held = {}

    def make():
        llm = sluice.LLM(str(tiny_dir), **llm_kwargs)
        held["llm"] = SlowLLM(llm) if slow else llm
        return held["llm"]
    engine = BatchServingEngine(make, MODEL, max_queue=max_queue)
    assert engine.wait_ready(120), engine.load_error
    return engine, held["llm"]


def request(port: int, method: str, path: str, body=None, headers: dict | None = None, chunked: bool = False):
    """(status, headers as a lowercase dict, body bytes) of one raw HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if chunked:
        conn.request(method, path, body=iter([data[i:i + 512] for i in range(0, len(data), 512)]), headers=hdrs,
                     encode_chunked=True)
    else:
        conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def sse_events(raw: bytes) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded, with the final "[DONE]" kept as a string."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error_shape(status: int, body: bytes, expected_status: int | None = None) -> dict:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}}, message non-empty."""
    if expected_status is not None:
        assert status == expected_status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


def metric(port: int, name: str, **labels) -> float:
    """One sample of /metrics (labels besides model_name given as keyword arguments); 0 if absent."""
    _, _, body = request(port, "GET", "/metrics")
    want = {"model_name": MODEL, **labels}
    for line in body.decode().splitlines():
        m = re.fullmatch(r"sluice_(\w+)\{(.*)\} (\S+)", line)
        if m and m[1] == name and dict(re.findall(r'(\w+)="([^"]*)"', m[2])) == want:
            return float(m[3])
    return 0.0


def wait_for(check, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll check() until it holds. The timeout stops a hang: the conditions waited on take well under a
    second, or what the caller passes 10x+ of (a server's load, a process's exit)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(*args: str, timeout: float = 120):
    """`sluice serve *args` as a process on a free port, once /health says 200; returns (proc, port).
    One torch thread (see one_torch_thread). The timeout stops a hang: 10x+ the ~12 s a load takes here."""
    import os
    import subprocess
    import sys
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sluice", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    def up():
        assert proc.poll() is None, proc.stdout.read()
        try:
            return request(port, "GET", "/health")[0] == 200
        except OSError:
            return False
    wait_for(up, timeout=timeout, what="the server to load")
    return proc, port
