"""Typed reads of config.json fields, so that every value from_hf uses was checked where it entered.

A config.json is input from whoever published the checkpoint. JSON lets any field hold any type,
and Python makes the wrong ones look right: `True` is an int, `int("32")` works, `x or default`
turns a 0 into the default. So each field is read through one of these methods, which accept the
type the field means and nothing else, and refuse by name: `config.json: rope_theta must be a
positive finite number, got 0`. A field that is absent (or null, which transformers writes for
"unset") gets the documented default; a field that is present is never replaced by one.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

# Ceilings far above any real checkpoint. The real bound on sizes is the weight files (weights.py
# checks the config against the safetensors headers before anything is built); these keep the
# arithmetic before that check small (per-layer lists, products of two sizes fit in int64).
MAX_SIZE = 1 << 24  # hidden, intermediate, vocab, heads, head_dim, context: the largest real ~10^7
MAX_LAYERS = 1 << 16  # the deepest released decoders have ~10^2
ABSENT = object()


def shown(value: Any, limit: int = 80) -> str:
    """repr(value), shortened so a hostile 10^6-character value cannot flood an error message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Fields:
    """The fields of one JSON object (config.json, or a dict inside it such as rope_scaling)."""

    def __init__(self, raw: dict, source: str, prefix: str = ""):
        self.raw, self.source, self.prefix = raw, source, prefix

    def fail(self, key: str, what: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.source}: {self.prefix}{key} must be {what}, got {shown(value)}")

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _get(self, key: str, default: Any, null: Any = ABSENT):
        value = self.raw.get(key)
        if value is None and key in self.raw and null is not ABSENT:
            return null, True  # present as null: transformers' "off" where it differs from absent
        if value is None:
            if default is ABSENT:
                raise ConfigError(f"{self.source}: required field {self.prefix}{key!r} is missing")
            return default, True
        return value, False

    def int(self, key: str, default: Any = ABSENT, lo: int = 1, hi: int = MAX_SIZE, null: Any = ABSENT) -> Any:
        """An integer in [lo, hi]: not a bool, not a float, not a string of digits."""
        value, absent = self._get(key, default, null)
        if absent:
            return value
        if not (is_int(value) and lo <= value <= hi):
            raise self.fail(key, f"an integer in [{lo}, {hi}]", value)
        return value

    def number(self, key: str, default: Any = ABSENT, *, lo: float = 0.0, hi: float = math.inf,
               null: Any = ABSENT) -> Any:
        """A finite number in (lo, hi]: NaN, infinities, bools and strings are refused."""
        value, absent = self._get(key, default, null)
        if absent:
            return value
        if not (is_number(value) and math.isfinite(value) and lo < value <= hi):
            what = "a positive finite number" if (lo, hi) == (0.0, math.inf) else f"a number in ({lo}, {hi}]"
            raise self.fail(key, what, value)
        return float(value)

    def flag(self, key: str, default: Any = ABSENT) -> Any:
        """true or false. 0, 1 and "false" are refused: `bool("false")` is True."""
        value, absent = self._get(key, default)
        if absent:
            return value
        if not isinstance(value, bool):
            raise self.fail(key, "true or false", value)
        return value

    def text(self, key: str, default: Any = ABSENT) -> Any:
        value, absent = self._get(key, default)
        if absent:
            return value
        if not isinstance(value, str):
            raise self.fail(key, "a string", value)
        return value

    def mapping(self, key: str) -> dict | None:
        """A JSON object, or None when absent."""
        value, absent = self._get(key, None)
        if absent:
            return None
        if not isinstance(value, dict):
            raise self.fail(key, "a JSON object (a dict)", value)
        return value

    def sub(self, key: str) -> "Fields | None":
        """The fields of the object at `key`, named `key.field` in messages; None when absent."""
        inner = self.mapping(key)
        return None if inner is None else Fields(inner, self.source, f"{self.prefix}{key}.")

    def strings(self, key: str, allowed: tuple[str, ...] | None = None, length: int | None = None):
        """A list of strings (each from `allowed` when given; `length` items when given), or None."""
        value, absent = self._get(key, None)
        if absent:
            return None
        what = "a list of strings" + (f" from {allowed}" if allowed else "")
        if not (isinstance(value, list) and all(isinstance(v, str) and (not allowed or v in allowed)
                                                for v in value)):
            raise self.fail(key, what, value)
        if length is not None and len(value) != length:
            raise self.fail(key, f"{what}, one for each of the {length} layers", value)
        return value

    def token_ids(self, key: str) -> int | list[int] | None:
        """A token id, a non-empty list of them (eos_token_id may be several), or None."""
        value, absent = self._get(key, None)
        if absent:
            return None
        ok = is_int(value) and 0 <= value < 1 << 31
        if isinstance(value, list):
            ok = bool(value) and all(is_int(v) and 0 <= v < 1 << 31 for v in value)
        if not ok:
            raise self.fail(key, "a token id (an integer >= 0), a list of them, or null", value)
        return value
