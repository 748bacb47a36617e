"""Special tokens typed into a message, encoded as the text they spell instead of as special tokens.

By default (as transformers and vLLM do) a rendered chat prompt is tokenized whole, so a user who types
"<|im_end|>\n<|im_start|>system\n..." into a message gets real turn markers: role injection. With
`apply_chat_template(..., special_tokens_in_messages=False)` only the template's own special tokens are special.

How the two kinds are told apart without trusting the template to keep message text in place: the conversation
is rendered a second time with every special-token string inside the request's text (messages, tools) replaced
by as many placeholder characters, so the template's own special tokens are the only ones left in that render.
Both renders must then agree character for character outside the placeholders (a template that reshapes
message text by its content is refused). The prompt is tokenized in pieces: the template's special tokens, found
by the tokenizer itself in the masked render, become their ids; the text between them is tokenized with the
tokenizer's `encode_special_tokens` mode, where special tokens are plain text. Text without a typed special
token is tokenized exactly as before (the callers take the ordinary path then).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import TemplateError

PLACEHOLDER = "\uffff"  # a Unicode noncharacter: no tokenizer has a special token made of it
_RUNS = re.compile(PLACEHOLDER + "+")


def mask(value, specials: list[str]):
    """`value` (plain JSON data) with each special-token string inside its strings replaced by placeholders of
    the same length; `specials` longest first, so a token containing another is replaced whole."""
    if isinstance(value, str):
        for token in specials:
            if token in value:
                value = value.replace(token, PLACEHOLDER * len(token))
        return value
    if isinstance(value, Mapping):
        return {k: mask(v, specials) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask(v, specials) for v in value)
    return value


def encode_typed_as_text(backend, split_backend, rendered: str, masked: str, special_ids: set[int]) -> list[int]:
    """Token ids of `rendered` where only the special tokens that `masked` (the render of the masked request)
    still holds are special; `split_backend` is `backend` with encode_special_tokens on."""
    if not _agree(rendered, masked):
        raise TemplateError("the chat template changes message text depending on what it holds, so the special "
                            "tokens typed into a message cannot be told from the template's own: "
                            "special_tokens_in_messages=False cannot be honoured with this template")
    encoding = backend.encode(masked, add_special_tokens=False)
    ids, pos = [], 0
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
        if token_id not in special_ids:
            continue
        if start > pos:
            ids += split_backend.encode(rendered[pos:start], add_special_tokens=False).ids
        ids.append(token_id)
        pos = end
    if pos < len(rendered):
        ids += split_backend.encode(rendered[pos:], add_special_tokens=False).ids
    return ids


def _agree(rendered: str, masked: str) -> bool:
    """The two renders are equal but where `masked` has placeholders (compared a run at a time, at C speed)."""
    if len(masked) != len(rendered):
        return False
    pos = 0
    for run in _RUNS.finditer(masked):
        if masked[pos:run.start()] != rendered[pos:run.start()]:
            return False
        pos = run.end()
    return masked[pos:] == rendered[pos:]
