"""tools, tool_choice, response_format and tool messages through the HTTP layer, from a scripted engine
whose text the test chooses: the openai client's and LangChain's own parsing of the tool calls (whole and
streamed), the constraint and template inputs each choice asks of the engine, and the 400s naming fields."""

from __future__ import annotations

import json

import pytest

from sluice.engine.logprobs import TokenLogprob
from server_harness import LiveServer, ScriptedEngine, assert_error_shape, request, sse_events

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
HERMES = f"I will check.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"


class Replies:
    """What the scripted engine answers every choice with: `reply`, three characters per Delta (so stream
    pieces split names, keys and tags), finishing with "stop"."""

    def __init__(self):
        self.reply = HERMES

    def __call__(self, request, i):
        pieces = [self.reply[at:at + 3] for at in range(0, len(self.reply), 3)]
        return [(p, [TokenLogprob(0, p, -0.5, list(p.encode()), [])]) for p in pieces]  # one "token" a piece


@pytest.fixture(scope="module")
def fake():
    live = LiveServer(ScriptedEngine(Replies(), finish="stop"))
    yield live
    live.stop()


@pytest.fixture
def engine(fake):
    """The scripted engine, answering HERMES until a test sets engine.script.reply."""
    fake.engine.script.reply = HERMES
    return fake.engine


def post(fake, body):
    return request(fake.port, "POST", "/v1/chat/completions", {"messages": USER, **body})


def test_auto_reads_hermes_blocks_into_tool_calls(fake, engine):
    out = fake.client().chat.completions.create(model="fake", messages=USER, tools=[WEATHER, NOOP], n=2)
    sent = engine.requests[-1]
    assert sent.tools == [WEATHER, NOOP] and sent.params[0].constraint is None  # free text, tools shown
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check.\n"
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == CALL["arguments"]
    assert out.choices[0].message.tool_calls[0].id != out.choices[1].message.tool_calls[0].id
    engine.script.reply = "Just text."
    plain = fake.client().chat.completions.create(model="fake", messages=USER, tools=[WEATHER])
    assert plain.choices[0].message.content == "Just text." and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


def test_a_streamed_call_comes_in_openais_delta_shape(fake, engine):
    status, _, raw = post(fake, {"tools": [WEATHER], "stream": True})
    assert status == 200, raw
    deltas = [e["choices"][0] for e in sse_events(raw)[:-1]]
    calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
    assert all(len(c) == 1 and c[0]["index"] == 0 for c in calls)
    first, rest = calls[0][0], [c[0] for c in calls[1:]]
    assert set(first) == {"index", "id", "type", "function"} and first["function"] == {"name": "get_weather",
                                                                                       "arguments": ""}
    assert all(set(r) == {"index", "function"} and set(r["function"]) == {"arguments"} for r in rest)
    assert json.loads("".join(r["function"]["arguments"] for r in rest)) == CALL["arguments"]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "I will check.\n"
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]
    # the openai client's own stream accumulator agrees
    with fake.client().chat.completions.stream(model="fake", messages=USER, tools=[WEATHER]) as stream:
        final = stream.get_final_completion()
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == CALL["arguments"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_are_constrained_and_read_back(fake, engine, stream):
    engine.script.reply = json.dumps([CALL, {"name": "noop", "arguments": {}}])
    body = {"tools": [WEATHER, NOOP], "tool_choice": "required", "stream": stream}
    assert post(fake, body)[0] == 200
    constraint = engine.requests[-1].params[0].constraint
    assert constraint.kind == "json_schema"
    jsonschema.validate(json.loads(engine.script.reply), constraint.spec)  # fits the constraint
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"days": 2}}], constraint.spec)
    client = fake.client()
    out = client.chat.completions.create(model="fake", messages=USER, tools=[WEATHER, NOOP], tool_choice="required")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.choices[0].message.tool_calls] == \
        [("get_weather", CALL["arguments"]), ("noop", {})]
    assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"
    post(fake, {**body, "parallel_tool_calls": False})
    assert engine.requests[-1].params[0].constraint.spec["maxItems"] == 1
    engine.script.reply = json.dumps(CALL["arguments"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="fake", messages=USER, tools=[WEATHER, NOOP], tool_choice=named)
    assert engine.requests[-1].params[0].constraint.spec == {**WEATHER["function"]["parameters"],
                                                             "additionalProperties": False}  # closed: see tools.py
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL["arguments"]


def test_logprobs_ride_along_with_tool_call_deltas(fake, engine):
    tokens = [HERMES[at:at + 3] for at in range(0, len(HERMES), 3)]
    out = fake.client().chat.completions.create(model="fake", messages=USER, tools=[WEATHER], logprobs=True)
    assert out.choices[0].message.tool_calls and [t.token for t in out.choices[0].logprobs.content] == tokens
    status, _, raw = post(fake, {"tools": [WEATHER], "logprobs": True, "stream": True})
    chunks = [e["choices"][0] for e in sse_events(raw)[:-1]]
    assert [t["token"] for c in chunks if c.get("logprobs") for t in c["logprobs"]["content"]] == tokens


def test_tool_choice_none_offers_no_tools(fake, engine):
    out = fake.client().chat.completions.create(model="fake", messages=USER, tools=[WEATHER], tool_choice="none")
    assert engine.requests[-1].tools is None and out.choices[0].message.content == HERMES
    assert out.choices[0].finish_reason == "stop"


def test_response_format_becomes_the_constraint(fake, engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    post(fake, {"response_format": {"type": "json_object"}})
    assert (lambda c: (c.kind, c.spec))(engine.requests[-1].params[0].constraint) == ("json_object", None)
    post(fake, {"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": schema,
                                                                           "strict": True}}})
    assert (lambda c: (c.kind, c.spec))(engine.requests[-1].params[0].constraint) == ("json_schema", schema)
    post(fake, {"response_format": {"type": "text"}})
    assert engine.requests[-1].params[0].constraint is None


def test_tool_messages_reach_the_template_in_transformers_shape(fake, engine):
    arguments = {"city": "Paris"}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    fake.client().chat.completions.create(model="fake", messages=messages, tools=[WEATHER])
    sent = engine.requests[-1].messages
    assert sent[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}


def test_legacy_functions_answer_in_function_call(fake, engine):
    fn = WEATHER["function"]
    out = fake.client().chat.completions.create(model="fake", messages=USER, functions=[fn])
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "function_call" and message.tool_calls is None
    assert message.function_call.name == "get_weather"
    assert json.loads(message.function_call.arguments) == CALL["arguments"]
    assert engine.requests[-1].tools == [{"type": "function", "function": fn}]
    status, _, raw = post(fake, {"functions": [fn], "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(raw)[:-1]]
    parts = [d["function_call"] for d in deltas if "function_call" in d]
    assert parts[0] == {"name": "get_weather", "arguments": ""}
    assert json.loads("".join(p["arguments"] for p in parts)) == CALL["arguments"]
    engine.script.reply = json.dumps(CALL["arguments"])
    named = fake.client().chat.completions.create(model="fake", messages=[*USER, {
        "role": "function", "name": "get_weather", "content": "sunny"}], functions=[fn],
        function_call={"name": "get_weather"})
    assert named.choices[0].message.function_call.name == "get_weather"
    assert engine.requests[-1].messages[-1] == {"role": "tool", "content": "sunny", "name": "get_weather"}


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
])
def test_bad_tool_fields_are_400s_naming_the_field(fake, body, param):
    error = assert_error_shape(*post(fake, body)[::2], 400)
    assert error["param"] == param, error


def test_langchain_binds_tools_and_streams_tool_call_chunks(fake, engine):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=f"{fake.url}/v1", api_key="none", model="fake", max_retries=0)

    def get_weather(city: str, days: int = 1) -> str:
        """The weather in a city."""
        return "sunny"
    bound = chat.bind_tools([get_weather])
    message = bound.invoke("Weather in Paris?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", CALL["arguments"])]
    chunks = list(bound.stream("Weather in Paris?"))
    assert any(c.tool_call_chunks for c in chunks)
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("get_weather", CALL["arguments"])]
