"""Reading tool calls out of text (server/tool_calls.py) and the schema "required" constrains to
(server/tools.py): streamed in any split == read whole; Hermes blocks in free text; arrays of calls; a named
function's arguments; what max_tokens cuts; and the calls schema checked by jsonschema, a real validator."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from sluice.server.tool_calls import CallReader, merged, read_whole
from sluice.server.tools import calls_schema

jsonschema = pytest.importorskip("jsonschema")

CALLS = [("get_weather", {"city": 'Pa"ris}', "days": [1, {"a": 2}]}), ("f", {})]
ARRAY = "[ " + ", ".join(json.dumps({"arguments": a, "name": n}) for n, a in CALLS) + " ]"  # arguments first
HERMES = ("Let me look.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": CALLS[0][1]})
          + "\n</tool_call>\n<tool_call>not json</tool_call> <tool_")


def streamed(reader: CallReader, parts: list[str]):
    """The pieces of `parts` fed one by one, joined into (content, calls) as a client joins deltas."""
    pieces = merged([p for part in parts for p in reader.feed(part)] + reader.finish())
    content, calls = "", {}
    for p in pieces:
        if p.content is not None:
            content += p.content
        elif p.name is not None:
            assert p.call not in calls, "a call's name comes once, in its first piece"
            calls[p.call] = [p.name, p.arguments]
        else:
            calls[p.call][1] += p.arguments
    return content, [tuple(c) for c in calls.values()]


TEXTS = {"required": ARRAY, "auto": HERMES, "named": '  {"x": [1, "}"]}'}


def reader(mode: str) -> CallReader:
    return CallReader(mode, "g" if mode == "named" else None)


@pytest.mark.parametrize("mode", TEXTS)
def test_every_split_of_the_stream_reads_as_the_whole(mode):
    text = TEXTS[mode]
    content, calls = read_whole(reader(mode), text)
    assert calls
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for parts in splits:
        assert streamed(reader(mode), parts) == (content or "", calls), parts


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from(sorted(TEXTS)))
def test_any_split_into_many_pieces_reads_as_the_whole(data, mode):
    text = TEXTS[mode]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = read_whole(reader(mode), text)
    assert streamed(reader(mode), parts) == (content or "", calls)


def test_an_array_of_calls_keeps_each_arguments_text_raw():
    content, calls = read_whole(CallReader("required"), ARRAY)
    assert content is None and [(n, json.loads(a)) for n, a in calls] == CALLS
    assert calls[0][1] == json.dumps(CALLS[0][1])  # the model's own text, not a re-dump


def test_hermes_blocks_become_calls_and_the_rest_stays_content():
    content, calls = read_whole(CallReader("auto"), HERMES)
    assert calls == [("get_weather", json.dumps(CALLS[0][1]))]
    # the block that does not parse stays text; so does a tail that only looked like a block's start
    assert content == "Let me look.\n\n<tool_call>not json</tool_call> <tool_"
    assert read_whole(CallReader("auto"), "no calls here") == ("no calls here", [])


def test_a_block_with_only_calls_has_null_content_and_parameters_are_arguments():
    text = '<tool_call>{"name": "f", "parameters": "{\\"a\\": 1}"}</tool_call>\n'
    assert read_whole(CallReader("auto"), text) == (None, [("f", '{"a": 1}')])
    # an unclosed last block (a stop string took the close) is still a call if it parses
    assert read_whole(CallReader("auto"), '<tool_call>{"name": "f", "arguments": {}}') == (None, [("f", "{}")])


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = HERMES.replace("<tool_call>not json", "<tool_call>" + json.dumps({"name": "f", "arguments": {}}))
    assert [n for n, _ in read_whole(CallReader("auto"), two)[1]] == ["get_weather", "f"]
    assert [n for n, _ in read_whole(CallReader("auto", limit=1), two)[1]] == ["get_weather"]
    assert [n for n, _ in read_whole(CallReader("required", limit=1), ARRAY)[1]] == ["get_weather"]


def test_output_cut_before_any_name_is_content():
    assert read_whole(CallReader("required"), '[{"arguments": {"a": 1') == ('[{"arguments": {"a": 1', [])
    assert read_whole(CallReader("named", "g"), '{"a": ') == (None, [("g", '{"a": ')])  # cut inside: length


PARAMS = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}, "unit": {"enum": ["c", "f"]}},
          "required": ["loc"], "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}}


def test_the_calls_schema_takes_each_tools_arguments_and_refs():
    schema = calls_schema({"weather": PARAMS, "noop": {"type": "object", "properties": {}}}, None)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "weather", "arguments": {"loc": {"city": "Paris"}, "unit": "c"}}, {"name": "noop", "arguments": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "weather", "arguments": {"loc": {}}}], [{"name": "other", "arguments": {}}],
                [{"name": "weather", "arguments": {"loc": {"city": "P"}, "unit": "k"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = calls_schema({"weather": PARAMS}, 1)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([ok[0], ok[0]], one)
