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

    def _read(self, key: str, default: Any, ok, what: str, null: Any = ABSENT, convert=None) -> Any:
        """The one reader: the value at `key` if present and ok(value) (then convert(value) when given),
        else a ConfigError naming the field, what it must be and the value; absent or null give
        `default` / `null` (see _get) unchecked."""
        value, absent = self._get(key, default, null)
        if absent:
            return value
        if not ok(value):
            raise self.fail(key, what, value)
        return value if convert is None else convert(value)

    def int(self, key: str, default: Any = ABSENT, lo: int = 1, hi: int = MAX_SIZE, null: Any = ABSENT) -> Any:
        """An integer in [lo, hi]: not a bool, not a float, not a string of digits."""
        return self._read(key, default, lambda v: is_int(v) and lo <= v <= hi, f"an integer in [{lo}, {hi}]", null)

    def number(self, key: str, default: Any = ABSENT, *, lo: float = 0.0, hi: float = math.inf,
               null: Any = ABSENT) -> Any:
        """A finite number in (lo, hi]: NaN, infinities, bools and strings are refused."""
        what = "a positive finite number" if (lo, hi) == (0.0, math.inf) else f"a number in ({lo}, {hi}]"
        return self._read(key, default, lambda v: is_number(v) and math.isfinite(v) and lo < v <= hi, what,
                          null, convert=float)

    def flag(self, key: str, default: Any = ABSENT) -> Any:
        """true or false. 0, 1 and "false" are refused: `bool("false")` is True."""
        return self._read(key, default, lambda v: isinstance(v, bool), "true or false")

    def text(self, key: str, default: Any = ABSENT) -> Any:
        return self._read(key, default, lambda v: isinstance(v, str), "a string")

    def mapping(self, key: str) -> dict | None:
        """A JSON object, or None when absent."""
        return self._read(key, None, lambda v: isinstance(v, dict), "a JSON object (a dict)")

    def sub(self, key: str) -> "Fields | None":
        """The fields of the object at `key`, named `key.field` in messages; None when absent."""
        inner = self.mapping(key)
        return None if inner is None else Fields(inner, self.source, f"{self.prefix}{key}.")

    def strings(self, key: str, allowed: tuple[str, ...] | None = None, length: int | None = None):
        """A list of strings (each from `allowed` when given; `length` items when given), or None."""
        what = "a list of strings" + (f" from {allowed}" if allowed else "")
        value = self._read(key, None, lambda v: isinstance(v, list) and all(
            isinstance(x, str) and (not allowed or x in allowed) for x in v), what)
        if value is not None and length is not None and len(value) != length:
            raise self.fail(key, f"{what}, one for each of the {length} layers", value)
        return value

    def token_ids(self, key: str) -> int | list[int] | None:
        """A token id, a non-empty list of them (eos_token_id may be several), or None."""
        def one(v):
            return is_int(v) and 0 <= v < 1 << 31
        return self._read(key, None, lambda v: (bool(v) and all(map(one, v))) if isinstance(v, list) else one(v),
                          "a token id (an integer >= 0), a list of them, or null")
