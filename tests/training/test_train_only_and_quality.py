"""`[corpus] train_only_parts` (files that add training tokens only) and the three quality measures of
sluice.training.quality (outside-stdlib set, ast-parse share of greedy completions)."""

import json

import numpy as np
import pytest

import sluice
from sluice.training import quality
from sluice.training.corpus import load_corpus, train_tokenizer
from sluice.training.data import prepare_data
from sluice.training.recipe import Recipe, TokenizerSpec

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 1\n"
TEST = "import unittest\n\n\nclass TestAdd(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(1, 1)\n"


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    for i in range(12):
        (d / "pkg").mkdir(parents=True, exist_ok=True)
        (d / "pkg" / f"m{i}.py").write_text(CODE * (3 + i))
        (d / "pkg" / "tests").mkdir(exist_ok=True)
        (d / "pkg" / "tests" / f"test_m{i}.py").write_text(TEST * (2 + i))
    (d / "junk" / "__pycache__").mkdir(parents=True)
    (d / "junk" / "__pycache__" / "x.py").write_text("excluded = True\n")
    return d


def spec(corpus, **kw):
    return Recipe.from_dict({"corpus": {"source": str(corpus), "heldout_percent": 30,
                                        "exclude_parts": ["__pycache__"], **kw}}).corpus


def test_train_only_files_train_but_never_hold_out_or_shape_the_tokenizer(corpus):
    plain = load_corpus(spec(corpus, exclude_parts=["tests", "__pycache__"]))
    mixed = load_corpus(spec(corpus, train_only_parts=["tests"]))
    everything = load_corpus(spec(corpus))
    # The held-out split and the core training files are those of the corpus without the tests ...
    assert mixed.heldout == plain.heldout and mixed.train == plain.train and plain.heldout
    assert sorted(p.name for p in mixed.extra) == sorted(f"test_m{i}.py" for i in range(12))
    assert not plain.extra and not everything.extra
    # ... whereas without the option some test files would be held out (30% of 12 by path hash).
    assert any("tests" in p.parts for p in everything.heldout)
    # The exclusion wins over train-only, and the tokenizer reads the core files alone.
    assert all("__pycache__" not in p.parts for p in mixed.extra + mixed.train)
    a = train_tokenizer(mixed, TokenizerSpec(vocab_size=300)).get_vocab()
    assert a == train_tokenizer(plain, TokenizerSpec(vocab_size=300)).get_vocab()


def test_train_only_tokens_join_the_training_stream(tmp_path, corpus):
    def prep(name, **kw):
        r = Recipe.from_dict({"corpus": {"source": str(corpus), "heldout_percent": 30,
                                         "exclude_parts": ["__pycache__"], **kw},
                              "tokenizer": {"vocab_size": 300}})
        meta = prepare_data(r, tmp_path / name, log=lambda m: None)
        return meta, np.load(tmp_path / name / "train.npy"), np.load(tmp_path / name / "heldout.npy")

    plain, plain_train, plain_held = prep("plain", exclude_parts=["tests", "__pycache__"])
    mixed, mixed_train, mixed_held = prep("mixed", train_only_parts=["tests"])
    assert np.array_equal(plain_held, mixed_held) and mixed["heldout_bytes"] == plain["heldout_bytes"]
    # The core stream comes first, unchanged; the test files' tokens follow it.
    assert np.array_equal(mixed_train[:plain_train.size], plain_train)
    assert mixed_train.size > plain_train.size and mixed["train_only_files"] == 12
    assert mixed["train_files"] == plain["train_files"] + 12
    assert mixed["train_bytes"] - plain["train_bytes"] == sum(len(TEST * (2 + i)) for i in range(12))
    assert json.loads((tmp_path / "mixed" / "data.json").read_text())["train_only_files"] == 12


def test_train_only_parts_is_checked():
    with pytest.raises(ValueError, match="train_only_parts"):
        Recipe.from_dict({"corpus": {"train_only_parts": "tests"}})
    with pytest.raises(ValueError, match="train_only_parts"):
        Recipe.from_dict({"corpus": {"train_only_parts": ["tests", "tests"]}})


def test_cut_and_parse():
    assert quality.cut_at_last_line("def f():\n    return 1\n    x = (") == "def f():\n    return 1\n"
    assert quality.cut_at_last_line("def f():") == ""
    assert quality.parses("def f():\n    return 1\n")
    assert not quality.parses("def f():\n")  # a header without a body
    assert not quality.parses("x = (" * 5000)  # deeply nested: refused, not a crash
    assert not quality.parses("a = '\x00'")


class _Fixed:
    """An LLM stand-in that answers each prompt with a fixed completion."""

    def __init__(self, texts):
        self.texts = texts

    def generate(self, prompts, params):
        assert params.temperature == 0 and params.max_tokens == 16
        return [type("Out", (), {"text": self.texts[p]})() for p in prompts]


def test_parse_share_cuts_each_completion_at_its_last_line():
    llm = _Fixed({"def f(x):": "\n    return x\n    if (",        # parses once cut
                  "class A:": "\n    pass",                         # no complete body line: bare header
                  "def g():": "\n        return 1\n"})              # parses (an indented body is fine)
    r = quality.completion_parse_share(llm, prompts=("def f(x):", "class A:", "def g():"), max_tokens=16)
    assert (r["parsed"], r["prompts"]) == (2, 3) and r["share"] == pytest.approx(2 / 3)
    assert [row["parses"] for row in r["rows"]] == [True, False, True]


def test_outside_set_is_the_named_installed_packages():
    files, versions = quality.outside_files()
    assert set(versions) == set(quality.OUTSIDE_PACKAGES) and "unknown" not in versions.values()
    roots = {p.parts[p.parts.index(name)] for p in files for name in quality.OUTSIDE_PACKAGES if name in p.parts}
    assert roots == set(quality.OUTSIDE_PACKAGES)
    assert all(p.suffix == ".py" and "__pycache__" not in p.parts for p in files)
    assert len(files) > 50 and len(set(files)) == len(files)
    with pytest.raises(quality.QualityError, match="no_such_pkg_sluice"):
        quality.outside_files(("no_such_pkg_sluice",))


def test_bundled_model_completions_are_counted():
    """The real bundled model through the real LLM: every prompt answered, the count consistent."""
    r = quality.completion_parse_share(sluice.LLM(), prompts=quality.PROMPTS[:4], max_tokens=24)
    assert r["prompts"] == 4 and len(r["rows"]) == 4 and r["parsed"] == sum(x["parses"] for x in r["rows"])
    assert all(row["completion"] for row in r["rows"])


def test_start_token_goes_before_each_prompt():
    class Ids(_Fixed):
        tokenizer = sluice.Tokenizer.from_pretrained(sluice.model.loading.bundled_model_dir())

        def generate(self, prompts, params):
            self.seen = prompts
            return [type("Out", (), {"text": "\n    return 1\n"})() for _ in prompts]

    llm = Ids({})
    r = quality.completion_parse_share(llm, prompts=("def f():",), max_tokens=16, start_token="<|endoftext|>")
    sep = llm.tokenizer.token_to_id("<|endoftext|>")
    assert llm.seen == [[sep, *llm.tokenizer.encode("def f():", add_special_tokens=False)]] and r["parsed"] == 1
    with pytest.raises(quality.QualityError, match="not in the model's vocabulary"):
        quality.completion_parse_share(llm, prompts=("def f():",), max_tokens=16, start_token="<|nope|>")
