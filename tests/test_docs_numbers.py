"""The measured numbers in the docs are what bench/docs_numbers.py computes, never hand-typed.

Every `<!-- n:NAME -->text<!-- /n -->` span in README.md, ARCHITECTURE.md and docs/*.md must name a
known value and hold exactly its text. The values from docs/results/ are checked everywhere; the
`model.` values, measured on the bundled model (about half a minute of CPU), only on the Python
version whose standard library they were measured on (the surgery text comes from it), and they
carry the `slow` marker. To fix a failure: `python bench/docs_numbers.py` rewrites the spans.
"""

import difflib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("docs_numbers", ROOT / "bench" / "docs_numbers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


dn = _load()
DOCS = {p: p.read_text(encoding="utf-8") for p in dn.doc_files()}
USED = sorted({(name, str(p.relative_to(ROOT))) for p, t in DOCS.items() for name, _ in dn.spans(t)})


def _stale(values: dict[str, str], group: str) -> list[str]:
    out = []
    for path, text in DOCS.items():
        for name, current in dn.spans(text):
            if dn.group(name) == group and values[name] != current:
                if "\n" in current:  # a table: only the lines that differ
                    diff = difflib.unified_diff(current.splitlines(), values[name].splitlines(), lineterm="", n=0)
                    out.append(f"{path.relative_to(ROOT)}: {name}:\n" + "\n".join(list(diff)[2:]))
                else:
                    out.append(f"{path.relative_to(ROOT)}: {name} says {current!r}, the results give {values[name]!r}")
    return out


def test_spans_parse_and_render():
    text = "a <!-- n:speed.x -->old<!-- /n --> b <!-- n:serve.y -->1\n2<!-- /n -->"
    assert dn.spans(text) == [("speed.x", "old"), ("serve.y", "1\n2")]
    assert dn.render(text, {"speed.x": "new", "serve.y": "3"}) == \
        "a <!-- n:speed.x -->new<!-- /n --> b <!-- n:serve.y -->3<!-- /n -->"
    with pytest.raises(KeyError, match="speed.nope"):
        dn.render("<!-- n:speed.nope -->1<!-- /n -->", {"speed.x": "1"})


def test_a_results_field_is_read_and_formatted():
    path = "bits_per_byte/float32/bits_per_byte"
    want = dn.load("bench-quant.json")["bits_per_byte"]["float32"]["bits_per_byte"]
    assert dn.field(f"r:bench-quant:{path}:.3f") == f"{want:.3f}"
    assert dn.field("r:bench-quant:no/such/key:.3f") is None
    assert dn.field("r:no-such-file:a:.3f") is None


def test_the_docs_use_marked_numbers():
    groups = {dn.group(name) for name, _ in USED}
    assert {"speed", "serve", "profile", "spec", "tp", "card", "bundled", "quant", "model", "r"} <= groups, groups


def test_every_marker_names_a_known_value():
    names = {name for name, _ in USED if dn.group(name) != "model"}
    results = dn.compute(names)
    unknown = [f"{doc}: {name}" for name, doc in USED
               if dn.group(name) not in (*dn.GROUPS, "r") or (dn.group(name) != "model" and name not in results)]
    assert not unknown, "markers that name no value (bench/docs_numbers.py --list):\n" + "\n".join(unknown)


@pytest.mark.parametrize("group", ["speed", "serve", "profile", "spec", "tp", "card", "bundled", "quant", "r"])
def test_result_numbers_match_the_results_files(group):
    stale = _stale(dn.compute({name for name, _ in USED if dn.group(name) == group}), group)
    assert not stale, "run python bench/docs_numbers.py:\n" + "\n".join(stale)


@pytest.mark.slow
def test_model_numbers_match_the_shipped_model():
    recorded = {t for p, text in DOCS.items() for n, t in dn.spans(text) if n == "model.python"}
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if recorded and recorded != {here}:
        pytest.skip(f"the model numbers were measured on Python {sorted(recorded)}'s standard library, this is {here}")
    values = dn.compute({"model.python"})
    unknown = [f"{doc}: {name}" for name, doc in USED if name.startswith("model.") and name not in values]
    assert not unknown, "markers that name no value:\n" + "\n".join(unknown)
    stale = _stale(values, "model")
    assert not stale, "run python bench/docs_numbers.py:\n" + "\n".join(stale)
