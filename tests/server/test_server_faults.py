"""The server under faults: API key, oversized bodies, a full queue, a client that leaves mid-stream,
NaN logits, and requests while the model loads. Each ends in OpenAI's error shape or a clean finish,
never a 500, and the server stays healthy after."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from sluice.server import BatchServingEngine
from server_harness import one_torch_thread  # noqa: F401 -- a fixture
from server_harness import (MODEL, LiveServer, assert_error_shape, make_engine, metric, request,
                                 sse_events, wait_for)

openai = pytest.importorskip("openai")

BODY = {"model": MODEL, "prompt": "hello", "temperature": 0, "max_tokens": 4}
# Every time limit below (thread joins, HTTP and wait_for timeouts, process waits) stops a hang and is
# 10x+ what it waits on takes here under load; none checks speed.


pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def slow(tiny_dir):
    """A server whose LLM can be held (gate) or slowed (delay) from the test."""
    engine, llm = make_engine(tiny_dir, slow=True, max_queue=1)
    live = LiveServer(engine)
    live.llm = llm
    yield live
    llm.gate.set()
    live.stop()
    engine.close()


def test_api_key_guards_v1_only(slow):
    keyed = LiveServer(slow.engine, api_key="sekrit")  # a second app over the same engine
    try:
        for key in (None, "Bearer wrong", "sekrit", "Basic sekrit"):
            headers = {} if key is None else {"Authorization": key}
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nowhere")):
                status, _, body = request(keyed.port, method, path, BODY, headers)
                error = assert_error_shape(status, body, 401)
                assert error["code"] == "invalid_api_key"
        assert request(keyed.port, "GET", "/health")[0] == 200
        assert request(keyed.port, "GET", "/metrics")[0] == 200
        with pytest.raises(openai.AuthenticationError):
            keyed.client("wrong").models.list()
        out = keyed.client("sekrit").completions.create(**BODY)
        assert out.usage.completion_tokens == 4
    finally:
        keyed.stop()


def test_oversized_bodies_are_413_before_parsing(slow):
    small = LiveServer(slow.engine, max_body_bytes=1000)
    try:
        big = json.dumps({**BODY, "prompt": "x" * 2000}).encode()
        for chunked in (False, True):  # Content-Length says so, or the counted chunks do
            status, _, body = request(small.port, "POST", "/v1/completions", big, chunked=chunked)
            assert assert_error_shape(status, body, 413)["code"] == "request_too_large"
        status, _, body = request(small.port, "POST", "/v1/completions", BODY)
        assert status == 200, body  # a small one still goes through
    finally:
        small.stop()


def test_full_queue_is_429_with_retry_after(slow):
    slow.llm.gate.clear()  # the first request holds the worker at its first token
    results = []

    def send():
        results.append(request(slow.port, "POST", "/v1/completions", BODY))
    first = threading.Thread(target=send)
    first.start()
    wait_for(lambda: metric(slow.port, "num_requests_running") == 1, what="the first request to run")
    second = threading.Thread(target=send)
    second.start()
    wait_for(lambda: metric(slow.port, "num_requests_waiting") == 1, what="the second request to wait")
    status, headers, body = request(slow.port, "POST", "/v1/completions", BODY)
    assert assert_error_shape(status, body, 429)["code"] == "queue_full"
    assert int(headers["retry-after"]) >= 1
    slow.llm.gate.set()
    first.join(60)
    second.join(60)
    assert [r[0] for r in results] == [200, 200]


def test_client_leaving_mid_stream_aborts_the_request(slow):
    slow.llm.delay = 0.05  # 450 tokens take 22 s of sleeps alone: an abort that comes before them is early
    aborted = metric(slow.port, "request_finished_total", finished_reason="aborted")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", slow.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({**BODY, "max_tokens": 450, "ignore_eos": True,
                                                             "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the stream is flowing
        conn.sock.shutdown(2)  # the client goes away
        conn.close()
        wait_for(lambda: metric(slow.port, "request_finished_total", finished_reason="aborted") == aborted + 1,
                 timeout=120, what="the abort")  # a hang-stopper, as every wait here
        assert metric(slow.port, "num_requests_running") == 0 and metric(slow.port, "num_requests_waiting") == 0
        assert slow.llm.last_stats.generated_tokens < 450  # stopped early, not run to the end
    finally:
        slow.llm.delay = 0.0
    out = slow.client().completions.create(**BODY)  # the LLM was freed for the next one
    assert out.usage.completion_tokens == 4


def _send(port: int, body: dict) -> http.client.HTTPConnection:
    """POST a non-streaming request without reading the answer; closing the connection leaves."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def _leave(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(2)
    conn.close()


def test_client_leaving_a_plain_or_queued_request_aborts_it(slow, monkeypatch):
    aborted = metric(slow.port, "request_finished_total", finished_reason="aborted")
    abort_calls, real_abort = [], slow.engine.abort
    seen = threading.Event()

    def abort(handle, reason=None):  # the server noticed a client leave: an event to wait on, not a clock
        abort_calls.append(handle)
        seen.set()
        return real_abort(handle, reason)
    monkeypatch.setattr(slow.engine, "abort", abort)
    slow.llm.gate.clear()  # hold the worker at the first token of the first request
    try:
        running = _send(slow.port, {**BODY, "max_tokens": 300, "ignore_eos": True})
        wait_for(lambda: metric(slow.port, "num_requests_running") == 1, what="the first request to run")
        queued = _send(slow.port, BODY)
        wait_for(lambda: metric(slow.port, "num_requests_waiting") == 1, what="the second request to wait")
        _leave(queued)
        wait_for(lambda: metric(slow.port, "request_finished_total", finished_reason="aborted") == aborted + 1,
                 timeout=120, what="the queued request's abort")
        assert metric(slow.port, "num_requests_waiting") == 0 and metric(slow.port, "num_requests_running") == 1
        seen.clear()
        _leave(running)
        assert seen.wait(120)  # a hang-stopper: the abort is marked while the worker is still held
    finally:
        slow.llm.gate.set()
    wait_for(lambda: metric(slow.port, "request_finished_total", finished_reason="aborted") == aborted + 2,
             timeout=120, what="the running request's abort")
    assert metric(slow.port, "num_requests_running") == 0
    assert slow.llm.last_stats.generated_tokens < 20  # held at its first token until the abort was marked


def test_nan_logits_end_the_request_not_the_server(slow):
    llm = slow.llm._llm
    poison = {"on": True}
    hook = llm.model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan") if poison["on"] else None)
    try:
        status, _, body = request(slow.port, "POST", "/v1/completions", BODY)
        error = assert_error_shape(status, body, 422)
        assert "non-finite logits" in error["message"] and error["code"] == "generation_error"
        assert "internal error" not in error["message"]  # the model's fault, named as such, not a bug
        status, _, raw = request(slow.port, "POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4})
        events = sse_events(raw)
        finishes = [c["choices"][0] for c in events[:-1] if c["choices"][0]["finish_reason"]]
        assert status == 200 and events[-1] == "[DONE]" and len(finishes) == 1
        assert finishes[0]["finish_reason"] == "error" and "non-finite" in finishes[0]["error"]
    finally:
        hook.remove()
    assert request(slow.port, "GET", "/health")[0] == 200
    assert slow.client().completions.create(**BODY).usage.completion_tokens == 4


def test_health_and_requests_are_503_while_loading(tiny_dir):
    release = threading.Event()

    def make():
        release.wait(60)
        import sluice
        return sluice.LLM(str(tiny_dir))
    engine = BatchServingEngine(make, MODEL)
    live = LiveServer(engine)
    try:
        status, headers, body = request(live.port, "GET", "/health")
        assert_error_shape(status, body, 503)
        assert "retry-after" in headers
        status, headers, body = request(live.port, "POST", "/v1/completions", BODY)
        assert assert_error_shape(status, body, 503)["code"] == "unavailable" and "retry-after" in headers
        release.set()
        assert engine.wait_ready(60)
        assert request(live.port, "GET", "/health")[0] == 200
        assert request(live.port, "POST", "/v1/completions", BODY)[0] == 200
    finally:
        release.set()
        live.stop()
        engine.close()


def test_failed_load_is_reported_by_health(tmp_path):
    engine = BatchServingEngine(lambda: (_ for _ in ()).throw(RuntimeError("no weights")), MODEL)
    live = LiveServer(engine)
    try:
        wait_for(lambda: engine.load_error is not None)
        status, _, body = request(live.port, "GET", "/health")
        assert "no weights" in assert_error_shape(status, body, 503)["message"]
    finally:
        live.stop()
        engine.close()


def test_metrics_are_prometheus_text(slow):
    status, headers, body = request(slow.port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    for name in ("num_requests_running", "num_requests_waiting", "generation_tokens_total",
                 "time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert f"# TYPE sluice_{name} " in text
    buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sluice_time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == metric(slow.port, "time_to_first_token_seconds_count")



def test_a_drain_refuses_new_requests_and_its_deadline_ends_streams_cleanly(tiny_dir):
    """`sluice serve`'s SIGTERM handling (cli/serve.py's draining server) in this process, where the
    engine can be slowed: once the drain begins, /health and new requests get 503 while the stream in
    flight goes on; at the deadline the stream ends with finish_reason "error" and [DONE], and the server
    stops. The stream's 400 tokens take 20 s of sleeps alone, so the 0.5 s deadline always cuts it."""
    import signal

    from sluice.cli.serve import _DrainingServer

    engine, llm = make_engine(tiny_dir, slow=True)
    llm.delay = 0.05
    live = LiveServer(engine, server=lambda config: _DrainingServer(config, engine, 0.5))
    raw, first = [], threading.Event()

    def stream():
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**BODY, "max_tokens": 400, "ignore_eos": True,
                                                             "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        while line := resp.readline():
            raw.append(line)
            first.set()
    reader = threading.Thread(target=stream, daemon=True)
    try:
        reader.start()
        assert first.wait(60)
        engine.begin_drain()  # what the signal handler does first; the socket stays open until should_exit
        status, headers, body = request(live.port, "GET", "/health")
        assert "shutting down" in assert_error_shape(status, body, 503)["message"] and "retry-after" in headers
        status, _, body = request(live.port, "POST", "/v1/completions", BODY)
        assert_error_shape(status, body, 503)
        assert reader.is_alive()  # the stream in flight is not refused
        live.server.handle_exit(signal.SIGTERM, None)  # the deadline timer starts; uvicorn shuts down
        reader.join(60)
        live.thread.join(60)
        assert not reader.is_alive() and not live.thread.is_alive()
    finally:
        llm.delay = 0.0
        live.stop()
        engine.close()
    events = sse_events(b"".join(raw))
    finishes = [c["choices"][0] for c in events[:-1] if c["choices"][0]["finish_reason"]]
    assert events[-1] == "[DONE]" and len(finishes) == 1
    assert finishes[0]["finish_reason"] == "error" and "shut down" in finishes[0]["error"]
