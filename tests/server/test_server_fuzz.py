"""Hypothesis throws request bodies at a live server: wrong types, out-of-range numbers, NaN, huge
ints, deep nesting, strange unicode, raw bytes. No request may get a 5xx; every refusal is a 4xx in
OpenAI's error shape; every acceptance is a well-formed completion or SSE stream."""

from __future__ import annotations

import json

import pytest

from server_harness import one_torch_thread  # noqa: F401 -- a fixture
from server_harness import MODEL, LiveServer, assert_error_shape, make_engine, request, sse_events

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                             HealthCheck.too_slow])


# slow: hypothesis throws hundreds of bodies at a live server
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

@pytest.fixture(scope="module")
def served(tiny_dir):
    # A short context bounds what an accepted request can cost: at most 40 tokens a request.
    engine, _ = make_engine(tiny_dir, max_queue=4, max_model_len=40)
    live = LiveServer(engine, max_body_bytes=20_000)
    yield live
    live.stop()
    engine.close()


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 60),
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(-1, 3), st.text(max_size=20))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)
text_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]), "text": st.text(max_size=30)})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "", 1]),
                                 "content": st.one_of(st.text(max_size=60), st.lists(text_part, max_size=2),
                                                      st.none(), anything)})
token_ids = st.lists(st.integers(-5, 600), min_size=0, max_size=60)

# Well-typed values, mostly in range: bodies made of these mostly get through to the engine.
TYPED = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(-1, 60),
    "max_completion_tokens": st.integers(0, 60),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 600),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "seed": st.integers(-2**80, 2**80),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logprobs": st.one_of(st.none(), st.booleans(), st.integers(0, 5)),  # a bool for chat, an int for completions
    "top_logprobs": st.integers(0, 20),
    "user": st.text(max_size=5),
}
# Every field either endpoint knows, with junk mixed in, and ones this server refuses by name.
JUNK = {
    **{name: st.one_of(strategy, anything) for name, strategy in TYPED.items()},
    "model": st.one_of(st.just(MODEL), st.text(max_size=10), anything),
    "n": st.one_of(st.integers(-1, 4), st.integers(15, 20), anything),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20), anything),
    "presence_penalty": st.one_of(st.floats(-3, 3), anything),
    "frequency_penalty": st.one_of(st.floats(-3, 3), anything),
    "logprobs": st.one_of(st.none(), st.booleans(), st.integers(-1, 25), anything),
    "top_logprobs": st.one_of(st.none(), st.integers(-1, 25), anything),
    "logit_bias": st.one_of(st.none(), st.just({}), anything),
    "echo": st.one_of(st.none(), st.booleans()),
    "best_of": st.one_of(st.none(), st.integers(0, 3)),
    "tools": st.one_of(st.none(), st.just([]), anything),
    "response_format": st.one_of(st.none(), st.just({"type": "text"}), anything),
    "unknown_field": anything,
}


def bodies(prompt_key: str, good, bad):
    return st.one_of(st.fixed_dictionaries({prompt_key: good}, optional=TYPED),
                     st.fixed_dictionaries({prompt_key: st.one_of(good, bad)}, optional=JUNK))


good_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=40)}), min_size=1, max_size=3)
CHAT = bodies("messages", good_messages, st.one_of(st.lists(message, min_size=0, max_size=3), anything))
COMPLETIONS = bodies("prompt", st.one_of(st.text(min_size=1, max_size=80), st.lists(st.integers(0, 511), min_size=1,
                                                                                    max_size=30)),
                     st.one_of(st.text(max_size=80), st.lists(st.text(max_size=20), max_size=2), token_ids,
                               st.lists(token_ids, max_size=2), anything))


def check(status: int, body: bytes, stream: bool) -> None:
    hypothesis.event(f"status {status}")  # --hypothesis-show-statistics: how many got through
    assert status < 500, body  # the point of the exercise
    if status >= 400:
        assert status in (400, 404, 413, 422, 429), (status, body)
        assert_error_shape(status, body)
        return
    assert status == 200
    if stream:
        events = sse_events(body)
        assert events[-1] == "[DONE]" and events[:-1]
        assert len({e["id"] for e in events[:-1]}) == 1
        finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert sorted(finishes) and len(finishes) == len({c["index"] for e in events[:-1] for c in e["choices"]})
    else:
        out = json.loads(body)
        assert out["choices"] and all(c["finish_reason"] in ("stop", "length") for c in out["choices"])
        usage = out["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@SETTINGS
@given(body=CHAT)
def test_fuzz_chat(served, body):
    status, _, raw = request(served.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    check(status, raw, body.get("stream") is True)


@SETTINGS
@given(body=COMPLETIONS)
def test_fuzz_completions(served, body):
    status, _, raw = request(served.port, "POST", "/v1/completions", json.dumps(body).encode())
    check(status, raw, body.get("stream") is True)


VALVES = st.one_of(
    st.fixed_dictionaries({"prompt": st.one_of(st.text(min_size=1, max_size=80), st.lists(st.integers(0, 511), min_size=1,
                                                                                         max_size=60))},
                          optional={"completion": st.text(max_size=80)}),
    st.fixed_dictionaries({"messages": good_messages}, optional={"completion": st.text(max_size=40)}),
    st.fixed_dictionaries({}, optional={"prompt": st.one_of(token_ids, anything), "completion": anything,
                                        "messages": st.one_of(st.lists(message, max_size=2), anything)}))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=VALVES)
def test_fuzz_valves(served, body):
    """The live page's route: a 4xx in OpenAI's shape, or the valves of a context within the model's."""
    status, _, raw = request(served.port, "POST", "/v1/sluice/valves", json.dumps(body).encode())
    hypothesis.event(f"status {status}")
    assert status < 500, raw
    if status >= 400:
        assert status in (400, 429), (status, raw)
        assert_error_shape(status, raw)
        return
    out = json.loads(raw)
    assert 1 <= out["tokens"] == len(out["token_ids"]) <= 40 and len(out["residual"]["rms_mean"]) == out["num_layers"] + 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                     st.integers(1, 400).map(lambda d: ("[" * d + "]" * d).encode()),
                     st.integers(3, 400).map(lambda d: ('{"prompt": ' + "[" * d + "1" + "]" * d + "}").encode())),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzz_raw_bytes(served, raw, path):
    status, _, body = request(served.port, "POST", path, raw)
    assert 400 <= status < 500, body
    assert_error_shape(status, body)
