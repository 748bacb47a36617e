"""The door: what LLM.generate accepts as prompts and params, checked once and turned into
`Request`s, the one form in which a generation enters the engine (LLM.add_request, the scheduler's
add()). One place where a bad argument becomes a RequestError naming the prompt, instead of a
crash or a silent misreading deep inside; nothing downstream checks or resolves again.

The checks are ordered so that none costs more than the request could ever be allowed to: the
params (and the engine's capacity for their max_tokens, a lower bound) before any prompt is read,
a token-id list's length before its elements are converted, and a text bounded by the tokenizer
from its byte count before it is tokenized (Tokenizer.encode(max_tokens=)).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..errors import ContextExceeded, RequestError
from .sampling_params import SamplingParams

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


@dataclass(frozen=True)
class Request:
    """One generation, checked: valid token ids that fit the context with room for max_tokens, and
    params resolved against the model's generation_config and validated (SamplingParams.with_defaults)."""
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # the params' stop_token_ids, and the model's eos ids unless ignore_eos
    prompt: str | None = None  # the text, when the prompt was given as text
    label: str = "this request"  # how errors name it ("prompt 2")


class Capacity(Protocol):
    """What the engine that runs the requests can take: refuses (RequestError, with numbers) before
    the prompts are read (`before`, a lower bound from max_tokens alone) and after (`after`)."""

    def refuse(self, index: int, params: SamplingParams) -> None: ...

    def before(self, params: list[SamplingParams]) -> None: ...

    def after(self, requests: list[Request]) -> None: ...


@dataclass
class Door:
    """The model's side of the checks: its tokenizer, vocabulary, context and defaults."""
    tokenizer: object
    vocab_size: int
    max_model_len: int
    generation_config: dict

    def params_list(self, n: int, params) -> list[SamplingParams]:
        """generate()'s params argument (None, one SamplingParams, or one per prompt) -> n of them."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * n
        if isinstance(params, (str, bytes)) or not hasattr(params, "__len__"):
            raise RequestError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        if len(params) != n:
            raise RequestError(f"got {len(params)} SamplingParams for {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise RequestError(f"params {i} must be a SamplingParams, got {type(p).__name__}")
        return list(params)

    def requests(self, prompts: list, params, capacity: Capacity, eos_ids, labels: list[str] | None = None,
                 fit_max_tokens: bool = False) -> list[Request]:
        """Check and resolve, before any compute. fit_max_tokens: the caller left max_tokens unset, so
        each request gets the model's default cut to what the context leaves after its prompt (as
        OpenAI and vLLM do)."""
        if not prompts:
            raise RequestError("no prompts given")
        limit = self.max_model_len
        params = [p.with_defaults(self.generation_config) for p in self.params_list(len(prompts), params)]
        for i, p in enumerate(params):
            p.validate(self.vocab_size)
            capacity.refuse(i, p)
            if p.max_tokens >= limit and not fit_max_tokens:
                raise RequestError(f"prompt {i} asks for max_tokens={p.max_tokens}, which leaves no room for a "
                                   f"prompt in the context of {limit} tokens (lower max_tokens)")
        # Every row needs at least one prompt token: refuse a hopeless batch before reading the prompts.
        capacity.before([replace(p, max_tokens=min(p.max_tokens, limit - 1)) for p in params]
                        if fit_max_tokens else params)
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            ids = self.prompt_ids(i, prompt)
            if fit_max_tokens:
                p = replace(p, max_tokens=max(1, min(p.max_tokens, limit - len(ids))))
            if len(ids) + p.max_tokens > limit:
                raise ContextExceeded(len(ids), p.max_tokens, limit, f"prompt {i} ")
            stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            out.append(Request(ids, p, frozenset(stop), prompt if isinstance(prompt, str) else None,
                               labels[i] if labels else f"prompt {i}"))
        capacity.after(out)
        return out

    def prompt_ids(self, i: int, prompt) -> list[int]:
        if isinstance(prompt, str):
            try:  # refused from its length alone when it cannot fit, before tokenizing
                ids = self.tokenizer.encode(prompt, max_tokens=self.max_model_len)
            except RequestError as e:
                raise RequestError(f"prompt {i}: {e}") from None
        else:
            ids = token_ids(i, prompt, self.vocab_size, self.max_model_len)
        if not ids:
            raise RequestError(f"prompt {i} is empty: at least one token is needed to condition on")
        return ids


@dataclass
class PoolCapacity:
    """The continuous-batching engine's: each request must fit its whole KV pool alone (it then never
    fails, see scheduler.py). check_fits is Scheduler.check_fits."""
    check_fits: object

    def refuse(self, index: int, params: SamplingParams) -> None:
        pass

    def before(self, params: list[SamplingParams]) -> None:
        for i, p in enumerate(params):
            self.check_fits(1, p.max_tokens, f"prompt {i}: ")

    def after(self, requests: list[Request]) -> None:
        for i, r in enumerate(requests):
            self.check_fits(len(r.prompt_token_ids), r.params.max_tokens, f"prompt {i}: ")
