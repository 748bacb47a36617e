"""A run that goes numerically wrong stops instead of exporting a broken model: a diverging loss, weights
gone bad before a save, the CLI's exit 2, and a held-out split too small to measure."""

import json
import math
import subprocess
import sys

import pytest
import torch
from test_train import corpus, recipe  # noqa: F401  (corpus is a fixture)

from sluice.training.corpus import CorpusError
from sluice.training.recipe import Recipe
from sluice.training.train import TrainingError, run


def quiet(r, out, **kw):
    return run(r, out, log=lambda m: None, progress=False, **kw)


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


@pytest.mark.slow
def test_cli_reports_divergence_with_exit_2(tmp_path, corpus):  # noqa: F811
    toml = tmp_path / "r.toml"
    toml.write_text(f'[corpus]\nsource = "{corpus}"\nheldout_percent = 25\n[tokenizer]\nvocab_size = 300\n'
                    "[model]\nhidden_size = 32\nnum_layers = 1\nhead_dim = 8\nintermediate_size = 64\n"
                    "max_position_embeddings = 64\n[train]\nseq_len = 32\nmicro_batch = 2\nsteps = 5\n"
                    "warmup_steps = 0\nlr = 1e30\ncompile = false\nautocast_bf16 = false\neval_tokens = 64\n")
    p = subprocess.run([sys.executable, "-m", "sluice", "train", "--recipe", str(toml), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=300)  # hang-stopper, ~9 s
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "training diverged" in p.stderr and not (tmp_path / "o" / "model").exists()


def test_a_heldout_split_too_small_to_measure_is_refused(tmp_path, corpus):  # noqa: F811
    r = recipe(corpus)
    r = Recipe.from_dict({**_raw(r), "corpus": {"source": str(corpus), "heldout_percent": 0.001}})
    with pytest.raises(CorpusError, match=r"held-out split has 0 tokens, fewer than one evaluation window"):
        quiet(r, tmp_path / "run")


def _raw(r):
    import dataclasses
    return {k: v for k, v in dataclasses.asdict(r).items() if k != "path"}
