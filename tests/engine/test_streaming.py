"""TextStream: whole-character deltas over a real byte-level BPE, and stop strings."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sluice.errors import RequestError
from sluice.engine.streaming import TextStream

# Mostly English, so the few merges a tiny vocab affords go to ASCII and CJK / emoji stay split
# into byte tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
    "Streaming text one token at a time is easy until a character spans two tokens.",
    "世界 世界 こんにちは",
] * 20

TEXT = "Hello world! 世界 and 語彙 with 🙂 emoji, café ñ. The quick brown fox ends here: END"


def train(pre_tokenizer, decoder, alphabet):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 60, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


BYTE_TOK = train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), pre_tokenizers.ByteLevel.alphabet())


@pytest.fixture
def tok():
    return BYTE_TOK


def stream(tok, text, stop=None):
    ids = tok.encode(text).ids
    s = TextStream(tok.decode, stop)
    deltas = [s.push(t) for t in ids]
    return s, ids, deltas


def test_tokenizer_really_splits_characters(tok):
    ids = tok.encode(TEXT).ids
    assert tok.decode(ids) == TEXT
    partial = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert len(partial) >= 4, "the test needs tokens that are pieces of a character"


def test_deltas_are_whole_characters_and_add_up(tok):
    s, ids, deltas = stream(tok, TEXT)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens really were held back
    tail = s.finish()
    assert tail == ""
    assert "".join(deltas) == s.text == tok.decode(ids) == TEXT
    assert not s.stopped


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab lo.,世界語彙日本🙂🎉éñ\n")), max_size=40))
def test_any_text_streams_back_exactly(text):
    s, ids, deltas = stream(BYTE_TOK, text)
    deltas.append(s.finish())
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == s.text == text


def test_decode_window_stays_small(tok):
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return tok.decode(ids)

    ids = tok.encode(TEXT * 20).ids
    s = TextStream(decode)
    for t in ids:
        s.push(t)
    s.finish()
    assert s.text == TEXT * 20
    assert max(calls) <= 8, "the decode window should not grow with the sequence"


def test_prefix_window_keeps_sentencepiece_spaces():
    # Metaspace drops the leading space of the first token it decodes; the prefix window is what
    # keeps " world" from streaming out as "world".
    alphabet = sorted(set("".join(CORPUS).replace(" ", "▁")))
    tok = train(pre_tokenizers.Metaspace(), decoders.Metaspace(), alphabet)
    text = "Hello world, the quick brown fox"
    s, ids, deltas = stream(tok, text)
    assert "".join(deltas) + s.finish() == tok.decode(ids) == text


def test_stop_string_across_two_tokens_is_cut(tok):
    stop = "brown fox"  # the pre-tokenizer splits before " fox", so this cannot be one token
    ids = tok.encode(TEXT).ids
    assert not any(stop in tok.decode([t]) for t in ids)
    completes_at = next(j for j in range(1, len(ids) + 1) if stop in tok.decode(ids[:j]))
    s = TextStream(tok.decode, [stop])
    deltas = []
    for j, t in enumerate(ids, 1):
        deltas.append(s.push(t))
        assert s.stopped == (j >= completes_at)
    assert s.finish() == ""
    assert "".join(deltas) == s.text == TEXT[: TEXT.index(stop)]
    assert all(d == "" for d in deltas[completes_at - 1 :])  # nothing at or after the stop


def test_stop_string_of_split_characters(tok):
    stop = "語彙"  # each character is several byte tokens
    s, ids, deltas = stream(tok, TEXT, [stop])
    assert s.stopped and s.finish() == ""
    assert "".join(deltas) == s.text == TEXT[: TEXT.index(stop)]
    assert not any("\ufffd" in d for d in deltas)


def test_earliest_stop_wins_and_stop_at_start(tok):
    s, _, _ = stream(tok, TEXT, ["fox", "world", "END"])
    assert s.stopped and s.text == "Hello "
    s, _, deltas = stream(tok, TEXT, ["Hello"])
    assert s.stopped and s.text == "" and set(deltas) == {""}


def test_stop_that_never_completes_leaves_text_intact(tok):
    s, ids, deltas = stream(tok, TEXT, ["END!", "xyz"])
    assert not s.stopped
    assert s.text == TEXT[: -len("END")]  # "END" could still become "END!", so it waits
    tail = s.finish()
    assert tail == "END" and "".join(deltas) + tail == s.text == TEXT


def test_push_after_stop_returns_nothing(tok):
    s = TextStream(tok.decode, ["world"])
    for t in tok.encode("Hello world and more").ids:
        s.push(t)
    assert s.stopped and s.push(tok.encode(" again").ids[0]) == "" and s.text == "Hello "


def test_empty_stop_string_is_rejected():
    with pytest.raises(RequestError, match="stop must be .*got ''"):
        TextStream(lambda ids: "", ["ok", ""])


def test_two_stop_strings_inside_one_tokens_text_cut_at_the_first():
    """One token can carry several stop strings at once; the cut is at the one that starts first in
    the text, whatever their order in the stop list."""
    pieces = ["Hi ", "then STOP, or END first? ", "more"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    for stops in (["END", "STOP"], ["STOP", "END"]):
        s = TextStream(decode, stops)
        deltas = [s.push(0), s.push(1), s.push(2)]
        assert s.stopped and "".join(deltas) == s.text == "Hi then ", stops
    pieces[1] = "xENDySTOP"  # the first in the text is also the one listed second
    s = TextStream(decode, ["STOP", "END"])
    assert s.push(0) + s.push(1) == s.text == "Hi x" and s.stopped
