"""Chat templates: compiled in jinja2's immutable sandbox, with transformers' globals and filters, and rendered
under the bounds of template_limits (a template from a model repository is untrusted code).

Where each bound is enforced: `+ * ** %` go through the sandbox's call_binop; every call through `call`; str
methods that can amplify (center, replace, join, format, ...) are wrapped when a template looks them up;
every filter is wrapped (those wrappers and their size estimates are in template_guards); and the parsed
template is rewritten so that each `{% for %}` loop counts its iterations and each `~` concatenation
measures its parts first. The rendered output is measured chunk by chunk as jinja generates it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from ..errors import RequestError
from . import template_limits as lim
from .template_guards import guard_filter, guard_method

MAX_NESTING = 100  # of the messages/tools data handed to a template: real JSON schemas nest ~10 deep


class TemplateRaised(Exception):
    """Raised by a template's own raise_exception(), to tell it apart from a template that is broken."""


def _raise_exception(message: str):
    raise TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, ') and takes no separators; templates expect json.dumps.
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    lim.refuse("a tojson text", lim.text_size(value, indent=max(width, 0)))
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses "_"-prefixed names, so `{% set ns.__x = ... %}` can't plant dunders."""

    def __init__(*args, **kwargs):  # jinja's own signature trick, so namespace(self=...) keeps working
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates may not set underscore-prefixed attribute {name!r}")


class _Dict:
    """Stands in for the `dict` global: templates can build dicts, but get no handle on the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _GenerationBlock(jinja2.ext.Extension):
    """Accept transformers' {% generation %}...{% endgeneration %} (marks assistant text for training masks)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@jinja2.pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    # jinja's sum is Python's: it would add lists to lists without ever passing through call_binop.
    if attribute is not None:
        iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
    total = start
    for item in iterable:
        total = environment.call_binop(None, "+", total, item)
    return total


@jinja2.pass_context
def _counted(context, iterable):
    """Wrapped around every {% for %} loop's iterable: one step per iteration."""
    for item in iterable:
        lim.tick()
        yield item


@jinja2.pass_context
def _concat(context, parts):
    """Replaces every `~`: measure the parts' text before building it ([s] * 1000 prints s a thousand times)."""
    lim.refuse("a ~ concatenation", sum(lim.text_size(p) for p in parts))
    text = "".join(map(str, parts))
    lim.tick(text)
    return text


def _finalize(value):
    # Every {{ ... }} passes here before jinja turns it into text.
    lim.refuse("a printed value", lim.text_size(value))
    lim.tick(value)
    return value


def _lipsum(n=5, html=True, min=20, max=100):
    lim.refuse("lorem ipsum", n * max * 16 if isinstance(n, int) and isinstance(max, int) else 0)
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _strftime_now(fmt):
    lim.refuse("a date", len(fmt) * 16 if isinstance(fmt, str) else 0)  # %c is 24 characters for 2
    return datetime.now().strftime(fmt)


class _Instrument(NodeTransformer):
    """Rewrite the parsed template so loops and `~` report to the meter (see the module docstring)."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "sluice_counted", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        parts = nodes.List(node.nodes, lineno=node.lineno)
        return nodes.Filter(parts, "sluice_concat", [], [], None, None, lineno=node.lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        lim.binop_bound(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        lim.tick(result)
        return lim.check_int(result, f"the result of {operator}")

    def call(self, context, obj, /, *args, **kwargs):
        result = super().call(context, obj, *args, **kwargs)
        lim.tick(result)
        lim.refuse("a call's result", lim.shallow_size(result))
        return lim.check_int(result, "a call's result")

    def getattr(self, obj, attribute):
        return guard_method(obj, attribute, super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        value = super().getitem(obj, argument)
        return guard_method(obj, argument, value) if isinstance(argument, str) else value


def compile_template(source: str) -> jinja2.Template:
    # trim/lstrip_blocks are the whitespace rules templates are written for.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                   extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters = {name: guard_filter(name, f) for name, f in {**env.filters, "sum": _sum,
                                                                 "tojson": _tojson}.items()}
    env.filters.update(sluice_counted=_counted, sluice_concat=_concat)
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace, dict=_Dict(),
                       strftime_now=_strftime_now, lipsum=_lipsum)
    lim.bound_compile(env.lex(source))
    try:
        return env.from_string(_Instrument().visit(env.parse(source)))
    except (RecursionError, SyntaxError) as err:  # jinja's parser recursing, or Python's compiler refusing
        raise lim.TemplateError(f"the chat template nests blocks or expressions too deeply to compile "
                                f"({type(err).__name__}: {err})") from None


def render(template: jinja2.Template, variables: dict, max_chars: int | None = None,
           too_long: Callable[[int], Exception] | None = None) -> str:
    """Render under a fresh meter. Past `max_chars` of output, raise `too_long(chars so far)`."""
    token = lim.METER.set(lim.Meter())
    chunks, total = [], 0
    try:
        for chunk in template.generate(**variables):
            total += len(chunk)
            if max_chars is not None and total > max_chars:
                raise too_long(total)
            if total > lim.MAX_VALUE_CHARS:
                raise lim.TemplateError(f"the chat template's output passed {lim.MAX_VALUE_CHARS:,} characters, "
                                        "the limit for a rendered prompt")
            chunks.append(chunk)
    finally:
        lim.METER.reset(token)
    return "".join(chunks)


def plain(value, check: Callable[[str, str], None], where: str, depth: int = 0):
    """Rebuild template inputs from plain JSON types (arbitrary objects would hand the template their methods),
    passing every string to `check(text, where)` (where: messages[1]['content'], say)."""
    if depth > MAX_NESTING:
        raise RequestError(f"{where} nests deeper than {MAX_NESTING} levels")
    if value is None or type(value) in (int, float, bool):
        return value
    for base in (bool, int, float, str):  # enums and numpy scalars become their base type
        if isinstance(value, base):
            value = base(value)
            if base is str:
                check(value, where)
            return value
    if isinstance(value, Mapping):
        return {plain(k, check, f"{where} key", depth + 1): plain(v, check, f"{where}[{k!r}]", depth + 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v, check, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if callable(getattr(value, "model_dump", None)):  # pydantic models (OpenAI SDK messages)
        return plain(value.model_dump(), check, where, depth + 1)
    return f"<{type(value).__name__}>"
