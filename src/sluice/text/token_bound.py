"""A cheap lower bound on how many tokens a text needs, so an oversized prompt is refused before tokenizing.

Tokenizing costs about 100 bytes of memory per input character (a 10^8-character prompt took 11 GB and two
minutes before the engine could say it was too long). But one token stands for at most `max_token_bytes` bytes
of input, so a text of n UTF-8 bytes needs at least ceil(n / max_token_bytes) tokens, and that is known after
one pass over the string.

How `max_token_bytes` is derived from tokenizer.json, and what is assumed:
- the longest piece: for byte-level BPE (GPT-2, Llama 3, Qwen) each character of a vocabulary string is one
  input byte; otherwise the UTF-8 length of the piece is an upper bound (a metaspace "\u2581" is 3 bytes but
  stands for one space, a byte-fallback "<0x41>" is 6 characters for one byte: both overestimate, which is safe).
  Added tokens match their literal content, so their UTF-8 length counts too.
- normalizers may shrink the text before the model sees it, so the bound is multiplied by the most each one
  can shrink it: NFC/NFD and Lowercase 3x (KELVIN SIGN, 3 bytes, becomes "K"/"k"), NFKC/NFKD 4x
  (MATHEMATICAL BOLD A, 4 bytes, becomes "A"), Replace by the ratio of its pattern to its replacement.
- a pipeline that can drop or fuse input without bound (Strip, a Replace with "" or a regex, BERT cleaning,
  whitespace-dropping pre-tokenizers, WordPiece/WordLevel or a fused unknown token, added tokens that swallow
  neighbouring spaces with lstrip/rstrip) has no sound bound. For those the bound is multiplied by LOSSY_SLACK
  more: a prompt that is mostly droppable input beyond that is refused though it might have fit, which is the
  price of never tokenizing a 10^8-character prompt to find out.
"""

from __future__ import annotations

import json
import math

from tokenizers import pre_tokenizers

from ..errors import RequestError

LOSSY_SLACK = 8
# Tokenizer.encode's default bound on one call's text, whatever max_tokens says: tokenizing costs 60-250 bytes of
# memory per input byte (250 when each byte is a token), and the tokenizers library aborts the process, not
# raises, when that runs out ('a' * 10**8 under a 4 GB cap). 4 MiB is about a million tokens of prose, eight
# times the text of a 128k-token context; a caller who needs more sets Tokenizer.max_encode_bytes.
MAX_ENCODE_BYTES = 4 * 2**20
# Strings are measured in slices of this many characters, so counting bytes never copies a huge prompt whole.
_SLICE = 1 << 20
# Normalizer type -> the most it can shrink a text's UTF-8 bytes (see the module docstring).
_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1, "ByteLevel": 1}
# Pre-tokenizers that only split or re-spell the text, never drop any of it.
_KEEPS_ALL = {"ByteLevel", "Metaspace", "Punctuation", "Digits", "UnicodeScripts", "FixedLength"}


def utf8_bytes(text: str, what: str) -> int:
    """The UTF-8 length of `text`; a lone surrogate (invalid UTF-8 decoded with surrogateescape, say) is refused
    with its position, since the tokenizers library would fail on it with an unhelpful TypeError."""
    if text.isascii():  # O(1) in CPython: the string's own flag
        return len(text)
    total = 0
    for start in range(0, len(text), _SLICE):
        try:
            total += len(text[start:start + _SLICE].encode("utf-8"))
        except UnicodeEncodeError as err:
            pos = start + err.start
            code = ord(text[pos])
            # U+DC80..U+DCFF is how errors='surrogateescape' (argv, stdin) keeps a byte that was not UTF-8
            origin = (f"byte {bytes([code - 0xDC00])!r} of input that is not valid UTF-8, kept by "
                      "errors='surrogateescape'" if 0xDC80 <= code <= 0xDCFF else "a half of a UTF-16 pair")
            raise RequestError(f"{what} is not valid Unicode: character {pos:,} is the lone surrogate "
                               f"U+{code:04X} ({origin})") from None
    return total


def check_fits(n_bytes: int, max_tokens: int, per_token: int, what: str) -> None:
    """Refuse `what` when n_bytes cannot fit in max_tokens tokens of at most per_token bytes each."""
    if n_bytes > max_tokens * per_token:
        raise RequestError(f"{what} has {n_bytes:,} bytes of UTF-8; at most {max_tokens:,} tokens x {per_token:,} "
                           f"bytes per token = {max_tokens * per_token:,} bytes fit the context of "
                           f"{max_tokens:,} tokens")


def check_encode_bytes(n_bytes: int, limit: int | None, what: str) -> None:
    if limit is not None and n_bytes > limit:
        raise RequestError(f"{what} has {n_bytes:,} bytes of UTF-8, over the {limit:,} that one encode() call "
                           "takes (tokenizing costs up to ~250 bytes of memory per byte); set the tokenizer's "
                           "max_encode_bytes higher, or to None, to encode more at once")


def check_max_tokens(max_tokens) -> None:
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
        raise RequestError(f"max_tokens must be a non-negative int or None, got {max_tokens!r}")


def max_token_bytes(backend) -> tuple[int, bool]:
    """(the most input bytes one token can stand for, whether that bound is exact rather than slackened)."""
    shrink, lossless = _normalizer_shrink(_state(backend.normalizer))
    keeps, byte_level = _pre_tokenizer_keeps(_state(backend.pre_tokenizer))
    lossless = lossless and keeps
    vocab = backend.get_vocab(with_added_tokens=False)
    model = type(backend.model).__name__
    if model == "BPE" and byte_level and all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet()):
        longest = max((len(piece) for piece in vocab), default=1)  # one character per input byte
    else:
        longest = max((len(piece.encode("utf-8")) for piece in vocab), default=1)
        lossless = lossless and _model_keeps_all(backend.model, model)
        longest = max(longest, 4)  # an unknown character (at most 4 bytes) becomes one token
    for added in backend.get_added_tokens_decoder().values():
        longest = max(longest, len(added.content.encode("utf-8")))
        lossless = lossless and not (added.lstrip or added.rstrip)
    return longest * shrink * (1 if lossless else LOSSY_SLACK), lossless


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(state: dict | None) -> tuple[int, bool]:
    if state is None:
        return 1, True
    kind = state.get("type")
    if kind == "Sequence":
        parts = [_normalizer_shrink(s) for s in state.get("normalizers", [])]
        return math.prod(s for s, _ in parts), all(ok for _, ok in parts)
    if kind == "Replace":
        pattern, content = state.get("pattern", {}).get("String"), state.get("content", "")
        if pattern is None or not content:  # a regex, or a deletion: no bound on how much it removes
            return 1, False
        return max(1, math.ceil(len(pattern.encode("utf-8")) / len(content.encode("utf-8")))), True
    if kind in _SHRINK:
        return _SHRINK[kind], True
    return 1, False


def _pre_tokenizer_keeps(state: dict | None) -> tuple[bool, bool]:
    """(drops nothing, is byte-level)."""
    if state is None:
        return True, False
    kind = state.get("type")
    if kind == "Sequence":
        parts = [_pre_tokenizer_keeps(s) for s in state.get("pretokenizers", [])]
        return all(k for k, _ in parts), any(b for _, b in parts)
    if kind == "Split":
        return state.get("behavior") != "Removed", False
    return kind in _KEEPS_ALL, kind == "ByteLevel"


def _model_keeps_all(model, kind: str) -> bool:
    # Unknown input must become one token per character (byte fallback, or an unfused unk token);
    # otherwise any amount of it can vanish or fuse into a single token.
    if kind == "BPE":
        return bool(model.byte_fallback) or (model.unk_token is not None and not model.fuse_unk)
    if kind == "Unigram":
        return bool(_state(model).get("byte_fallback"))
    return False
