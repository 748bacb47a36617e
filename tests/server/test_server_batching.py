"""sluice serve on the continuous-batching engine (server/batch_engine.py), through real clients:
concurrent streams equal the same requests alone, a client leaving mid-stream gives its KV blocks
back, a NaN ends only its own request and names where it started, logprobs and the KV gauges."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import threading
import time

import httpx
import pytest
import torch

from server_harness import MODEL, LiveServer, one_torch_thread, request, sse_events  # noqa: F401

import sluice  # noqa: E402
from sluice.server import BatchServingEngine  # noqa: E402


# Every time limit below (thread joins, HTTP and wait_for timeouts, process waits) stops a hang and is
# 10x+ what it waits on takes here under load; none checks speed.


def _engine(tiny_dir, max_queue: int = 32, **llm_kwargs):
    held = {}

    def make():
        held["llm"] = sluice.LLM(str(tiny_dir), **llm_kwargs)
        return held["llm"]
    engine = BatchServingEngine(make, MODEL, max_queue=max_queue)
    assert engine.wait_ready(120), engine.load_error
    return engine, held["llm"]


@pytest.fixture(scope="module")
def live(tiny_dir, one_torch_thread):  # noqa: F811
    engine, llm = _engine(tiny_dir, max_num_seqs=8, max_num_batched_tokens=32)
    server = LiveServer(engine)
    yield server, llm
    server.stop()
    engine.close(10)


def _metric(url: str, name: str) -> float:
    """A gauge or counter by name, or one labelled series of it given as 'name{labels' (absent: 0)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    if "{" in name:
        m = re.search(rf"^sluice_{re.escape(name)}\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
    m = re.search(rf"^sluice_{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _request(i: int) -> dict:
    """Request i of 8: different prompt and output lengths, greedy and seeded sampling."""
    sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.8 + 0.05 * i, seed=100 + i, top_p=0.9)
    return dict(model=MODEL, prompt=" ".join(["def", "return", "x", "for"][: 1 + i % 4]) * (1 + 3 * i),
                max_tokens=6 + 7 * i, **sampling, extra_body={"ignore_eos": True})


def test_eight_concurrent_streams_each_equal_the_request_alone(live):
    server, _ = live
    client = server.client()

    def stream(i):
        chunks = client.completions.create(stream=True, stream_options={"include_usage": True}, **_request(i))
        text, reasons, usage = "", [], None
        for c in chunks:
            if c.usage:
                usage = c.usage.completion_tokens
            for ch in c.choices:
                text += ch.text
                reasons += [ch.finish_reason] if ch.finish_reason else []
        return text, reasons, usage
    alone = [stream(i) for i in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(stream, range(8)))
    assert together == alone
    assert all(r == ["length"] and u == 6 + 7 * i for i, (_, r, u) in enumerate(alone))
    assert _metric(server.url, "kv_blocks_used") == 0
    assert _metric(server.url, "kv_blocks_free") == _metric(server.url, "kv_blocks_total")


def _stream(client, i):
    chunks = client.completions.create(stream=True, **_request(i))
    return "".join(ch.text for c in chunks for ch in c.choices)


@pytest.mark.parametrize("spec", [dict(draft_model="SELF"), dict(speculative="prompt-lookup")], ids=["draft", "lookup"])
def test_speculative_server_batches_with_the_plain_servers_greedy_output(live, tiny_dir, spec):
    """Speculative decoding in the batch (sluice serve --draft-model / --prompt-lookup): eight streams
    at once, each as it is alone; the greedy ones as the plain server gives them."""
    plain_server, _ = live
    kwargs = {k: (str(tiny_dir) if v == "SELF" else v) for k, v in spec.items()}
    engine, llm = _engine(tiny_dir, max_num_seqs=8, **kwargs)
    server = LiveServer(engine)
    try:
        client = server.client()
        alone = [_stream(client, i) for i in range(8)]
        with cf.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda i: _stream(client, i), range(8)))
        assert together == alone
        plain = [_stream(plain_server.client(), i) for i in range(0, 8, 2)]
        assert alone[0::2] == plain
        assert llm.batch_engine().scheduler.speculation is not None and _metric(server.url, "kv_blocks_used") == 0
    finally:
        server.stop()
        engine.close(10)


def test_n_choices_share_the_prompt_blocks_and_report_logprobs(live):
    server, llm = live
    client = server.client()
    prompt = "import os\n" * 30  # several full blocks
    before = _metric(server.url, "prefix_cache_hits_total")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=3, temperature=1.0, seed=7, logprobs=2)
    assert len(r.choices) == 3
    for ch in r.choices:
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens // 3
        assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    # the three choices are three sequences admitted at once: the later two can only hit what the
    # first keyed, so hits come from a repeat of the prompt
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert _metric(server.url, "prefix_cache_hits_total") > before
    assert 0 < _metric(server.url, "prefix_cache_hit_rate") <= 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    ids = llm.chat_prompt([{"role": "user", "content": "hi"}])
    logits = llm.model(torch.tensor([ids]))[0, -1].float()
    assert content[0].logprob == pytest.approx(float(logits.log_softmax(-1).max()), abs=1e-4)  # greedy: the top one


def test_a_client_leaving_mid_stream_frees_every_block(live, monkeypatch):
    server, llm = live
    real = llm.step
    monkeypatch.setattr(llm, "step", lambda *a: (time.sleep(0.02), real(*a))[1])  # slow enough to leave mid-way
    aborted = _metric(server.url, 'request_finished_total{model_name="tiny",finished_reason="aborted"')
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json=dict(model=MODEL, prompt="def " * 40, max_tokens=400, temperature=0, ignore_eos=True,
                                stream=True)) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert _metric(server.url, "kv_blocks_used") > 0
    deadline = time.monotonic() + 30
    while _metric(server.url, "kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server.url, "kv_blocks_used") == 0
    assert _metric(server.url, "num_requests_running") == 0
    assert _metric(server.url, 'request_finished_total{model_name="tiny",finished_reason="aborted"') == aborted + 1


def test_nan_ends_its_request_with_the_origin_and_the_server_stays_healthy(tiny_dir, one_torch_thread):  # noqa: F811
    engine, llm = _engine(tiny_dir)
    bad = llm.tokenizer.encode(" return")[-1]
    with torch.no_grad():
        llm.model.embed.weight[bad] = float("nan")  # only prompts holding this token go non-finite
    server = LiveServer(engine)
    try:
        body = dict(model=MODEL, prompt=[5, 6, bad, 7], max_tokens=4, temperature=0)
        status, _, raw = request(server.port, "POST", "/v1/completions", {**body, "stream": True})
        events = [e for e in sse_events(raw) if e != "[DONE]"]
        ends = [(c["finish_reason"], c.get("error")) for e in events for c in e["choices"] if c["finish_reason"]]
        assert status == 200 and len(ends) == 1 and ends[0][0] == "error"
        # named: the first module whose output is non-finite (the embedding), at the bad token's position
        assert "non-finite logits" in ends[0][1] and "starts in embed" in ends[0][1] and "position 2" in ends[0][1]
        status, _, raw = request(server.port, "POST", "/v1/completions", body)
        assert status == 422 and "starts in embed" in json.loads(raw)["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        ok = server.client().completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason in ("length", "stop")
        assert _metric(server.url, 'request_finished_total{model_name="tiny",finished_reason="error"') == 2
        assert _metric(server.url, "kv_blocks_used") == 0
    finally:
        server.stop()
        engine.close(10)


def test_past_max_queue_is_429_and_the_queued_ones_still_run(tiny_dir, one_torch_thread):  # noqa: F811
    engine, llm = _engine(tiny_dir, max_queue=2)
    gate, real = threading.Event(), llm.step
    llm.step = lambda *a: (gate.wait(60), real(*a))[1]  # the worker holds at its next step
    server = LiveServer(engine)
    body = dict(model=MODEL, prompt="def", max_tokens=3, temperature=0)
    results = []
    try:
        senders = [threading.Thread(target=lambda: results.append(request(server.port, "POST", "/v1/completions",
                                                                          body))) for _ in range(2)]
        for t in senders:
            t.start()
        deadline = time.monotonic() + 30
        while _metric(server.url, "num_requests_waiting") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, headers, raw = request(server.port, "POST", "/v1/completions", body)
        assert status == 429 and json.loads(raw)["error"]["code"] == "queue_full" and int(headers["retry-after"]) >= 1
        gate.set()
        for t in senders:
            t.join(60)
        assert [r[0] for r in results] == [200, 200]
        assert _metric(server.url, "kv_blocks_used") == 0
    finally:
        gate.set()
        server.stop()
        engine.close(10)
