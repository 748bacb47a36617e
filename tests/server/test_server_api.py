"""OpenAI's API around the generation, through the real openai client: a list of prompts in one
completions request (choices prompt-major, usage summed, streamed indices, limits before anything runs),
system_fingerprint, x-request-id, and the API key (--api-key or SLUICE_API_KEY, a 401 the client maps to
AuthenticationError)."""

from __future__ import annotations

import re
import shutil

import pytest

from server_harness import one_torch_thread  # noqa: F401 -- a fixture
from server_harness import LiveServer, assert_error_shape, metric, request, sse_events
from test_server import client, served  # noqa: F401 -- fixtures: a live server over the tiny model, its client

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "Once upon a time", "A"]
SAMPLED = dict(model="tiny", max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
FINGERPRINT = re.compile(r"fp_[0-9a-f]{10}")


def test_a_list_of_prompts_gives_each_prompts_choices_prompt_major(client):
    out = client.completions.create(prompt=PROMPTS, n=2, **SAMPLED)
    assert [c.index for c in out.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, n=2, **SAMPLED) for p in PROMPTS]
    # choice k is choice k % n of prompt k // n, as the same prompt sent alone gives it (seeds: seed + k % n)
    assert [c.text for c in out.choices] == [c.text for a in alone for c in a.choices]
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once, not n times
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 36
    ids = [[5, 6, 7], [8, 9]]
    by_ids = client.completions.create(prompt=ids, **SAMPLED)
    assert [c.text for c in by_ids.choices] == [client.completions.create(prompt=p, **SAMPLED).choices[0].text
                                               for p in ids]
    assert by_ids.usage.prompt_tokens == 5


def test_a_list_of_prompts_streams_each_choice_under_its_index(client):
    whole = client.completions.create(prompt=PROMPTS, n=2, **SAMPLED)
    texts, finished = [""] * 6, {}
    for chunk in client.completions.create(prompt=PROMPTS, n=2, stream=True, stream_options={"include_usage": True},
                                           **SAMPLED):
        assert FINGERPRINT.fullmatch(chunk.system_fingerprint)
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
        if not chunk.choices:
            assert chunk.usage.total_tokens == whole.usage.total_tokens
    assert texts == [c.text for c in whole.choices] and finished == {i: "length" for i in range(6)}


def test_a_list_is_refused_whole_before_anything_runs(served, client, monkeypatch):
    generated = metric(served.port, "generation_tokens_total")
    for prompt, says in ((["fine", ""], "prompt 1: the prompt is empty"),
                         ([[1, 2], [5] * 510], "prompt 1: this model's maximum context length is 512"),
                         ([[1, 2], [3, 10**6]], "prompt 1 has token ids outside the vocabulary"),
                         (["x"] * 129, "129 prompts x n=1 make 129 choices; a request may ask for at most 128")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(prompt=prompt, **SAMPLED)
        assert e.value.body["param"] == "prompt" and says in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["a"] * 9, n=16, **SAMPLED)
    assert e.value.body["param"] == "prompt" and "make 144 choices" in e.value.body["message"]
    # the tokens together: never less than one context (512 here), so three prompts of 200 tokens pass it
    monkeypatch.setattr("sluice.server.prompts.MAX_LIST_TOKENS", 8)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=[[5] * 200] * 3, **SAMPLED)
    assert e.value.body["param"] == "prompt"
    assert "prompts 0 to 2 of 3 have 600 tokens together; a request may send at most 512" in e.value.body["message"]
    assert metric(served.port, "generation_tokens_total") == generated  # none of them ran a token


def test_system_fingerprint_names_the_checkpoint_and_the_path(served, client, tiny_dir, tmp_path):
    from sluice.server.fingerprint import Fingerprint, checkpoint_identity
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    done = client.completions.create(prompt="hi", max_tokens=2, model="tiny")
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, stream=True))
    fp = Fingerprint(served.llm)
    assert chat.system_fingerprint == done.system_fingerprint == fp() and FINGERPRINT.fullmatch(fp())
    assert {c.system_fingerprint for c in chunks} == {fp()}
    forward = served.llm.batch_engine().scheduler.forward
    path = forward.use_fast
    try:
        forward.use_fast = not path  # the other path: rounding may differ, so the fingerprint does
        assert fp() != chat.system_fingerprint
    finally:
        forward.use_fast = path
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert checkpoint_identity(copy) == checkpoint_identity(tiny_dir)  # where it lies does not matter
    (copy / "generation_config.json").write_text('{"temperature": 0.5}')
    assert checkpoint_identity(copy) != checkpoint_identity(tiny_dir)


def test_x_request_id_is_echoed_or_made_on_every_response(served, client):
    raw = client.completions.with_raw_response.create(prompt="hi", max_tokens=2, model="tiny",
                                                      extra_headers={"X-Request-Id": "trace-7/a:b"})
    assert raw.headers["x-request-id"] == "trace-7/a:b" and raw.parse().choices[0].text is not None
    made = client.completions.with_raw_response.create(prompt="hi", max_tokens=2, model="tiny")
    assert re.fullmatch(r"req_[0-9a-f]{32}", made.headers["x-request-id"])
    body = {"prompt": "hi", "max_tokens": 2}
    for given, echoed in (("ok-1", True), ("has space", False), ("x" * 129, False), ("é", False), ("", False)):
        for method, path, payload in (("POST", "/v1/completions", body), ("POST", "/v1/completions", {"n": "x"}),
                                      ("GET", "/nowhere", None), ("GET", "/health", None),
                                      ("POST", "/v1/completions", {**body, "stream": True})):
            status, headers, _ = request(served.port, method, path, payload, {"X-Request-Id": given})
            rid = headers["x-request-id"]
            assert (rid == given) if echoed else re.fullmatch(r"req_[0-9a-f]{32}", rid), (given, path, status, rid)
    status, headers, raw_stream = request(served.port, "POST", "/v1/completions", {**body, "stream": True},
                                          {"X-Request-Id": "s-1"})
    assert status == 200 and headers["x-request-id"] == "s-1" and sse_events(raw_stream)[-1] == "[DONE]"


def test_api_key_401_is_openais_and_health_and_metrics_stay_open(served):
    keyed = LiveServer(served.engine, api_key="sekrit")
    try:
        status, headers, body = request(keyed.port, "POST", "/v1/completions", {"prompt": "hi"},
                                        {"Authorization": "Bearer wrong", "X-Request-Id": "k-1"})
        error = assert_error_shape(status, body, 401)
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
        assert headers["www-authenticate"] == "Bearer" and headers["x-request-id"] == "k-1"
        with pytest.raises(openai.AuthenticationError) as e:
            keyed.client("wrong").completions.create(prompt="hi", max_tokens=2, model="tiny")
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert request(keyed.port, "GET", "/health")[0] == 200 and request(keyed.port, "GET", "/metrics")[0] == 200
        assert keyed.client("sekrit").completions.create(prompt="hi", max_tokens=2, model="tiny").choices
    finally:
        keyed.stop()


def test_the_api_key_comes_from_the_flag_then_sluice_api_key(monkeypatch):
    from sluice.cli.serve import api_key
    from sluice.errors import ConfigError
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    assert api_key(None) is None and api_key("flag") == "flag"
    monkeypatch.setenv("SLUICE_API_KEY", "env")
    assert api_key(None) == "env" and api_key("flag") == "flag"
    for flag, env, named in ((None, "", "SLUICE_API_KEY"), ("  ", "env", "--api-key")):
        monkeypatch.setenv("SLUICE_API_KEY", env)
        with pytest.raises(ConfigError, match=f"{named} is empty"):
            api_key(flag)
