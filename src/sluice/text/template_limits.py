"""Bounds on what a chat template may compute: a template is untrusted code from a model repository.

jinja2's sandbox stops a template from reaching Python internals, but not from spending memory or time:
`{{ 'A' * 100000000 }}` grew to 14 GB, and two nested loops over range(10**5) never end. A render here runs
under a per-render `Meter` (a context variable, so concurrent renders in server threads don't share one) and
every place where a template can make something big checks the size *before* making it:

- any one value (string, list, the text of a printed container) holds at most MAX_VALUE_CHARS characters or
  items, and the rendered output at most MAX_VALUE_CHARS characters;
- everything produced over a render, temporaries included, adds up to at most MAX_WORK characters or items;
- loop iterations, calls, operators and filters count as steps: at most MAX_STEPS, and MAX_SECONDS of wall time;
- integers have at most MAX_INT_BITS bits (no real template needs more than 64).

Compiling comes before any of that and costs too: jinja parses the source, generates Python code and Python
compiles it, about 1.5-4.3 KiB of memory per lexer token (`"{{x}}" * 209000`, under the 1 MiB source limit, took
2.3 GB). So a template is lexed first, a stream that costs no memory, and refused past MAX_TEMPLATE_TOKENS: the
largest of 70 real templates (llama.cpp's models/templates: Gemma 4, Kimi, gpt-oss, Llama 3.x, Qwen3, Mistral,
DeepSeek, Command R) has 3,770 tokens (16.7 KB), under an eighth of it, and a template at the limit compiles in
1-2 s and under 150 MiB (bench/template_compile.py, docs/results/template-compile.json).

Measured: the Qwen3 template (with 20 tools) and the Llama 3 one render a 1000-message conversation in about 8
steps per message and 3-4 characters of work per output character, so MAX_STEPS fits ~250,000 messages and
MAX_WORK a prompt far over MAX_VALUE_CHARS; a hostile double loop is stopped by MAX_STEPS in about 2 s.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from string import Formatter

import jinja2.utils

from ..errors import TemplateError

MAX_VALUE_CHARS = 16 * 2**20
MAX_WORK = 256 * 2**20
MAX_STEPS = 2_000_000
MAX_SECONDS = 10.0
MAX_INT_BITS = 4096
MAX_TEMPLATE_TOKENS = 32_768


class Meter:
    """One render's running totals."""

    def __init__(self) -> None:
        self.steps, self.work, self.deadline = 0, 0, time.monotonic() + MAX_SECONDS

    def step(self, produced: int = 0) -> None:
        self.steps += 1
        self.work += produced
        if self.steps > MAX_STEPS:
            raise TemplateError(f"the chat template took more than {MAX_STEPS:,} steps (loop iterations, calls, "
                                "operators); templates are untrusted code and each render is bounded")
        if self.work > MAX_WORK:
            raise TemplateError(f"the chat template produced more than {MAX_WORK:,} characters or items in all "
                                "while rendering; templates are untrusted code and each render is bounded")
        if time.monotonic() > self.deadline:
            raise TemplateError(f"the chat template ran for more than {MAX_SECONDS:g} s; templates are untrusted "
                                "code and each render is bounded")


METER: ContextVar[Meter | None] = ContextVar("sluice_template_meter", default=None)


def tick(produced=None) -> None:
    """Count one step (and what it produced) against the current render, if one is running: filters also run
    at compile time, when jinja folds constants, and then only the size checks apply."""
    meter = METER.get()
    if meter is not None:
        meter.step(0 if produced is None else shallow_size(produced))


def bound_compile(tokens) -> None:
    """Count a template's lexer tokens (an iterator, e.g. Environment.lex(source)), stopping at the first past
    MAX_TEMPLATE_TOKENS: what parsing and compiling the template would cost grows with that count."""
    for n, (lineno, _, _) in enumerate(tokens, 1):
        if n > MAX_TEMPLATE_TOKENS:
            raise TemplateError(f"the chat template has more than {MAX_TEMPLATE_TOKENS:,} tokens (passed at line "
                                f"{lineno:,}); real templates have under 4,000, and compiling one costs memory in "
                                "proportion, so it is refused before compiling")


def refuse(what: str, size: int, limit: int = MAX_VALUE_CHARS) -> None:
    if size > limit:
        raise TemplateError(f"the chat template tried to make {what} of about {size:,} characters or items, over "
                            f"the limit of {limit:,} for any one value in a render")


def shallow_size(value) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 64
    return 0


def text_size(value, budget: int = MAX_VALUE_CHARS, indent: int = 0) -> int:
    """About len(str(value)) (or of its JSON with this indent), found without building it; stops counting once
    past `budget`. Containers matter: [s] * 1000 holds one string but prints it a thousand times."""
    total, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) + 2 * (depth > 0)
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 24
        elif depth > 64:  # deeper than any real data: a namespace holding itself, say
            total += 16
        else:
            if isinstance(item, jinja2.utils.Namespace):
                item = item._Namespace__attrs  # its repr is that of its attribute dict
            if isinstance(item, Mapping):
                children = [x for pair in item.items() for x in pair]
            elif isinstance(item, Collection):
                children = item
            else:  # functions, macros, generators, undefined: a short repr
                total += 32
                continue
            total += 2 + len(item) * (2 + indent * (depth + 1))
            stack.extend((child, depth + 1) for child in children)
        if total > budget:
            return total
    return total


def check_int(value, what: str):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateError(f"the chat template made {what} of {value.bit_length():,} bits, over the limit of "
                            f"{MAX_INT_BITS:,} bits")
    return value


# -- operators -------------------------------------------------------------------------------------------------

def binop_bound(op: str, left, right) -> None:
    """Refuse `left op right` before Python computes it, when its result would be too big."""
    seq = (str, bytes, list, tuple)
    if op == "*":
        for seq_side, n in ((left, right), (right, left)):
            if isinstance(seq_side, seq) and isinstance(n, int):
                refuse(f"a repetition ({type(seq_side).__name__} of {len(seq_side):,} x {n:,})",
                       len(seq_side) * max(n, 0))
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateError(f"the chat template multiplied integers of {left.bit_length():,} and "
                                f"{right.bit_length():,} bits, over the limit of {MAX_INT_BITS:,} bits")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if right * left.bit_length() > MAX_INT_BITS:
            raise TemplateError(f"the chat template computed {left} ** {right}, over the limit of "
                                f"{MAX_INT_BITS:,} bits for integers")
    elif op == "+" and isinstance(left, seq) and isinstance(right, seq):
        refuse("a concatenation", len(left) + len(right))
    elif op == "%" and isinstance(left, (str, bytes)):
        refuse("a %-formatted string", percent_bound(left, right))


_PERCENT_FIELD = re.compile(rb"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _ints(values) -> int:
    return sum(v for v in values if isinstance(v, int) and v > 0)


def percent_bound(fmt, args) -> int:
    """An upper bound on len(fmt % args): the text plus every width and precision (a * takes one from args)."""
    raw = fmt.encode("utf-8", "surrogatepass") if isinstance(fmt, str) else fmt
    flat = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    widths = 0
    for match in _PERCENT_FIELD.finditer(raw):
        for group in match.groups():
            widths += _ints(flat) if group == b"*" else int(group) if group else 0
    return len(fmt) + widths + text_size(args)


def format_bound(fmt: str, args, kwargs) -> int:
    """An upper bound on len(fmt.format(*args, **kwargs)): the text, the widths in each field's spec, and
    every int argument when a spec takes its width from an argument ("{:>{w}}")."""
    widths = 0
    for _, _, spec, _ in Formatter().parse(fmt):
        if spec:
            widths += sum(int(n) for n in re.findall(r"\d+", spec))
            if "{" in spec:
                widths += _ints([*args, *kwargs.values()])
    return len(fmt) + widths + text_size([args, kwargs])
