"""What the real engine's chat template gets from a request with tools and tool messages: on the tiny Qwen3
checkpoint (whose template knows tools) the very token ids transformers' apply_chat_template gives for the
same conversation; on the bundled model (whose template knows none) the calls written into the assistant's
text as <tool_call> blocks, so the conversation still renders and the model sees them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sluice
from server_harness import one_torch_thread  # noqa: F401 -- a fixture
from server_harness import LiveServer, make_engine, request

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ARGS = {"city": "Zürich"}
CONVERSATION = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": '{"temp": 21}'},
]


def served_prompt(model_dir, body) -> list[int]:
    """The token ids the engine rendered for one request (its LLM's chat_prompt, recorded)."""
    engine, llm = make_engine(model_dir)
    live = LiveServer(engine)
    seen = []
    real = llm.chat_prompt
    llm.chat_prompt = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    try:
        status, _, raw = request(live.port, "POST", "/v1/chat/completions", {"max_tokens": 1, **body})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens"] == len(seen[-1])
        return seen[-1]
    finally:
        live.stop()
        engine.close()


def test_a_template_that_knows_tools_gets_them_as_transformers_does(tiny_dir):
    ids = served_prompt(tiny_dir, {"messages": CONVERSATION, "tools": [WEATHER]})
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    hf_messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": ARGS}}
                                        for c in m["tool_calls"]]} if "tool_calls" in m else m
                   for m in CONVERSATION]
    want = ref.apply_chat_template(hf_messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    assert ids == list(want)
    text = ref.decode(ids)
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_response>" in text


def test_a_template_without_tools_sees_the_calls_as_text():
    bundled = Path(sluice.__file__).parent / "assets" / "sluice-stdlib"
    ids = served_prompt(bundled, {"messages": CONVERSATION, "tools": [WEATHER]})
    text = sluice.Tokenizer.from_pretrained(bundled).decode(ids, skip_special_tokens=False)
    block = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': ARGS}, ensure_ascii=False)}\n</tool_call>"
    assert f"<|im_start|>assistant\n{block}<|im_end|>" in text
    assert "<|im_start|>tool\n{\"temp\": 21}<|im_end|>" in text
