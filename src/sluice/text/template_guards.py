"""Size bounds for the str methods and jinja filters a chat template calls, and the wrappers that apply them.

Separate from chat_template.py, which builds the sandbox and renders: this is the table of per-method and
per-filter estimates (how long can `.center(w)` or `|indent` make a string?) that the sandbox consults before
each call. The measuring itself (text_size, refuse, the meter) lives in template_limits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from . import template_limits as lim


def _replace_bound(s, old, new, count=-1) -> int:
    n = len(s) + 1 if not old else s.count(old)
    return len(s) + (n if count is None or count < 0 else min(n, count)) * len(new)


def _translate_bound(s, table) -> int:
    longest = max((len(v) for v in table.values() if isinstance(v, (str, bytes))), default=1) \
        if isinstance(table, Mapping) else 1
    return len(s) * max(longest, 1)


# str/bytes method -> an upper bound on the length of its result, from the receiver and the arguments.
_METHOD_BOUNDS: dict[str, Callable[..., int]] = {
    "center": lambda s, width, *_: len(s) + width, "ljust": lambda s, width, *_: len(s) + width,
    "rjust": lambda s, width, *_: len(s) + width, "zfill": lambda s, width: len(s) + width,
    "expandtabs": lambda s, tabsize=8: len(s) + s.count(b"\t" if isinstance(s, bytes) else "\t") * tabsize,
    "replace": _replace_bound, "translate": _translate_bound,
    "join": lambda s, items: lim.text_size(items) + len(s) * len(items),
    "format": lambda s, *args, **kwargs: lim.format_bound(s, args, kwargs),
    "format_map": lambda s, mapping: lim.format_bound(s, (), dict(mapping)),
}


def guard_method(obj, name, method):
    """`method` as the sandbox hands it to a template: for an amplifying str/bytes method, checked first."""
    bound = _METHOD_BOUNDS.get(name)
    if bound is None or not isinstance(obj, (str, bytes)) or not callable(method):
        return method

    def guarded(*args, **kwargs):
        if name == "join" and args:  # a generator would be used up by measuring it
            args = (list(args[0]), *args[1:])
        try:
            size = bound(obj, *args, **kwargs)
        except (TypeError, ValueError, AttributeError):  # bad arguments: let the method itself say so
            size = 0
        lim.refuse(f"the result of .{name}()", size)
        return method(*args, **kwargs)

    return guarded


def _indent_bound(s, width=4, *_, **__) -> int:
    width = len(width) if isinstance(width, str) else width
    lines = s.count("\n") + 1 if isinstance(s, str) else lim.text_size(s)
    return lim.text_size(s) + lines * width


def _wordwrap_bound(s, width=79, break_long_words=True, wrapstring=None, *_, **__) -> int:
    return lim.text_size(s) * (1 + len(wrapstring if isinstance(wrapstring, str) else "\n"))


# filter -> an upper bound on its result's size, from its arguments (after the context/environment one).
_FILTER_BOUNDS: dict[str, Callable[..., int]] = {
    "center": lambda s, width=80: lim.text_size(s) + width, "indent": _indent_bound,
    "replace": lambda s, old, new, count=None: _replace_bound(str(s), old, new, count),
    "format": lambda s, *args, **kwargs: lim.percent_bound(str(s), kwargs or args),
    "wordwrap": _wordwrap_bound,
    "batch": lambda value, linecount, fill_with=None: 0 if fill_with is None else linecount,
    "slice": lambda value, slices, fill_with=None: slices,
    "pprint": lambda value: lim.text_size(value, indent=1),
}
# Filters that never turn their input into text, so measuring it would only cost time (`messages|length`
# runs inside loops over the messages).
_NO_TEXT = {"abs", "attr", "count", "d", "default", "dictsort", "first", "float", "groupby", "int", "items", "last",
            "length", "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "round", "select",
            "selectattr", "sort", "unique", "join", "tojson", "sum", "batch", "slice"}


def guard_filter(name: str, f):
    """Filter `f` measured on the way in and out, so no filter makes a value past the limits."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # context/eval context/environment
    bound = _FILTER_BOUNDS.get(name)

    @functools.wraps(f)
    def guarded(*args, **kwargs):
        if name == "join" and len(args) > skip:  # measure the items (not a generator that measuring would eat)
            items = list(args[skip])
            sep = args[skip + 1] if len(args) > skip + 1 else kwargs.get("d", "")
            lim.refuse("a joined string", lim.text_size(items) + len(str(sep)) * len(items))
            args = (*args[:skip], items, *args[skip + 1:])
        elif name not in _NO_TEXT and len(args) > skip:
            lim.refuse(f"the text of the {name} filter's input", lim.text_size(args[skip]))
        if bound is not None:
            try:
                size = bound(*args[skip:], **kwargs)
            except (TypeError, ValueError, AttributeError):  # bad arguments: let the filter itself say so
                size = 0
            lim.refuse(f"the result of the {name} filter", size)
        result = f(*args, **kwargs)
        lim.tick(result)
        lim.refuse(f"the result of the {name} filter", lim.shallow_size(result))
        return result

    return guarded
