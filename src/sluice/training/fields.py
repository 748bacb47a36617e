"""Typed recipe fields: every key of a recipe is read by one of these, so a bad value is refused
where it enters, by name, instead of surfacing later as a NaN, a hang or a torch traceback.

Each rule's `read(value)` returns the value in its Python form or raises `Bad` with the reason;
the recipe reader adds the file and `section.key`. TOML has no separate bool/int boundary in
Python (bool is an int subclass) and allows nan and inf, so every rule checks both explicitly."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import PurePosixPath, PureWindowsPath

from ..errors import SluiceError

# Sizes and counts beyond this are never meant: tensor dimensions and step counters stay well inside
# int32/int64 arithmetic, and the memory budget (budget.py) refuses what would not fit long before.
MAX_INT = 2**31 - 1


class RecipeError(SluiceError, ValueError):
    """The recipe file is missing, malformed, or has unknown or invalid keys."""


class Bad(ValueError):
    """A value broke its field's rule; the message says what the rule wants."""


@dataclass(frozen=True)
class Int:
    lo: int = 1
    hi: int = MAX_INT

    def read(self, v):
        if isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi:
            raise Bad(f"must be an integer in [{self.lo}, {self.hi}]")
        return v


@dataclass(frozen=True)
class Float:
    """A finite number in [lo, hi], or (lo, hi] / [lo, hi) where the end is open."""
    lo: float = 0.0
    hi: float = math.inf
    lo_open: bool = True
    hi_open: bool = True

    def read(self, v):
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        if ok:
            v = float(v)
            ok = (v > self.lo if self.lo_open else v >= self.lo) and (v < self.hi if self.hi_open else v <= self.hi)
        if not ok:
            lo, hi = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            raise Bad(f"must be a finite number in {lo}{self.lo:g}, {self.hi:g}{hi}")
        return v


@dataclass(frozen=True)
class Bool:
    def read(self, v):
        if not isinstance(v, bool):
            raise Bad("must be true or false")
        return v


@dataclass(frozen=True)
class BoolOrAuto:
    """true, false, or "auto": decided at run time by what the machine has."""
    def read(self, v):
        if not (isinstance(v, bool) or v == "auto"):
            raise Bad('must be true, false or "auto"')
        return v


@dataclass(frozen=True)
class Str:
    def read(self, v):
        if not isinstance(v, str) or not v or "\x00" in v:
            raise Bad("must be a non-empty string")
        return v


@dataclass(frozen=True)
class StrList:
    min_len: int = 0

    def read(self, v):
        if (not isinstance(v, (list, tuple)) or len(v) < self.min_len
                or not all(isinstance(s, str) and s and "\x00" not in s for s in v)):
            raise Bad(f"must be a list of at least {self.min_len} non-empty strings")
        if len(set(v)) != len(v):
            raise Bad("must not repeat an entry")
        return tuple(v)


@dataclass(frozen=True)
class Betas:
    """AdamW's (beta1, beta2): each in [0, 1), as torch requires, or the moments never decay."""

    def read(self, v):
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or not all(not isinstance(b, bool) and isinstance(b, (int, float)) and 0 <= b < 1 for b in v)):
            raise Bad("must be a list of two numbers, each in [0, 1)")
        return tuple(float(b) for b in v)


@dataclass(frozen=True)
class RelativeGlob:
    """A glob that can only match inside its directory: relative, no `..`, no drive or root."""

    def read(self, v):
        Str().read(v)
        posix, win = PurePosixPath(v), PureWindowsPath(v)
        if posix.is_absolute() or win.is_absolute() or win.drive or v.startswith(("/", "\\", "~")):
            raise Bad("must be a pattern relative to the corpus directory")
        if ".." in posix.parts or ".." in win.parts:
            raise Bad("must not contain '..' (it would match outside the corpus directory)")
        return v


def spec(default, rule):
    """A dataclass field with its default and the rule every recipe value for it must pass."""
    return field(default=default, metadata={"rule": rule})


def read_value(rule, value, where: str, key: str):
    """The one reader of recipe values: `value` as `rule` wants it, or the error naming where."""
    try:
        return rule.read(value)
    except Bad as e:
        raise RecipeError(f"{where}.{key} {e}, got {value!r}") from None
