"""`[tokenizer] source`: `sluice train` reuses an existing tokenizer (a draft model must share its
target's byte for byte) instead of training a BPE, and refuses one that disagrees with the recipe."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

import sluice
from sluice.model.loading import bundled_model_dir
from sluice.training.corpus import CorpusError, load_corpus, train_tokenizer
from sluice.training.recipe import Recipe, RecipeError, TokenizerSpec
from sluice.training.train import run

TEXT = ["def add(a, b):\n    return a + b\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        "import os\n\nfor name in os.listdir('.'):\n    print(name)\n"]
MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
         "intermediate_size": 64, "max_position_embeddings": 64}
TRAIN = {"seq_len": 32, "micro_batch": 2, "grad_accum": 1, "steps": 3, "warmup_steps": 1, "eval_every": 3,
         "checkpoint_every": 2, "compile": False, "autocast_bf16": False}


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(9):
        (d / f"m{i}.py").write_text(TEXT[i % 3] * (4 + i))
    return d


@pytest.fixture
def tokenizer_json(tmp_path, corpus):
    """A 300-token BPE written with indented JSON: `tokenizers` would save it in other bytes, so only a
    byte copy keeps it identical."""
    r = Recipe.from_dict({"corpus": {"source": str(corpus), "heldout_percent": 25}})
    tok = train_tokenizer(load_corpus(r.corpus), TokenizerSpec(vocab_size=300))
    path = tmp_path / "src" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(json.loads(tok.to_str()), indent=2))
    assert path.read_text() != tok.to_str()
    return path


def recipe(corpus, source, vocab_size, base=None, **train):
    return Recipe.from_dict({"corpus": {"source": str(corpus), "heldout_percent": 25},
                             "tokenizer": {"source": source, "vocab_size": vocab_size},
                             "model": MODEL, "train": {**TRAIN, **train}}, base=base)


def test_a_run_with_a_reused_tokenizer_exports_it_byte_for_byte(tmp_path, corpus, tokenizer_json):
    run(recipe(corpus, str(tokenizer_json), 300), tmp_path / "run", log=lambda m: None, progress=False)
    out = tmp_path / "run" / "model"
    assert (out / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
    assert (tmp_path / "run" / "data" / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 300
    src = HFTokenizer.from_file(str(tokenizer_json))
    assert HFTokenizer.from_file(str(out / "tokenizer.json")).get_vocab() == src.get_vocab()
    model = sluice.load(out)
    assert model.config.vocab_size == 300
    assert sluice.Tokenizer.from_pretrained(out).encode("def add(a, b):") == src.encode("def add(a, b):").ids


def test_bundled_source_is_the_bundled_models_tokenizer(tmp_path, corpus):
    run(recipe(corpus, "bundled", 8192, steps=2, warmup_steps=1), tmp_path / "run", log=lambda m: None,
        progress=False)
    out = tmp_path / "run" / "model"
    assert (out / "tokenizer.json").read_bytes() == (bundled_model_dir() / "tokenizer.json").read_bytes()
    assert sluice.load(out).config.vocab_size == sluice.load().config.vocab_size == 8192


def test_a_relative_source_is_read_from_the_recipe_files_directory(tmp_path, corpus, tokenizer_json,
                                                                   monkeypatch):
    toml = tmp_path / "recipes" / "r.toml"
    toml.parent.mkdir()
    toml.write_text(f'[corpus]\nsource = "{corpus}"\n[tokenizer]\nsource = "../src"\nvocab_size = 300\n')
    monkeypatch.chdir(tmp_path)  # from here "../src" is elsewhere
    r = Recipe.load(toml)
    assert Path(r.tokenizer.source) == tokenizer_json.parent.resolve()  # a directory holding tokenizer.json


def test_a_missing_tokenizer_is_refused_by_name(tmp_path, corpus):
    with pytest.raises(RecipeError, match=r"nowhere/tokenizer\.json does not exist"):
        recipe(corpus, str(tmp_path / "nowhere" / "tokenizer.json"), 300)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match=r"empty/tokenizer\.json does not exist"):
        recipe(corpus, str(tmp_path / "empty"), 300)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(RecipeError, match="not a readable tokenizer"):
        recipe(corpus, str(tmp_path / "bad.json"), 300)


def test_a_vocab_size_that_disagrees_names_both(corpus, tokenizer_json):
    with pytest.raises(RecipeError, match=r"tokenizer\.vocab_size is 8192 but .* has 300 tokens"):
        recipe(corpus, str(tokenizer_json), 8192)
    with pytest.raises(RecipeError, match=r"tokenizer\.vocab_size is 300 but .* has 8192 tokens"):
        recipe(corpus, "bundled", 300)


def test_special_tokens_the_tokenizer_lacks_are_refused(corpus, tokenizer_json):
    with pytest.raises(RecipeError, match=r"\['<\|sep\|>'\] are not special tokens"):
        Recipe.from_dict({"corpus": {"source": str(corpus)},
                          "tokenizer": {"source": str(tokenizer_json), "vocab_size": 300,
                                        "special_tokens": ["<|sep|>"]}})


def test_resume_refuses_a_tokenizer_changed_since_the_run_began(tmp_path, corpus, tokenizer_json):
    r = recipe(corpus, str(tokenizer_json), 300)
    run(r, tmp_path / "run", stop_at=2, log=lambda m: None, progress=False)
    tokenizer_json.write_text(json.dumps(json.loads(tokenizer_json.read_text())))  # same tokens, other bytes
    with pytest.raises(CorpusError, match="differs from tokenizer.source"):
        run(r, tmp_path / "run", resume=True, log=lambda m: None, progress=False)
