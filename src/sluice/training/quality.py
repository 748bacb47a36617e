"""How good a trained code model is, three ways (docs/bundled-model.md reports them):

1. bits per byte on the held-out stdlib files (train.write_card, on the recipe's split);
2. bits per byte on Python code from outside the standard library that no recipe reads: the
   pure-Python packages below, which sluice's own dependencies install (so every sluice install has
   them), next to gzip -9 and xz -9e on the same text;
3. the share of greedy completions of fixed prompts (function signatures, class headers) that
   `ast.parse` accepts once cut at their last complete line.

Nothing here runs the model's output: completions are only parsed."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path

from ..errors import SluiceError

# Packages of code written outside CPython, pulled in by sluice's own dependencies: click and h11
# (uvicorn), jinja2 (chat templates), markdown_it (rich), starlette (fastapi). 1.5 MB of .py.
OUTSIDE_PACKAGES = ("click", "h11", "jinja2", "markdown_it", "starlette")

# Fixed prompts, each ending at the end of a line (the tokenizer merges a newline with the following
# indentation, so a prompt ending in a bare newline is text the model never saw).
PROMPTS = (
    "def read_config(path):",
    "def parse_args(argv=None):",
    "def is_prime(n):",
    "def fibonacci(n):",
    "def merge_sorted(left, right):",
    "def flatten(items):",
    "def chunks(seq, size):",
    "def count_words(text):",
    "def load_json(path):",
    "def read_lines(filename):",
    "def retry(func, attempts=3):",
    "def quote(s):",
    "def main():",
    "def walk_files(root, pattern='*'):",
    "def format_size(num_bytes):",
    "def unique(iterable, key=None):",
    "def split_path(path):",
    "def _check_name(name):",
    "class Stack:",
    "class Point:",
    "class Node:",
    "class LRUCache:",
    "class Timer:",
    "class Error(Exception):",
    "class Config(dict):",
    "class Token(object):",
    "class Parser:",
    "import os\n\n\ndef list_dir(path):",
    "import sys\n\n\nclass Writer:",
    'class Counter:\n    """Count hashable items."""',
)


class QualityError(SluiceError, ValueError):
    """An evaluation set cannot be built on this machine."""


def outside_files(packages=OUTSIDE_PACKAGES) -> tuple[list[Path], dict[str, str]]:
    """The .py files of the packages, in sorted order, and each package's installed version."""
    files, versions = [], {}
    dists = importlib.metadata.packages_distributions()
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise QualityError(f"package {name!r} is not installed as a package directory; it is part of "
                               "the outside-stdlib evaluation set (sluice's own dependencies install it)")
        root = Path(next(iter(spec.submodule_search_locations)))
        files += sorted(p for p in root.rglob("*.py") if p.is_file() and "__pycache__" not in p.parts)
        try:
            versions[name] = importlib.metadata.version(dists.get(name, [name])[0])
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return files, versions


def cut_at_last_line(text: str) -> str:
    """The text up to and including its last newline (all of it when it ends in one)."""
    return text[:text.rfind("\n") + 1] if "\n" in text else ""


def parses(source: str) -> bool:
    """Whether `ast.parse` accepts the source. Only parsing: nothing is compiled or run."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def completion_parse_share(llm, prompts=PROMPTS, max_tokens: int = 64, start_token: str | None = None) -> dict:
    """Greedy completions of the prompts, each cut at its last complete line: how many parse.

    A prompt plus a completion that has not finished one line is the bare prompt, which does not
    parse (a header without a body): a model that never ends a line scores 0. start_token (the
    corpus' file separator, "<|endoftext|>") goes before each prompt's tokens: it tells a model
    trained on separated files that the prompt starts a file, not the middle of one."""
    from ..engine.sampling import SamplingParams

    todo = list(prompts)
    if start_token is not None:
        start = llm.tokenizer.token_to_id(start_token)
        if start is None:
            raise QualityError(f"start_token {start_token!r} is not in the model's vocabulary")
        todo = [[start, *llm.tokenizer.encode(p, add_special_tokens=False)] for p in prompts]
    outs = llm.generate(todo, SamplingParams(max_tokens=max_tokens, temperature=0))
    rows = []
    for prompt, out in zip(prompts, outs, strict=True):
        source = cut_at_last_line(prompt + out.text)
        rows.append({"prompt": prompt, "completion": out.text, "parses": parses(source)})
    ok = sum(r["parses"] for r in rows)
    return {"parsed": ok, "prompts": len(rows), "share": ok / len(rows), "max_tokens": max_tokens,
            "start_token": start_token, "rows": rows}
