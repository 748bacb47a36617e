"""`sluice train` against careless and hostile recipes: refused by name before anything is spent,
and a run that goes numerically wrong stops instead of exporting a broken model."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from bounded import run_bounded
from test_train import corpus, recipe  # noqa: F401  (corpus is a fixture)

import sluice
from sluice.training import budget
from sluice.training.corpus import CorpusError
from sluice.training.recipe import Recipe, RecipeError
from sluice.training.train import TrainingError, evaluate, lr_at, run


def quiet(r, out, **kw):
    return run(r, out, log=lambda m: None, progress=False, **kw)


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
    """, mem_mib=3072, timeout=120)
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
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "r.toml: training" in p.stderr and len(p.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------ numbers that go wrong
def test_diverging_run_stops_and_exports_nothing(tmp_path, corpus):  # noqa: F811
    r = recipe(corpus, steps=6, lr=1e30, warmup_steps=0, checkpoint_every=1)
    # Caught by the per-step check (loss and gradient norm), before the optimizer step spreads it.
    with pytest.raises(TrainingError, match=r"training diverged at step \d: loss .*gradient norm .*train\.lr 1e\+30"):
        quiet(r, tmp_path / "run")
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "run" / "summary.json").exists()
    state = tmp_path / "run" / "state" / "resume.safetensors"
    if state.exists():  # whatever checkpoint was written before the divergence is finite
        from safetensors.torch import load_file
        assert all(torch.isfinite(v).all() for v in load_file(str(state)).values())
    rows = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in rows)  # nor logged


@pytest.mark.parametrize("steps,stop_at,checkpoint_every", [(3, None, 2), (4, 2, 100)])
def test_weights_gone_bad_reach_no_checkpoint(tmp_path, corpus, monkeypatch, steps, stop_at,  # noqa: F811
                                              checkpoint_every):
    """An optimizer step with no loss after it yet (a checkpoint step, or --stop-at's last) is caught
    by the save itself checking the weights."""
    real_step = torch.optim.AdamW.step

    def step_then_poison(self, *a, **kw):
        out = real_step(self, *a, **kw)
        if self.state[self.param_groups[0]["params"][0]]["step"] == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0][0, 0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_poison)
    with pytest.raises(TrainingError, match="diverged at step 2: the weights hold NaN or infinite values"):
        quiet(recipe(corpus, steps=steps, checkpoint_every=checkpoint_every, eval_every=100), tmp_path / "run",
              stop_at=stop_at)
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "run" / "state").exists()


def test_cli_reports_divergence_with_exit_2(tmp_path, corpus):  # noqa: F811
    toml = tmp_path / "r.toml"
    toml.write_text(f'[corpus]\nsource = "{corpus}"\nheldout_percent = 25\n[tokenizer]\nvocab_size = 300\n'
                    "[model]\nhidden_size = 32\nnum_layers = 1\nhead_dim = 8\nintermediate_size = 64\n"
                    "max_position_embeddings = 64\n[train]\nseq_len = 32\nmicro_batch = 2\nsteps = 5\n"
                    "warmup_steps = 0\nlr = 1e30\ncompile = false\nautocast_bf16 = false\neval_tokens = 64\n")
    p = subprocess.run([sys.executable, "-m", "sluice", "train", "--recipe", str(toml), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "training diverged" in p.stderr and not (tmp_path / "o" / "model").exists()


def test_a_heldout_split_too_small_to_measure_is_refused(tmp_path, corpus):  # noqa: F811
    r = recipe(corpus)
    r = Recipe.from_dict({**_raw(r), "corpus": {"source": str(corpus), "heldout_percent": 0.001}})
    with pytest.raises(CorpusError, match=r"held-out split has 0 tokens, fewer than one evaluation window"):
        quiet(r, tmp_path / "run")


def test_evaluate_refuses_to_measure_nothing():
    model = _Uniform(4)
    with pytest.raises(TrainingError, match="evaluation measured nothing"):
        evaluate(model, np.zeros(3, dtype=np.uint16), np.ones(4, dtype=np.int64), 8, 100, False)


# ------------------------------------------------------------------ the numbers themselves, by hand
def test_lr_schedule_against_hand_computed_values():
    class T:
        lr, min_lr_ratio, warmup_steps, steps = 2e-3, 0.1, 60, 1200
    assert lr_at(0, T) == pytest.approx(2e-3 / 60, rel=1e-12)  # warmup's first step is not 0
    assert lr_at(29, T) == pytest.approx(1e-3, rel=1e-12)
    assert lr_at(59, T) == pytest.approx(2e-3, rel=1e-12)
    assert lr_at(60, T) == pytest.approx(2e-3, rel=1e-12)  # the cosine starts at the peak
    assert lr_at(630, T) == pytest.approx(2e-3 * (0.1 + 0.9 * 0.5), rel=1e-12)  # half way: the mean
    # The last step trained (1199): 0.5 * (1 + cos(pi * 1139/1140)) = 1.898e-6 of the way up from min.
    assert lr_at(1199, T) == pytest.approx(2e-4 + 1.8e-3 * 1.8988e-6, rel=1e-6)
    assert lr_at(1200, T) == pytest.approx(2e-4, rel=1e-12)  # the cosine's end is min_lr_ratio * lr


class _Uniform(torch.nn.Module):
    """Logits all equal: every token costs exactly ln(vocab) nats."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, x):
        return torch.zeros(*x.shape, self.vocab)


def test_bits_per_byte_against_a_hand_computed_value():
    tokens = np.array([0, 1, 2, 3, 1, 1, 2, 0, 3], dtype=np.uint16)
    byte_len = np.array([3, 1, 2, 0], dtype=np.int64)
    ev = evaluate(_Uniform(4), tokens, byte_len, seq_len=4, max_tokens=100, autocast=False)
    # Two windows of 4 targets: tokens[1:5] = 1 2 3 1 (1+2+0+1 = 4 bytes), tokens[5:9] = 1 2 0 3
    # (1+2+3+0 = 6 bytes). 8 targets at ln 4 nats each = 16 bits over 10 bytes.
    assert ev["tokens"] == 8 and ev["bytes"] == 10
    assert ev["loss"] == pytest.approx(math.log(4), rel=1e-6)
    assert ev["bpb"] == pytest.approx(1.6, rel=1e-6)
    ev = evaluate(_Uniform(4), tokens, byte_len, seq_len=4, max_tokens=5, autocast=False)
    assert ev["tokens"] == 4 and ev["bpb"] == pytest.approx(8 / 4, rel=1e-6)  # max_tokens: one window


def _raw(r):
    import dataclasses
    return {k: v for k, v in dataclasses.asdict(r).items() if k != "path"}


def test_sluice_error_is_what_every_failure_is():
    assert issubclass(TrainingError, sluice.SluiceError) and issubclass(budget.BudgetError, sluice.SluiceError)
    assert issubclass(RecipeError, sluice.SluiceError) and issubclass(CorpusError, sluice.SluiceError)
