"""The streaming chunk template (serving.Run._text_chunk) against the pydantic dump it stands in for."""

from __future__ import annotations

import json
import random
import types

import pytest

pytest.importorskip("fastapi")

from sluice.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from sluice.server.serving import _PLACEHOLDER, Run  # noqa: E402

TEXTS = ["", " the", 'say "hi"', "back\\slash", "tab\there\nnewline\r", "\x00\x01\x1f\x7f", "é中文🙂",
         "\u2028\u2029", "</script>", "{\"json\": [1]}", _PLACEHOLDER]


def run(chat: bool, include_usage: bool, model: str = "tiny") -> Run:
    """A Run as the app makes one, without an engine: only what _chunk reads."""
    base = dict(stream=True, stream_options={"include_usage": include_usage} if include_usage else None)
    req = (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **base) if chat
           else CompletionRequest(prompt="x", **base))
    r = Run.__new__(Run)
    r.engine, r.req, r.chat = types.SimpleNamespace(model_name=model), req, chat
    r.id, r.created, r._templates = ("chatcmpl-" if chat else "cmpl-") + "ab12", 1764547200, {}
    r.fingerprint = "fp_0123456789"
    return r


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_chunk_is_the_pydantic_chunk_byte_for_byte(chat, include_usage):
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(0, 0x80)] + ["é", "ß", "中", "🙂", "\u2028", "\ufeff", "\U0010ffff"]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for model in ("tiny", 'odd "model" é'):
        r = run(chat, include_usage, model)
        for index in (0, 3):
            for text in texts:
                fast, slow = r._text_chunk(index, text), r._chunk(index, text)
                assert fast == slow, (model, index, text)
                assert fast.startswith("data: ") and fast.endswith("\n\n")
                obj = json.loads(fast[6:])
                got = obj["choices"][0]["delta"]["content"] if chat else obj["choices"][0]["text"]
                assert got == text and obj["choices"][0]["index"] == index


def test_a_model_name_holding_the_placeholder_falls_back_to_pydantic():
    r = run(False, False, model=_PLACEHOLDER)  # its JSON string twice in the dump: no split
    assert r._text_chunk(0, "abc") == r._chunk(0, "abc")
    assert r._templates[0] is False
