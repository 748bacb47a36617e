"""`sluice serve` as a process: SIGTERM drains (the stream in flight completes, new requests are
refused, exit 0), the drain deadline still ends each stream with a finish_reason and [DONE], and a
model that cannot load exits 2 with one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from server_harness import free_port, request, serve_process, sse_events, wait_for

pytestmark = pytest.mark.slow  # a server process per test

pytest.importorskip("uvicorn")


# Every time limit below (thread joins, HTTP and wait_for timeouts, process waits) stops a hang and is
# 10x+ what it waits on takes here under load; none checks speed.


def _serve(tiny_dir, *flags):
    return serve_process("--model", str(tiny_dir), *flags)


class Stream(threading.Thread):
    """A streaming completion read to its end on a thread; `first` is set once a chunk has come."""

    def __init__(self, port: int, max_tokens: int):
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.first, self.raw, self.error = threading.Event(), b"", None

    def run(self):
        import http.client
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            body = {"prompt": "hello", "temperature": 0, "max_tokens": self.max_tokens, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            while line := resp.readline():
                self.raw += line
                self.first.set()
        except Exception as e:  # noqa: BLE001 -- reported by the test
            self.error = e
        self.first.set()


def test_sigterm_drains_the_stream_in_flight_and_exits_0(tiny_dir):
    proc, port = _serve(tiny_dir, "--shutdown-timeout", "60")
    stream = Stream(port, max_tokens=200)
    stream.start()
    assert stream.first.wait(60)
    assert b"[DONE]" not in stream.raw  # still generating when the signal comes
    proc.send_signal(signal.SIGTERM)
    # Until the signal is handled /health may still say 200. From the first answer that is not 200, a new
    # request gets 503 (drain begun, socket open) or a refused connection (socket closed), never 200 again:
    # polled until refused. (test_server_faults.py checks the 503s themselves, in a process it can slow.)
    answers = []

    def refused():
        try:
            answers.append(request(port, "GET", "/health")[0])
        except OSError:
            answers.append("refused")
        return answers[-1] == "refused"
    wait_for(refused, timeout=120, what="the server to stop taking connections")  # a hang-stopper
    after = answers[next(i for i, a in enumerate(answers) if a != 200):]
    assert set(after) <= {503, "refused"}, answers
    assert proc.wait(120) == 0, proc.stdout.read()
    stream.join(10)
    assert stream.error is None
    events = sse_events(stream.raw)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 200
    assert [c["choices"][0]["finish_reason"] for c in events[:-2]].count("length") == 1


def test_drain_deadline_ends_streams_cleanly(tiny_dir):
    proc, port = _serve(tiny_dir, "--shutdown-timeout", "0.2")
    stream = Stream(port, max_tokens=400)
    stream.start()
    assert stream.first.wait(60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.stdout.read()
    stream.join(10)
    events = sse_events(stream.raw)
    finishes = [c["choices"][0] for c in events[:-2] if c["choices"][0]["finish_reason"]]
    assert events[-1] == "[DONE]" and len(finishes) == 1
    # Either end is clean: cut by the deadline, or (a machine fast enough to make 400 tokens before the
    # signal lands) finished. That the deadline does cut a stream still running is checked where the
    # engine can be slowed: test_server_faults.py::test_a_drain_refuses_new_requests_and_its_deadline_ends_streams_cleanly.
    made = events[-2]["usage"]["completion_tokens"]
    cut = (finishes[0]["finish_reason"], "shut down" in finishes[0].get("error", ""), made < 400)
    assert cut in {("error", True, True), ("length", False, False)}, (finishes, made)


def test_a_model_that_fails_to_load_exits_2(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "sluice", "serve", "--model", str(tmp_path), "--port",
                          str(free_port())], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SLUICE_TRACEBACK": ""})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "sluice serve: error:" in out.stderr


def test_a_port_in_use_is_one_line(tiny_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = subprocess.run([sys.executable, "-m", "sluice", "serve", "--model", str(tiny_dir), "--port",
                              str(s.getsockname()[1])], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr and "Traceback" not in out.stderr


def test_serve_takes_the_speculative_flags_as_generate_does(tiny_dir):
    """`sluice serve` reads --draft-model / --prompt-lookup / --speculative-tokens through the same
    cli.common.engine_config as generate, and refuses a contradiction before it binds or loads anything."""
    from sluice.cli import build_parser
    from sluice.cli.serve import _check
    args = build_parser().parse_args(["serve", "--model", str(tiny_dir), "--prompt-lookup", "--speculative-tokens", "3"])
    config = _check(args)
    assert config.speculative == "prompt-lookup" and config.num_speculative_tokens == 3
    assert config.model == str(tiny_dir) and config.draft_model is None
    assert _check(build_parser().parse_args(["serve"])).speculative == "off"
    out = subprocess.run([sys.executable, "-m", "sluice", "serve", "--model", str(tiny_dir), "--port",
                          str(free_port()), "--prompt-lookup", "--draft-model", "bundled"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "pick one" in out.stderr and "Traceback" not in out.stderr
