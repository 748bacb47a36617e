"""`sluice train` against careless and hostile recipes: refused by name before anything is spent, a
model or batch too big for memory included (a run that goes wrong later: test_divergence.py)."""

import subprocess
import sys

import pytest
from bounded import run_bounded
from test_train import corpus, recipe  # noqa: F401  (corpus is a fixture)

import sluice
from sluice.training import budget
from sluice.training.corpus import CorpusError
from sluice.training.recipe import Recipe, RecipeError
from sluice.training.train import TrainingError


# ------------------------------------------------------------------ recipe values, by name
BAD_VALUES = [
    ("train", "lr", "nan", "nan"), ("train", "lr", "inf", "inf"), ("train", "lr", "-1e-3", "-0.001"),
    ("train", "lr", "0", "0"), ("train", "grad_clip", "inf", "inf"), ("train", "grad_clip", "nan", "nan"),
    ("train", "micro_batch", "true", "True"), ("train", "steps", "0", "0"), ("train", "seq_len", "-4", "-4"),
    ("train", "seq_len", "2.5", "2.5"), ("train", "weight_decay", "-0.1", "-0.1"),
    ("train", "betas", "[0.9]", r"\[0.9\]"), ("train", "betas", "[0.9, 1.0]", r"\[0.9, 1.0\]"),
    ("train", "betas", "[0.9, true]", r"\[0.9, True\]"), ("train", "betas", '"0.9"', "'0.9'"),
    ("train", "min_lr_ratio", "1.5", "1.5"), ("train", "init_std", "0", "0"),
    ("train", "eval_tokens", "0", "0"), ("train", "max_minutes", "-1", "-1"), ("train", "seed", "-1", "-1"),
    ("train", "autocast_bf16", "1", "1"), ("train", "autocast_bf16", "\"yes\"", "'yes'"), ("model", "num_kv_heads", "0", "0"),
    ("model", "num_kv_heads", "-2", "-2"), ("model", "head_dim", "7", "7"),
    ("model", "rope_theta", "nan", "nan"), ("model", "norm_eps", "0", "0"),
    ("model", "hidden_size", "false", "False"), ("tokenizer", "vocab_size", "100", "100"),
    ("tokenizer", "special_tokens", "[]", r"\[\]"), ("tokenizer", "special_tokens", '["a", "a"]', r"\['a', 'a'\]"),
    ("corpus", "heldout_percent", "0", "0"), ("corpus", "heldout_percent", "100", "100"),
    ("corpus", "glob", '"../*.py"', r"'\.\./\*\.py'"), ("corpus", "glob", '"/etc/*.conf"', "'/etc/"),
    ("corpus", "glob", '"a/../../x"', "'a/"), ("corpus", "glob", '""', "''"),
]


@pytest.mark.parametrize("section,key,toml,shown", BAD_VALUES)
def test_recipe_value_refused_by_file_key_and_value(tmp_path, section, key, toml, shown):
    path = tmp_path / "bad.toml"
    path.write_text(f"[{section}]\n{key} = {toml}\n")
    with pytest.raises(RecipeError, match=rf"bad\.toml: {section}\.{key} .*got {shown}"):
        Recipe.load(path)


def test_cross_field_rules_name_both_keys(tmp_path):
    cases = {"[train]\nsteps = 10\nwarmup_steps = 11\n": r"train\.warmup_steps must be <= train\.steps \(10\)",
             "[train]\nseq_len = 64\neval_tokens = 63\n": r"train\.eval_tokens must be >= train\.seq_len",
             "[model]\nnum_heads = 4\nnum_kv_heads = 3\n": r"model\.num_heads must be a multiple",
             "[train]\nseq_len = 4096\n": r"train\.seq_len must be <= model\.max_position_embeddings"}
    for text, message in cases.items():
        (tmp_path / "r.toml").write_text(text)
        with pytest.raises(RecipeError, match=message):
            Recipe.load(tmp_path / "r.toml")


def test_recipe_file_that_is_not_a_recipe(tmp_path):
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[train]\n")
    with pytest.raises(RecipeError, match="not valid UTF-8 TOML"):
        Recipe.load(tmp_path / "bin.toml")
    (tmp_path / "huge.toml").write_text("# x\n" * 300_000)
    with pytest.raises(RecipeError, match="a recipe is a few dozen lines"):
        Recipe.load(tmp_path / "huge.toml")
    with pytest.raises(RecipeError, match="must be a table"):
        Recipe.from_dict({"train": [1, 2]})


def test_shipped_recipes_still_load():
    from sluice.model.loading import bundled_model_dir
    import sluice.training as pkg
    from pathlib import Path
    recipes = [*(Path(pkg.__file__).parent / "recipes").glob("*.toml"), bundled_model_dir() / "recipe.toml"]
    assert len(recipes) == 4  # stdlib, stdlib-valves, stdlib-draft, the bundled copy
    for p in recipes:
        assert Recipe.load(p).train.steps > 0


# ------------------------------------------------------------------ sizes against memory
def test_huge_micro_batch_refused_before_allocating(tmp_path, corpus):  # noqa: F811
    """The issue's case: micro_batch = 10^8 grew to 15 GB before a MemoryError."""
    r = run_bounded(f"""
        from sluice.errors import SluiceError
        from sluice.training.recipe import Recipe
        from sluice.training.train import run
        r = Recipe.from_dict({{"corpus": {{"source": {str(corpus)!r}, "heldout_percent": 25}},
                              "tokenizer": {{"vocab_size": 300}},
                              "train": {{"micro_batch": 10**8, "compile": False}}}}, "big.toml")
        try:
            run(r, {str(tmp_path / 'run')!r}, log=print)
        except SluiceError as e:
            print(type(e).__name__, e)
    """, mem_mib=3072, timeout=120)  # a hang-stopper: 10x+ the ~4 s this takes here
    assert not r.timed_out and r.returncode == 0, r.stderr
    assert "BudgetError big.toml: training" in r.stdout and "micro_batch 100000000" in r.stdout
    assert "GiB" in r.stdout and "lower train.micro_batch" in r.stdout
    assert r.peak_mib < 1024, r.peak_mib
    assert not (tmp_path / "run").exists()  # refused before the run directory was even made


def test_budget_counts_what_grows_and_refuses_with_numbers(corpus):  # noqa: F811
    base = recipe(corpus)
    small = sum(budget.training_bytes(base, 10_000).values())
    # Each size the issue names moves the estimate: tokens x vocab logits, parameters x optimizer state.
    for bigger in (recipe(corpus, micro_batch=400), recipe(corpus, seq_len=64)):
        assert sum(budget.training_bytes(bigger, 10_000).values()) > small
    assert budget.training_bytes(base, 10**9)["weights, gradients, AdamW moments"] == 16 * 10**9
    logits = budget.training_bytes(recipe(corpus, micro_batch=1000), 0)["logits and their gradient"]
    assert logits == 3 * 1000 * 32 * 300 * 4
    with pytest.raises(budget.BudgetError, match=r"needs about .* GiB .*more than 80% of the 1.00 GiB .*test"):
        budget.check({"x": 2**30}, "a run", "lower it", available=(2**30, "test limit"))
    assert budget.check({"x": 2**29}, "a run", "", available=(2**30, "test")) == 2**29


def test_the_bundled_recipe_fits_a_laptop():
    """The estimate is not so pessimistic that it refuses the run that made the bundled model."""
    from sluice.training.train import model_config
    from pathlib import Path

    import sluice.training as pkg
    r = Recipe.load(Path(pkg.__file__).parent / "recipes" / "stdlib.toml")
    need = sum(budget.training_bytes(r, model_config(r, 8192, 0).num_params).values())
    assert 0.5 * 2**30 < need < 3 * 2**30


def test_cli_refuses_a_huge_model_in_one_line(tmp_path, corpus):  # noqa: F811
    toml = tmp_path / "r.toml"
    toml.write_text(f'[corpus]\nsource = "{corpus}"\n[model]\nhidden_size = 2000000000\n')
    p = subprocess.run([sys.executable, "-m", "sluice", "train", "--recipe", str(toml), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)  # hang-stopper, ~4 s
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "r.toml: training" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_sluice_error_is_what_every_failure_is():
    assert issubclass(TrainingError, sluice.SluiceError) and issubclass(budget.BudgetError, sluice.SluiceError)
    assert issubclass(RecipeError, sluice.SluiceError) and issubclass(CorpusError, sluice.SluiceError)
