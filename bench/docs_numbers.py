"""Every measured number in the docs, computed from docs/results/ and from the bundled model.

    python bench/docs_numbers.py            # rewrite every marked span in README.md, ARCHITECTURE.md, docs/*.md
    python bench/docs_numbers.py --check    # exit 1, naming each span whose text is not what it computes
    python bench/docs_numbers.py --list     # every value's name and text

A number in the prose is a marked span, `<!-- n:NAME -->text<!-- /n -->` (a table may span lines);
the script owns the text between the two comments and the prose around it is ours. NAME's first
part says where the value comes from: `model.` from the model that ships (bench/docs_model_numbers.py;
about a minute of CPU), `speed.` and `serve.` from the results files of bench/speed.py and
bench/serve_load.py (bench/docs_results.py; the ranges and ratios the prose reads are in
bench/docs_prose.py, the bundled model's experiments in bench/docs_bundled.py), and `r:FILE:PATH:FORMAT` is one field of docs/results/FILE.json: PATH is a JSON
Pointer without its leading slash (keys and list indices joined by `/`, a `/` inside a key written
`~1`), FORMAT a Python format spec, e.g.
`r:bench-quant:bits_per_byte/float32/bits_per_byte:.4f`. The scripts in bench/ write those files. A results file is never edited by hand: to change a number, rerun its benchmark.
tests/test_docs_numbers.py fails when a doc's span differs from what this computes, or names a value
that does not exist.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
SPAN = re.compile(r"<!-- n:(.+?) -->(.*?)<!-- /n -->", re.S)


def doc_files() -> list[Path]:
    return [p for p in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
            if p.is_file()]


def spans(text: str) -> list[tuple[str, str]]:
    """(name, current text) of every marked span, in order."""
    return [(m.group(1), m.group(2)) for m in SPAN.finditer(text)]


def render(text: str, values: dict[str, str]) -> str:
    """text with every span's contents replaced by its value; an unknown name is a KeyError naming it."""
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise KeyError(f"unknown docs number {name!r} (bench/docs_numbers.py --list names them)")
        return f"<!-- n:{name} -->{values[name]}<!-- /n -->"
    return SPAN.sub(one, text)


# --- the registry -------------------------------------------------------------------------------

sys.path.insert(0, str(ROOT / "bench"))
from docs_results import (card_values, load, profile_values, serve_values, spec_values,  # noqa: E402
                          speed_values, tp_values)

from docs_prose import profile_prose, quant_values, spec_prose, tp_prose  # noqa: E402
from docs_bundled import bundled_values  # noqa: E402


def model_values() -> dict[str, str]:
    from docs_model_numbers import values
    return values()


GROUPS = {"speed": speed_values, "serve": serve_values,
          "profile": lambda: {**profile_values(), **profile_prose()}, "spec": lambda: {**spec_values(), **spec_prose()},
          "tp": lambda: {**tp_values(), **tp_prose()}, "card": card_values, "bundled": bundled_values, "quant": quant_values,
          "model": model_values}


def field(name: str) -> str | None:
    """The text of an `r:FILE:PATH:FORMAT` value, or None when the file or the path is not there."""
    try:
        _, file, path, spec = name.split(":", 3)
        value = load(file + ".json")
        for key in path.split("/"):  # a JSON Pointer (RFC 6901) without its leading slash
            key = key.replace("~1", "/").replace("~0", "~")
            value = value[int(key)] if isinstance(value, list) else value[key]
        return format(value, spec)
    except (ValueError, KeyError, IndexError, TypeError, OSError):
        return None


def group(name: str) -> str:
    return "r" if name.startswith("r:") else name.split(".")[0]


def compute(names: set[str] | None = None) -> dict[str, str]:
    """Every value of each group that `names` touches (all groups when None), and the `r:` fields named."""
    wanted = {group(n) for n in names} if names is not None else set(GROUPS)
    out: dict[str, str] = {}
    for g, fn in GROUPS.items():
        if g in wanted:
            out.update(fn())
    for n in names or ():
        if group(n) == "r" and (text := field(n)) is not None:
            out[n] = text
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a span is stale")
    ap.add_argument("--list", action="store_true", help="print every value's name and text")
    ap.add_argument("--only", action="append", choices=[*GROUPS, "r"],
                    help="only the spans of this group (repeatable); e.g. skip the model's minute")
    args = ap.parse_args(argv)
    if args.list:
        for name, text in sorted(compute().items()):
            print(f"{name}: {text}")
        return 0
    docs = {p: p.read_text() for p in doc_files()}
    names = {n for t in docs.values() for n, _ in spans(t) if not args.only or group(n) in args.only}
    values = compute(names)
    values.update({n: old for t in docs.values() for n, old in spans(t) if n not in names})  # left as they are
    stale = 0
    for path, text in docs.items():
        new = render(text, values)
        if new == text:
            continue
        if args.check:
            for (name, old), (_, now) in zip(spans(text), spans(new)):
                if old != now:
                    stale += 1
                    print(f"{path.relative_to(ROOT)}: {name}: {old!r} should be {now!r}")
        else:
            path.write_text(new)
            print(f"rewrote {path.relative_to(ROOT)}")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
