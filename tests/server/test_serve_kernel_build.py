"""`sluice serve` on a fresh machine while another process holds the native kernels' build locks: no
request waits for the build. Background builds (the default): the torch path answers. SLUICE_KERNEL_BUILD
=wait: the load waits for the build, and meanwhile /health and requests get a 503 with Retry-After that
names the builder. Either way SIGTERM stops the server within its shutdown timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from server_harness import request, wait_for

pytestmark = pytest.mark.slow  # a server process per test

pytest.importorskip("uvicorn")

# Hang-stoppers, 10x+ what they wait on takes here under load (a load ~12 s, an answer well under 1 s);
# none checks speed. SHUTDOWN_S is the server's --shutdown-timeout, which its exit must keep to: an idle
# server exits in 1-3 s here (6-10 s at load 12 on 2 cores); one stuck on the build took the timeout,
# uvicorn's 5 s more and the engine's 10 s.
LOAD_S, ANSWER_S, SHUTDOWN_S = 120, 60, 30


@pytest.fixture
def held_locks(tmp_path, monkeypatch):
    """An empty kernel cache whose every kernel's build lock this (test) process holds, as a build would."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "kernels"))
    from sluice.engine.native import NATIVE_DIR, target
    from sluice.engine.native.lock import BuildLock
    locks = []
    for source in sorted(NATIVE_DIR.glob("*.cpp")):
        t = target(source)
        t.root.mkdir(parents=True, exist_ok=True)
        lock = BuildLock(t.lock, f"{source.name} kernel")
        assert lock.try_acquire()
        locks.append(lock)
    yield
    for lock in locks:
        lock.release()


def _serve(tiny_dir, mode: str, log):
    env = {**os.environ, "SLUICE_KERNEL_BUILD": mode, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sluice", "serve", "--model", str(tiny_dir), "--port", "0",
                             "--shutdown-timeout", str(SHUTDOWN_S)], stdout=log, stderr=subprocess.STDOUT, env=env)
    port = []

    def bound():
        assert proc.poll() is None, open(log.name).read()
        found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", open(log.name).read())
        port[:] = [int(found[1])] if found else []
        return bool(port)
    wait_for(bound, timeout=LOAD_S, what="the server to bind")
    return proc, port[0]


def _stop(proc) -> float:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=SHUTDOWN_S + 60)  # a hang-stopper: the assertion below is the check
    took = time.monotonic() - t0
    assert rc == 0
    return took


def _complete(port: int):
    t0 = time.monotonic()
    status, headers, body = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4},
                                    {"X-Request-Id": "kb-1"})
    return status, headers, json.loads(body), time.monotonic() - t0


def test_background_builds_the_torch_path_answers_the_first_request(tiny_dir, held_locks, tmp_path):
    with open(tmp_path / "serve.log", "w+") as log:
        proc, port = _serve(tiny_dir, "background", log)
        try:
            wait_for(lambda: request(port, "GET", "/health")[0] == 200, timeout=LOAD_S, what="the load")
            status, _, body, took = _complete(port)
            assert status == 200 and body["usage"]["completion_tokens"] == 4 and took < ANSWER_S
        finally:
            took = _stop(proc)
        out = open(log.name).read()
    assert took < SHUTDOWN_S, out
    assert f"being built by pid {os.getpid()}" in out and "using the torch path meanwhile" in out
    assert '"POST /v1/completions HTTP/1.1" 200 OK x-request-id=kb-1' in out  # uvicorn's access line names it


def test_wait_mode_the_load_waits_and_says_503_naming_the_build(tiny_dir, held_locks, tmp_path):
    with open(tmp_path / "serve.log", "w+") as log:
        proc, port = _serve(tiny_dir, "wait", log)
        try:
            builder = f"being built by pid {os.getpid()}"
            # the model loads, then waits for the kernels: /health names the build while it does
            wait_for(lambda: "the model is loaded; waiting" in open(log.name).read(), timeout=LOAD_S,
                     what="the load to wait for the kernels")
            status, _, health = request(port, "GET", "/health")
            assert status == 503 and builder in health.decode()
            status, headers, body, took = _complete(port)
            assert status == 503 and headers["retry-after"] == "1" and took < ANSWER_S
            assert builder in body["error"]["message"] and "loading" in body["error"]["message"]
        finally:
            took = _stop(proc)
        out = open(log.name).read()
    assert took < SHUTDOWN_S, out  # the wait for the kernels ends as soon as it sees the drain
