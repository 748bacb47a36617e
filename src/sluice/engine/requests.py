"""What LLM.generate accepts as prompts, checked at the door: one place where a bad prompt argument
becomes a RequestError naming the prompt, instead of a crash or a silent misreading deep inside.

The checks are ordered so that none costs more than the request could ever be allowed to: a
token-id list's length is checked before its elements are converted, and a text is bounded by the
tokenizer from its byte count before it is tokenized (Tokenizer.encode(max_tokens=)).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence

import torch

from ..errors import RequestError

_FORMS = "a str, a list of token ids, or a list of those"


def _numpy_to_torch(x, what: str):
    """A numpy array of token ids as a tensor (so one set of checks serves both); anything else as is."""
    if type(x).__module__ != "numpy" or not hasattr(x, "dtype"):
        return x
    if x.dtype.kind not in "iu":
        raise RequestError(f"{what} is a numpy array of dtype {x.dtype}; token ids must be integers")
    return torch.as_tensor(x)


def as_prompt_list(prompts) -> list:
    """generate()'s prompts argument -> a list with one prompt (str or token-id sequence) per row."""
    prompts = _numpy_to_torch(prompts, "prompts")
    if isinstance(prompts, (bytes, bytearray, memoryview)):
        # bytes index as ints, so b"hi" would otherwise pass as the token ids [104, 105]
        raise RequestError(f"prompts is {type(prompts).__name__}; decode it to a str first "
                           f"(prompts must be {_FORMS})")
    if isinstance(prompts, str) or _is_id_row(prompts):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 2:  # a (B, T) batch of ids
            return list(prompts)
        raise RequestError(f"a tensor of prompts must be 1-D (token ids) or 2-D (rows of them), got shape "
                           f"{tuple(prompts.shape)}")
    if isinstance(prompts, Iterator) or not isinstance(prompts, Sequence):
        # a generator could be endless, and a set or dict has no order to match outputs to
        raise RequestError(f"prompts must be {_FORMS}, got {type(prompts).__name__} (pass a list)")
    return list(prompts)


def _is_id_row(x) -> bool:
    """A non-empty 1-D sequence whose first element is an integer: one prompt of token ids."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 1
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence) or len(x) == 0:
        return False
    return isinstance(x[0], numbers.Integral) and not isinstance(x[0], bool)


def token_ids(i: int, prompt, vocab: int, limit: int) -> list[int]:
    """Prompt i given as token ids -> a list of ints in [0, vocab), at most `limit` long."""
    prompt = _numpy_to_torch(prompt, f"prompt {i}")
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise RequestError(f"prompt {i} is {type(prompt).__name__}; decode it to a str first")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise RequestError(f"prompt {i} is a tensor of shape {tuple(prompt.shape)} and dtype {prompt.dtype}; "
                               "token ids must be a 1-D integer tensor")
    elif isinstance(prompt, Iterator) or not isinstance(prompt, Sequence):
        raise RequestError(f"prompt {i} must be a str or a list of token ids, got {type(prompt).__name__}")
    n = len(prompt)  # before any per-element work: a huge list costs nothing to refuse
    if n > limit:
        raise RequestError(f"prompt {i} has {n} token ids, more than the context of {limit} tokens "
                           "(shorten the prompt)")
    ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
    for t in ids:
        if type(t) is not int and (not isinstance(t, numbers.Integral) or isinstance(t, bool)):
            raise RequestError(f"prompt {i} has a token id that is not an integer: {t!r}")
        if not 0 <= t < vocab:
            raise RequestError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {t}")
    return [int(t) for t in ids]
