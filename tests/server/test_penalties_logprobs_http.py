"""Penalties and logprobs through the HTTP layer: OpenAI's shapes (checked by the openai client's own
types) from a scripted engine, the 400s for bad values, and penalties reaching the real engine."""

from __future__ import annotations

import asyncio
import math

import pytest

from sluice.engine.logprobs import TokenLogprob, TopLogprob
from sluice.engine.sampling import SamplingParams
from sluice.server.engine import Delta, Done, Finished, RequestHandle, Started
from server_harness import LiveServer, assert_error_shape, make_engine, request

pytest.importorskip("openai")


def decode_one(i: int) -> str:
    return "é" if i == 3 else f"<{i}>"



TLP = lambda i, lp, top=(): TokenLogprob(i, decode_one(i), lp, list(decode_one(i).encode()),  # noqa: E731
                                         [TopLogprob(j, decode_one(j), v, list(decode_one(j).encode())) for j, v in top],
                                         entropy=i / 4)
# Choice 0: "é" then text held back ("" with a logprob), then "<1><2>" for two tokens; -inf becomes -9999.
SCRIPT = [[("é", [TLP(3, -0.5, [(3, -0.5), (7, -1.25)])]),
           ("", [TLP(1, -2.0, [(8, -0.25), (9, -1.5)])]),
           ("<1><2>", [TLP(2, -math.inf, [(8, -0.75), (9, -1.0)])])],
          [("<5>", [TLP(5, -0.125, [(5, -0.125), (6, -3.0)])])]]


class ScriptedEngine:
    """A ServingEngine that answers every request with SCRIPT (its first n choices), for the HTTP shapes."""
    model_name, max_model_len, ready, draining, load_error = "fake", 512, True, False, None
    system_fingerprint = "fp_fake"

    def __init__(self):
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        handle = RequestHandle(request, asyncio.get_running_loop())
        handle.emit(Started(prompt_tokens=3))
        n = len(request.params)
        for i in range(n):
            for text, lps in SCRIPT[i]:
                handle.emit(Delta(i, text, lps))
            handle.emit(Delta(i, "", None))  # nothing new: no chunk
            handle.emit(Finished(i, "length", len(SCRIPT[i])))
        handle.emit(Done())
        return handle

    def abort(self, handle, reason=None):
        pass


@pytest.fixture(scope="module")
def fake():
    live = LiveServer(ScriptedEngine())
    yield live
    live.stop()


def expected_chat(i):
    return [{"token": t.token, "logprob": max(t.logprob, -9999.0), "bytes": t.bytes,
             "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": a.bytes} for a in t.top],
             "entropy": t.entropy}  # sluice's extension
            for _, lps in SCRIPT[i] for t in lps]


def test_chat_logprobs_whole_and_streamed(fake):
    client = fake.client()
    out = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], n=2,
                                         logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=-1)
    params = fake.engine.requests[-1].params
    assert [(p.logprobs, p.presence_penalty, p.frequency_penalty) for p in params] == [(2, 0.5, -1.0)] * 2
    for i in range(2):
        assert [c.model_dump() for c in out.choices[i].logprobs.content] == expected_chat(i)
    assert out.choices[0].message.content == "é<1><2>"
    chunks = list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                                 logprobs=True, top_logprobs=2, stream=True))
    mine = [c.choices[0] for c in chunks]
    assert mine[0].logprobs is None and mine[-1].logprobs is None  # the role chunk and the finish chunk
    middle = mine[1:-1]
    assert [c.delta.content for c in middle] == ["é", "", "<1><2>"]
    assert [e.model_dump() for c in middle for e in c.logprobs.content] == expected_chat(0)
    plain = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert plain.choices[0].logprobs is None and fake.engine.requests[-1].params[0].logprobs is None
    zero = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    assert fake.engine.requests[-1].params[0].logprobs == 0 and zero.choices[0].logprobs.content


def test_completion_logprobs_whole_and_streamed(fake):
    client = fake.client()
    out = client.completions.create(model="fake", prompt="hi", logprobs=2, n=2)
    assert fake.engine.requests[-1].params[0].logprobs == 2
    lp = out.choices[0].logprobs
    assert lp.tokens == ["é", "<1>", "<2>"] and lp.token_logprobs == [-0.5, -2.0, -9999.0]
    # the chosen token joins the top alternatives when it is not among them ("logprobs + 1")
    assert lp.top_logprobs == [{"é": -0.5, "<7>": -1.25}, {"<8>": -0.25, "<9>": -1.5, "<1>": -2.0},
                               {"<8>": -0.75, "<9>": -1.0, "<2>": -9999.0}]
    assert lp.text_offset == [0, 1, 4]
    assert out.choices[1].logprobs.tokens == ["<5>"] and out.choices[1].logprobs.text_offset == [0]
    chunks = [c.choices[0] for c in client.completions.create(model="fake", prompt="hi", logprobs=2, stream=True)]
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert [c.text for c in chunks] == ["é", "", "<1><2>", ""]
    assert [x for s in streamed for x in s.tokens] == lp.tokens
    assert [x for s in streamed for x in s.text_offset] == [0, 1, 4]  # offsets run on across chunks
    assert [x for s in streamed for x in s.top_logprobs] == lp.top_logprobs
    assert lp.entropy == [0.75, 0.25, 0.5] and [x for s in streamed for x in s.entropy] == lp.entropy
    assert client.completions.create(model="fake", prompt="hi").choices[0].logprobs is None


@pytest.mark.parametrize("path,body,param", [
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"frequency_penalty": float("nan")}, "frequency_penalty"),
    ("chat", {"presence_penalty": "1"}, "presence_penalty"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"presence_penalty": 2.01}, "presence_penalty"),
])
def test_bad_values_are_400s_naming_the_parameter(fake, path, body, param):
    if path == "chat":
        status, _, raw = request(fake.port, "POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}], **body})
    else:
        status, _, raw = request(fake.port, "POST", "/v1/completions", {"prompt": "hi", **body})
    error = assert_error_shape(status, raw, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_penalties_reach_the_real_engine(tiny_dir, tiny_llm):
    engine, _ = make_engine(tiny_dir)
    live = LiveServer(engine)
    try:
        ids = tiny_llm.tokenizer.encode("def add(a, b):")
        kw = dict(temperature=0, max_tokens=24, ignore_eos=True)
        got = live.client().completions.create(model="tiny", prompt=ids, presence_penalty=0.5, frequency_penalty=2.0,
                                               temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
        want = tiny_llm.generate([ids], SamplingParams(presence_penalty=0.5, frequency_penalty=2.0, **kw))[0]
        plain = tiny_llm.generate([ids], SamplingParams(**kw))[0]
        assert got.choices[0].text == want.text and want.token_ids != plain.token_ids
        assert len(set(want.token_ids)) > len(set(plain.token_ids))  # fewer repeats
    finally:
        live.stop()
        engine.close()
