"""Token ids -> text deltas for streaming, with stop strings cut out.

Two stages, each holding text back for its own reason:

1. Detokenization. Byte-level tokenizers split a multi-byte UTF-8 character across tokens, and
   decoding a partial character gives U+FFFD. Decoding the whole sequence at every step would
   fix that at O(n) per token; instead we keep two offsets into the ids, as TGI and vLLM do:
   `read_offset` (ids before it are already text) and `prefix_offset` (where the decode window
   starts, one emitted chunk earlier, so decoders that depend on the previous token, such as
   SentencePiece's leading space, see it). The new text is decode(window) minus
   decode(window before read_offset), released only once it no longer ends in U+FFFD.

2. Stop strings. A stop string can arrive split over several tokens, so any suffix of the
   pending text that could still grow into a stop string is held back. When a stop string
   completes, the text before it is released, `stopped` becomes True and nothing more is emitted.
"""

from __future__ import annotations

from typing import Callable

from ..errors import RequestError

_REPLACEMENT = "\ufffd"  # what the tokenizers library decodes an incomplete UTF-8 sequence to


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class TextStream:
    """Turns one request's generated token ids into text deltas.

    The concatenation of everything push() and finish() return equals decode(all ids), cut just
    before the first stop string if one appeared. `text` holds that concatenation so far.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None):
        self._decode = decode
        self._stops = list(stop or [])
        for s in self._stops:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop must be a non-empty string or a list of non-empty strings, got {s!r}")
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending = ""  # detokenized, held back because it may be the start of a stop string
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that is now safe to show (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        return self._release(self._detokenize(final=False), final=False)

    def finish(self) -> str:
        """End of generation: flush everything held back. Returns "" after a stop string."""
        if self.stopped:
            return ""
        return self._release(self._detokenize(final=True), final=True)

    def _detokenize(self, final: bool) -> str:
        window = self._ids[self._prefix_offset :]
        done = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(window)
        # Hold back a trailing partial character; at the end it stays, as in decode(all ids).
        if not final and (len(text) <= len(done) or text.endswith(_REPLACEMENT)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(done) :]

    def _release(self, new_text: str, final: bool) -> str:
        self._pending += new_text
        # Every stop string that started before the pending text would have been held, so the
        # earliest match in the pending text is the earliest in the whole output.
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            out, self._pending, self.stopped = self._pending[: min(hits)], "", True
        else:
            keep = 0 if final else _stop_prefix_len(self._pending, self._stops)
            cut = len(self._pending) - keep
            out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return out
