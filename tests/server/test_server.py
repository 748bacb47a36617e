"""`sluice serve` through the real openai client, against a live uvicorn on a tiny random model: chat
and completions, streaming and not, n > 1, stop, seeds, usage, /v1/models, and the error shapes."""

from __future__ import annotations

import pytest

import sluice
from server_harness import one_torch_thread  # noqa: F401 -- a fixture
from server_harness import (MODEL, LiveServer, assert_error_shape, make_engine, metric, request,
                                 sse_events)

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The quick brown fox"}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def served(tiny_dir):
    engine, llm = make_engine(tiny_dir)
    live = LiveServer(engine)
    live.llm = llm
    yield live
    live.stop()
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = request(served.port, "GET", "/health")
    assert status == 200 and b"ok" in body


def test_chat_equals_the_engine_and_counts_usage(client, tiny_llm):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    ids = tiny_llm.chat_prompt(MESSAGES)
    ref = tiny_llm.generate([ids], sluice.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == MODEL
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 12)
    assert out.usage.total_tokens == len(ids) + 12


def test_max_completion_tokens_and_eos(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=5,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_chat_stream_follows_openais_contract(served, client):
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 12, "ignore_eos": True, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = request(served.port, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert len({c["id"] for c in events[:-1]}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}  # the role comes first
        assert [c["finish_reason"] for c in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        text = "".join(c["delta"].get("content", "") for c in mine)
        whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY).choices[0].message.content
        assert text == whole  # greedy: each streamed choice equals the non-streamed completion
    assert all(c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24


def test_completion_stream_through_the_client(client):
    whole = client.completions.create(model=MODEL, prompt="def add(a, b):", **GREEDY)
    stream = client.completions.create(model=MODEL, prompt="def add(a, b):", stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")


def test_token_id_prompts_equal_text_prompts(client, tiny_llm):
    ids = tiny_llm.tokenizer.encode("def add(a, b):")
    by_text = client.completions.create(model=MODEL, prompt="def add(a, b):", **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    by_list = client.completions.create(model=MODEL, prompt=[ids], **GREEDY)
    assert by_text.choices[0].text == by_ids.choices[0].text == by_list.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_seeds_reproduce_and_n_choices_are_seed_plus_index(client):
    kw = dict(model=MODEL, prompt="hello", temperature=1.0, max_tokens=10, extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.completion_tokens == 30
    again = client.completions.create(n=3, seed=11, **kw)
    assert [c.text for c in three.choices] == [c.text for c in again.choices]
    for i, choice in enumerate(three.choices):
        assert client.completions.create(seed=11 + i, **kw).choices[0].text == choice.text
    assert len({c.text for c in three.choices}) > 1  # different seeds, different samples


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=30,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # a stop string from the middle of the greedy text: the output is everything before its first match
    start = next(i for i in range(1, len(full) - 2) if full[i:i + 2].strip() and full[i:i + 2] not in full[:i + 1])
    stop = full[start:start + 2]
    cut = client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=30, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"


@pytest.mark.parametrize("field,value", [("temperature", 3.0), ("temperature", "hot"), ("top_p", 0), ("n", "2"),
                                         ("n", 0), ("max_tokens", 0), ("max_tokens", True), ("seed", 1.5),
                                         ("stop", [""]), ("stop", "x" * 257), ("stop", ["a"] * 17), ("top_k", -2), ("stream", "yes"), ("logprobs", "yes"),
                                         ("presence_penalty", 2.5), ("top_logprobs", 21), ("messages", []),
                                         ("min_p", float("nan"))])
def test_bad_fields_are_400s_naming_the_parameter(served, field, value):
    body = {"model": MODEL, "messages": MESSAGES, field: value}
    status, _, raw = request(served.port, "POST", "/v1/chat/completions", body)
    error = assert_error_shape(status, raw, 400)
    assert error["param"] == field and error["type"] == "invalid_request_error"


def test_bad_bodies_are_400s(served):
    for body in (b"{not json", b"[1, 2]", b"", b'{"messages": "hi"}', b'{"model": "tiny"}'):
        assert_error_shape(*request(served.port, "POST", "/v1/chat/completions", body)[::2], 400)
    error = assert_error_shape(*request(served.port, "POST", "/v1/completions", {"prompt": ["a", ""]})[::2], 400)
    assert error["param"] == "prompt" and error["message"].startswith("prompt 1: ")  # a list: the prompt named
    error = assert_error_shape(*request(served.port, "POST", "/v1/completions", {"prompt": [10**9]})[::2], 400)
    assert error["param"] == "prompt" and "vocabulary" in error["message"]
    for body in (b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}'):
        path = "/v1/completions" if b"prompt" in body else "/v1/chat/completions"
        error = assert_error_shape(*request(served.port, "POST", path, body)[::2], 400)  # a lone surrogate


def test_unsupported_fields_are_named(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    assert e.value.status_code == 400 and e.value.body["param"] == "suffix"
    assert "not supported" in e.value.body["message"]


def test_context_overflow_gives_both_token_counts(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 500, max_tokens=100)
    body = e.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "prompt"
    assert "500 in the prompt" in body["message"] and "100 for the completion" in body["message"]
    assert "512 tokens" in body["message"]
    # left unset, max_tokens shrinks to what the context has left instead of failing
    out = client.completions.create(model=MODEL, prompt=[5] * 500, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"


def test_unknown_model_route_and_method_are_404_405(served, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    assert_error_shape(*request(served.port, "GET", "/v1/nowhere")[::2], 404)
    assert_error_shape(*request(served.port, "GET", "/v1/chat/completions")[::2], 405)


def test_metrics_count_requests_and_tokens(served, client):
    before = metric(served.port, "generation_tokens_total")
    client.completions.create(model=MODEL, prompt="hi", **GREEDY)
    assert metric(served.port, "generation_tokens_total") == before + 12
    assert metric(served.port, "time_to_first_token_seconds_count") >= 1
    assert metric(served.port, "time_per_output_token_seconds_bucket", le="+Inf") >= 1
    assert metric(served.port, "num_requests_running") == 0 and metric(served.port, "ready") == 1



def test_tool_choice_none_is_honoured_as_asked(served):
    status, _, raw = request(served.port, "POST", "/v1/chat/completions",
                             {"messages": MESSAGES, "tool_choice": "none", "max_tokens": 2})
    assert status == 200, raw


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}, {"role": "system"}])
def test_a_message_without_content_is_refused(served, message):
    body = {"messages": [MESSAGES[0], message], "max_tokens": 2}
    error = assert_error_shape(*request(served.port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert error["param"] == "messages.1.content" and "is required" in error["message"]


def test_an_assistant_message_may_leave_content_out(served):
    body = {"messages": [*MESSAGES, {"role": "assistant"}, {"role": "user", "content": "and?"}], "max_tokens": 2}
    status, _, raw = request(served.port, "POST", "/v1/chat/completions", body)
    assert status == 200, raw


def _raw_exchange(port: int, head: bytes) -> bytes:
    """Send a request head and read what comes back; b"reset" if the server cut the connection first (it may,
    having answered, while the rest of an oversized head is still on its way)."""
    import socket
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        try:
            for i in range(0, len(head), 16384):
                s.sendall(head[i:i + 16384])
            while chunk := s.recv(65536):
                reply += chunk
        except (BrokenPipeError, ConnectionResetError):
            return reply or b"reset"
    return reply


def test_request_headers_are_bounded(served):
    def head(header_bytes: int) -> bytes:
        return (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: " + b"a" * header_bytes
                + b"\r\n\r\n")
    assert _raw_exchange(served.port, head(32 * 1024)).startswith(b"HTTP/1.1 200")  # a big cookie is fine
    reply = _raw_exchange(served.port, head(2**20))
    assert reply == b"reset" or reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), reply[:200]
    status, _, _ = request(served.port, "GET", "/health")  # and the server goes on
    assert status == 200
