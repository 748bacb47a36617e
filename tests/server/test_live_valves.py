"""The live page's server side on a tiny random model: POST /v1/sluice/valves against `sluice.observe`
run directly on the same ids, its refusals, that it leaves a generation running beside it untouched, and
the "entropy" extension of streamed logprobs against scipy on transformers' logits. The page itself in
a real browser: test_live_page.py."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

import sluice
from server_harness import one_torch_thread  # noqa: F401 -- a fixture
from server_harness import LiveServer, assert_error_shape, make_engine, request, sse_events
from sluice.server.live import MAX_VALVE_TOKENS

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT, COMPLETION = "The quick brown fox", " jumps over"


@pytest.fixture(scope="module")
def served(tiny_dir):
    # the torch forward, whose modules run the hooks an observer attaches (the native step calls none of them):
    # there a valves forward beside a step would mix the two (test_valves_beside_a_stream_leave_its_tokens_alone)
    engine, llm = make_engine(tiny_dir, kernels=False)
    live = LiveServer(engine, api_key=None)
    live.llm = llm
    yield live
    live.stop()
    engine.close()


def valves(port, body, headers=None):
    status, _, raw = request(port, "POST", "/v1/sluice/valves", body, headers)
    return status, json.loads(raw)


def observed(llm, ids):
    with sluice.observe(llm.model, attention=False) as obs, torch.inference_mode():
        logits = llm.model(torch.tensor([ids]))[0]
    return obs, logits


def test_valves_equal_observe_on_the_same_ids(served, tiny_llm):
    status, got = valves(served.port, {"prompt": PROMPT, "completion": COMPLETION})
    assert status == 200, got
    ids = tiny_llm.tokenizer.encode(PROMPT) + tiny_llm.tokenizer.encode(COMPLETION, add_special_tokens=False)
    assert got["token_ids"] == ids and got["tokens"] == len(ids)
    obs, logits = observed(tiny_llm, ids)
    s, summary = obs.stats, obs.summary()
    np.testing.assert_allclose(got["residual"]["rms_mean"], summary["residual_rms"], rtol=1e-5)
    np.testing.assert_allclose(got["residual"]["rms_last"], s["resid_rms"][:, 0, -1], rtol=1e-5)
    assert got["norms"]["names"] == obs.norm_names
    np.testing.assert_allclose(got["norms"]["gain_mean"], obs.norm_gain()[:, 0].mean(-1), rtol=1e-5)
    np.testing.assert_allclose(got["logits"]["max"], logits.amax(-1), rtol=1e-5)
    np.testing.assert_allclose(got["logits"]["min"], logits.amin(-1), rtol=1e-5)
    np.testing.assert_allclose(got["logits"]["logsumexp"], torch.logsumexp(logits, -1), rtol=1e-5)
    safety = got["softmax"]["with_final_norm"]
    assert safety["logit_max"] == pytest.approx(float(logits[-1].max()), rel=1e-5)
    assert safety["headroom"]["float16"] == pytest.approx(np.log(65504.0) - float(logits[-1].max()), rel=1e-4)
    assert {(r["method"], r["dtype"]) for r in safety["table"]} == {
        (m, d) for m in ("naive", "safe", "online") for d in ("float32", "float16", "bfloat16")}
    # without the final norm the head sees the raw stream, whose scale is the last block's RMS
    assert got["softmax"]["without_final_norm"]["logit_max"] != safety["logit_max"]


def test_chat_messages_are_rendered_as_the_engine_renders_them(served, tiny_llm):
    messages = [{"role": "user", "content": "hello"}]
    status, got = valves(served.port, {"messages": messages, "completion": " there"})
    assert status == 200, got
    ids = tiny_llm.chat_prompt(messages) + tiny_llm.tokenizer.encode(" there", add_special_tokens=False)
    assert got["token_ids"] == ids


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "exactly one"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "exactly one"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, 10**9]}, "prompt", "outside the vocabulary"),
    ({"prompt": "a " * (MAX_VALVE_TOKENS + 50)}, "prompt", "the live valves take at most"),
    ({"prompt": 5}, "prompt", ""),
])
def test_bad_requests_are_named_400s(served, body, param, words):
    status, _, raw = request(served.port, "POST", "/v1/sluice/valves", body)
    err = assert_error_shape(status, raw, 400)
    assert err["param"] == param and words in err["message"]


def test_valves_need_the_api_key_the_page_does_not(tiny_dir):
    engine, _ = make_engine(tiny_dir)
    live = LiveServer(engine, api_key="sekrit")
    try:
        status, _, raw = request(live.port, "POST", "/v1/sluice/valves", {"prompt": "a"})
        assert_error_shape(status, raw, 401)
        status, _, _ = request(live.port, "POST", "/v1/sluice/valves", {"prompt": "a"},
                               {"Authorization": "Bearer sekrit"})
        assert status == 200
        status, _, page = request(live.port, "GET", "/live/")
        assert status == 200 and b"<title>sluice live</title>" in page
    finally:
        live.stop()
        engine.close()


def test_the_page_and_its_files_are_served(served):
    status, headers, _ = request(served.port, "GET", "/")
    assert status in (302, 307) and headers["location"] == "/live/"
    for name, kind in (("", "text/html"), ("live.js", "javascript"), ("valves.js", "javascript"), ("live.css", "text/css")):
        status, headers, body = request(served.port, "GET", f"/live/{name}")
        assert status == 200 and kind in headers["content-type"] and body
        # nothing fetched from elsewhere: no URL at all but SVG's namespace name, which is never fetched
        rest = body.replace(b"http://www.w3.org/2000/svg", b"")
        assert b"http://" not in rest and b"https://" not in rest and b"//" + b"cdn" not in rest


def test_valves_beside_a_stream_leave_its_tokens_alone(served, tiny_llm):
    """The observed forward runs on the engine's thread between steps: a greedy stream is identical
    with valves requested all through it, and its logprobs carry the whole distribution's entropy."""
    body = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 2}
    context = {"prompt": PROMPT, "completion": COMPLETION * 40}  # long enough that its forward overlaps steps
    stop = threading.Event()
    answers = []

    def poll():
        while not stop.is_set():
            status, got = valves(served.port, context)
            answers.append((status, got.get("residual", {}).get("rms_mean")))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        status, _, raw = request(served.port, "POST", "/v1/completions", body)
    finally:
        stop.set()
        poller.join(60)
    assert status == 200 and answers and {a for a, _ in answers} == {200}
    # nor does the stream touch the valves: every answer is the quiet one
    want = valves(served.port, context)[1]["residual"]["rms_mean"]
    for _, got in answers:
        np.testing.assert_allclose(got, want, rtol=1e-6)
    chunks = [e for e in sse_events(raw) if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    entropies = [h for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                 for h in c["choices"][0]["logprobs"]["entropy"]]
    ref = tiny_llm.generate([PROMPT], sluice.SamplingParams(temperature=0, max_tokens=120, ignore_eos=True,
                                                            logprobs=2))[0]
    assert text == ref.text
    np.testing.assert_allclose(entropies, [t.entropy for t in ref.logprobs], atol=1e-5)


def test_streamed_entropy_is_the_whole_vocabularys_under_transformers(served, tiny_dir, tiny_llm):
    from scipy.stats import entropy
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    status, _, raw = request(served.port, "POST", "/v1/chat/completions", body)
    assert status == 200
    content = json.loads(raw)["choices"][0]["logprobs"]["content"]
    ids = tiny_llm.chat_prompt(body["messages"])
    ref = tiny_llm.generate([ids], sluice.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + ref.token_ids])).logits[0, len(ids) - 1:-1].double()  # (6, V)
    want = entropy(torch.softmax(logits, -1).numpy(), axis=-1)
    np.testing.assert_allclose([c["entropy"] for c in content], want, atol=1e-4)


def test_jobs_are_bounded_and_never_left_hanging():
    """More than MAX_JOBS measurements waiting is QueueFull (the route's 429); closing the inbox settles
    the waiting ones with Draining (the route's 503) instead of leaving their clients waiting."""
    import asyncio
    from sluice.server.engine import Draining, QueueFull
    from sluice.server.inbox import MAX_JOBS, Inbox

    async def main():
        inbox = Inbox(max_queue=4)
        inbox.set_ready()  # no worker: the jobs wait
        futures = [inbox.call(lambda llm: 1) for _ in range(MAX_JOBS)]
        with pytest.raises(QueueFull, match=f"at most {MAX_JOBS}"):
            inbox.call(lambda llm: 1)
        inbox.close()
        for f in futures:
            with pytest.raises(Draining):
                await asyncio.wait_for(f, 10)
        with pytest.raises(Draining):
            inbox.call(lambda llm: 1)
    asyncio.run(main())


def test_valves_are_refused_by_name_under_tensor_parallelism():
    from sluice.server.live import NotHere, ValvesRequest, measure

    class RankLLM:  # what measure() reads first: an LLM whose model is split over ranks
        tp = object()
    with pytest.raises(NotHere, match="--tp"):
        measure(RankLLM(), ValvesRequest(prompt="a"))


def test_the_bound_is_the_smaller_of_the_page_limit_and_the_models_context(served):
    limit = min(MAX_VALVE_TOKENS, served.llm.max_model_len)
    for n, want in ((limit, 200), (limit + 1, 400)):
        status, got = valves(served.port, {"prompt": [1] * n})
        assert status == want, got
    assert f"at most {limit}" in got["error"]["message"] and got["error"]["code"] == "context_too_long"
