"""SamplingParams: what a request asks of the sampler, validated, and filled from defaults.

Separate from sampling.py because this is request handling on the host (type and range checks,
generation_config.json precedence), while sampling.py is the tensor math of the decode step. The
public names are re-exported by sampling.py, where the rest of sluice imports them from.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from ..errors import RequestError
from .constraints import Constraint

DEFAULT_MAX_TOKENS = 256

# Our field name -> key in HF's generation_config.json.
_HF_KEYS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
# Used when neither the request nor generation_config sets a field; each one means "off".
_LIBRARY_DEFAULTS = {
    "max_tokens": DEFAULT_MAX_TOKENS,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def _is_int(v) -> bool:
    # bool is an int subclass; True as max_tokens is a bug in the caller, not a 1. The exact-type
    # test first skips the slow ABC check in the common case; numbers.* admits numpy scalars.
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _is_real(v) -> bool:
    return type(v) in (float, int) or (isinstance(v, numbers.Real) and not isinstance(v, bool))


# name -> (what the value must be, check). NaN fails every comparison, inf fails the upper bounds.
_RULES = {
    "max_tokens": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "temperature": ("a finite number in [0, 2]", lambda v: _is_real(v) and 0 <= v <= 2),
    "top_k": ("an integer >= -1 (0 or -1 turns it off)", lambda v: _is_int(v) and v >= -1),
    "top_p": ("a number in (0, 1]", lambda v: _is_real(v) and 0 < v <= 1),
    "min_p": ("a number in [0, 1]", lambda v: _is_real(v) and 0 <= v <= 1),
    "repetition_penalty": ("a finite number > 0", lambda v: _is_real(v) and 0 < v < math.inf),
    "presence_penalty": ("a number in [-2, 2]", lambda v: _is_real(v) and -2 <= v <= 2),
    "frequency_penalty": ("a number in [-2, 2]", lambda v: _is_real(v) and -2 <= v <= 2),
    "seed": ("an integer", _is_int),
    "logprobs": ("an integer in [0, 20] (how many alternatives to report; None = off)",
                 lambda v: _is_int(v) and 0 <= v <= 20),
    "prompt_logprobs": ("an integer in [0, 20] (how many alternatives to report per prompt token; None = off)",
                        lambda v: _is_int(v) and 0 <= v <= 20),
}


def _fail(name: str, rule: str, value) -> None:
    raise RequestError(f"{name} must be {rule}, got {value!r}")


@dataclass
class SamplingParams:
    """What a request asks of the sampler. None means "not given": with_defaults fills it."""

    max_tokens: int | None = None  # None -> generation_config max_new_tokens, else 256
    temperature: float | None = None  # 0 = greedy; None -> generation_config, else 1.0
    top_k: int | None = None  # 0 or -1 = off
    top_p: float | None = None  # (0, 1]; 1 = off
    min_p: float | None = None  # [0, 1]; 0 = off
    repetition_penalty: float | None = None  # > 0; 1 = off; over prompt + generated tokens
    # OpenAI's, over generated tokens only: logit -= presence * (count > 0) + frequency * count
    presence_penalty: float | None = None  # [-2, 2]; 0 = off
    frequency_penalty: float | None = None  # [-2, 2]; 0 = off
    seed: int | None = None  # None -> nondeterministic; any int (taken mod 2**64)
    stop: str | list[str] | None = None  # stop strings, excluded from the output
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n = each token's logprob and its n most likely alternatives
    # The output must match it: JSON, a JSON Schema, a regex or a grammar (constraints.py, guide.py)
    constraint: Constraint | None = None
    # None = off; n = each prompt token's logprob given the tokens before it (the first: None) and its n most
    # likely alternatives (engine/prompt_logprobs.py)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise RequestError naming the first bad field and its value. None fields pass."""
        for name, (rule, ok) in _RULES.items():
            value = getattr(self, name)
            if value is not None and not ok(value):
                _fail(name, rule, value)
        if self.stop is not None:
            rule = "a non-empty string or a list of non-empty strings"
            if not isinstance(self.stop, list):
                _fail("stop", rule, self.stop)
            for s in self.stop:
                if not isinstance(s, str) or not s:
                    _fail("stop", rule, s)
        if self.stop_token_ids is not None:
            upper = "" if vocab_size is None else f" < vocab size {vocab_size}"
            rule = f"a list of integers >= 0{upper}"
            if not isinstance(self.stop_token_ids, list):
                _fail("stop_token_ids", rule, self.stop_token_ids)
            for t in self.stop_token_ids:
                if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                    _fail("stop_token_ids", rule, t)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", "a bool", self.ignore_eos)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            _fail("constraint", "a sluice.Constraint or None", self.constraint)

    def with_defaults(self, generation_config: dict | None = None) -> SamplingParams:
        """A new, validated copy with every field but seed and the logprobs (None = off) filled.

        Precedence: the request, then the model's generation_config.json, then the library
        defaults. As in HF, do_sample false in the config means greedy (temperature 0) unless
        the request sets a temperature itself. eos ids are the engine's business, not ours.
        """
        cfg = generation_config or {}
        if not isinstance(cfg, dict):
            raise RequestError(f"generation_config.json must hold a JSON object, got {type(cfg).__name__}")
        from_cfg = {ours: cfg[hf] for ours, hf in _HF_KEYS.items() if cfg.get(hf) is not None}
        # A bad value in the model's file must not read as a bad request field: name the file and its key.
        for ours, value in from_cfg.items():
            rule, ok = _RULES[ours]
            if not ok(value):
                _fail(f"generation_config.json: {_HF_KEYS[ours]}", rule, value)
        do_sample = cfg.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            _fail("generation_config.json: do_sample", "true or false", do_sample)  # "false" would read as true
        if do_sample is False:
            from_cfg["temperature"] = 0.0
        filled = {
            name: getattr(self, name) if getattr(self, name) is not None else from_cfg.get(name, default)
            for name, default in _LIBRARY_DEFAULTS.items()
        }
        out = replace(self, **filled, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []))
        # Normalise numpy scalars and ints-for-floats only after replace() has validated them.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            setattr(out, name, float(getattr(out, name)))
        for name in ("max_tokens", "top_k"):
            setattr(out, name, int(getattr(out, name)))
        for name in ("seed", "logprobs", "prompt_logprobs"):  # optional: None stays None
            if getattr(out, name) is not None:
                setattr(out, name, int(getattr(out, name)))
        return out
