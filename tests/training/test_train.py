"""`sluice train` on a tiny corpus: output loads in sluice and transformers; --resume is exact."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sluice
from sluice.training.corpus import CorpusError
from sluice.training.recipe import Recipe, RecipeError
from sluice.training.train import run

CORPUS_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\nfor name in os.listdir('.'):\n    print(name)\n",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
]


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    for i in range(12):
        (d / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (d / f"pkg{i % 3}" / f"m{i}.py").write_text(CORPUS_TEXT[i % 4] * (3 + i))
    return d


def recipe(corpus, steps=6, **train):
    return Recipe.from_dict({
        "corpus": {"source": str(corpus), "heldout_percent": 25},
        "tokenizer": {"vocab_size": 300},
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "head_dim": 8, "intermediate_size": 64, "max_position_embeddings": 64},
        "train": {"seq_len": 32, "micro_batch": 4, "grad_accum": 2, "steps": steps,
                  "warmup_steps": 2, "eval_every": 3, "checkpoint_every": 2, "compile": False,
                  "autocast_bf16": False, **train},
    })


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_train_writes_a_checkpoint_that_sluice_and_transformers_load(tmp_path, corpus):
    summary = run(recipe(corpus), tmp_path / "run", log=lambda m: None, progress=False)
    out = tmp_path / "run" / "model"
    assert summary["step"] == 6 and (out / "tokenizer.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model = sluice.load(out)
    tok = sluice.Tokenizer.from_pretrained(out)
    ids = torch.tensor([tok.encode("def add(a, b):\n    return")])
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max().item() <= 1e-4
    assert AutoTokenizer.from_pretrained(out).encode("import os") == tok.encode("import os")
    first = losses(tmp_path / "run")
    assert first[-1] < first[0]  # it learns something even in 6 steps


@pytest.mark.slow
def test_resume_follows_the_same_loss_curve(tmp_path, corpus):
    r = recipe(corpus, steps=8)
    run(r, tmp_path / "straight", log=lambda m: None, progress=False)
    run(r, tmp_path / "split", stop_at=4, log=lambda m: None, progress=False)
    assert not (tmp_path / "split" / "model").exists()  # interrupted: nothing exported yet
    from safetensors import safe_open
    with safe_open(str(tmp_path / "split" / "state" / "resume.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["sluice.resume"])["step"] == 4
    summary = run(r, tmp_path / "split", resume=True, log=lambda m: None, progress=False)
    assert summary["step"] == 8
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    a = sluice.load(tmp_path / "straight" / "model")
    b = sluice.load(tmp_path / "split" / "model")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_cli_train_and_errors(tmp_path, corpus):
    toml = tmp_path / "r.toml"
    toml.write_text(f'[corpus]\nsource = "{corpus}"\n[train]\nsteps = 1\nbogus = 3\n')
    r = subprocess.run([sys.executable, "-m", "sluice", "train", "--recipe", str(toml), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown key(s) ['bogus']" in r.stderr and "Traceback" not in r.stderr


def test_sluice_train_hands_the_valve_probe_in(tmp_path, monkeypatch, capsys):
    """Training never imports the observatory: `sluice train` hands it the valve probe to record."""
    from sluice.cli import main
    from sluice.observatory.training import valve_summary

    seen = {}

    def fake_run(recipe, out, **kwargs):
        seen.update(kwargs)
        return {"step": 0}
    monkeypatch.setattr("sluice.training.train.run", fake_run)
    assert main(["train", "--out", str(tmp_path / "o")]) == 0
    assert seen["valves"] is valve_summary


def test_unknown_section_and_bad_type():
    with pytest.raises(RecipeError, match=r"unknown section\(s\) \['optimiser'\]"):
        Recipe.from_dict({"optimiser": {}})
    with pytest.raises(RecipeError, match=r"recipe: train\.steps must be an integer in \[1, \d+\], got 'ten'"):
        Recipe.from_dict({"train": {"steps": "ten"}})


def test_missing_corpus_directory(tmp_path):
    with pytest.raises(CorpusError, match="does-not-exist.*does not exist"):
        run(recipe(tmp_path / "does-not-exist"), tmp_path / "run", log=lambda m: None)


def test_corpus_source_that_is_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("some text\n")
    with pytest.raises(CorpusError, match=r"notes\.txt is a file, not a directory"):
        run(recipe(tmp_path / "notes.txt"), tmp_path / "run", log=lambda m: None)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.py").write_text("")
    with pytest.raises(CorpusError, match="no non-empty files"):
        run(recipe(tmp_path / "empty"), tmp_path / "run", log=lambda m: None)


def test_refuses_to_overwrite_a_run(tmp_path, corpus):
    run(recipe(corpus, steps=2), tmp_path / "run", log=lambda m: None, progress=False)
    with pytest.raises(sluice.SluiceError, match="--resume"):
        run(recipe(corpus, steps=2), tmp_path / "run", log=lambda m: None, progress=False)
    shutil.rmtree(tmp_path / "run" / "state")
    with pytest.raises(sluice.SluiceError, match="no checkpoint"):
        run(recipe(corpus, steps=2), tmp_path / "run", resume=True, log=lambda m: None)


def test_training_card(tmp_path, corpus):
    run(recipe(corpus), tmp_path / "run", log=lambda m: None, progress=False)
    card = json.loads((tmp_path / "run" / "model" / "training.json").read_text())
    assert card["steps"] == 6 and card["tokens_seen"] == 6 * 32 * 4 * 2
    assert card["heldout"]["bpb"] > 0 and card["heldout"]["tokens"] > 0
    assert set(card["baselines"]) >= {"gzip-9", "xz-9e"}
    assert card["train_wall_seconds"] > 0


@pytest.mark.slow
def test_valves_recorded_at_every_evaluation(tmp_path, corpus):
    import math

    import numpy as np
    from safetensors.torch import load_file

    from sluice.model.layers import Transformer
    from sluice.observatory.training import valve_summary
    from sluice.training.train import model_config

    r = recipe(corpus, steps=7)  # evaluations at 3, 6 and the last step, 7
    run(r, tmp_path / "run", log=lambda m: None, progress=False, valves=valve_summary)
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if "valves" in x] == [3, 6, 7]
    assert all(("valves" in x) == ("heldout_loss" in x) for x in rows)
    for x in rows[2::3]:
        v = x["valves"]
        assert len(v["residual_rms"]) == len(v["residual_absmax"]) == r.model.num_layers + 1
        numbers = [*v["residual_rms"], *v["attn_norm_in"], *v["mlp_norm_out"],
                   *(v[k] for k in ("final_norm_in", "logit_max", "logsumexp", "entropy", "top1_prob"))]
        assert all(math.isfinite(n) for n in numbers)
    # The last record is the valves of the final weights (saved in fp32 in state/) on the first
    # seq_len held-out tokens, not of some other forward.
    meta = json.loads((tmp_path / "run" / "data" / "data.json").read_text())
    model = Transformer(model_config(r, meta["vocab_size"], meta["sep_id"]))
    tensors = load_file(str(tmp_path / "run" / "state" / "resume.safetensors"))
    model.load_state_dict({k[6:]: w for k, w in tensors.items() if k.startswith("model.")}, strict=False)
    model.tie_weights()
    held = np.load(tmp_path / "run" / "data" / "heldout.npy")[:r.train.seq_len]
    again = valve_summary(model, torch.from_numpy(held.astype(np.int64))[None])
    assert [k for k, v in rows[-1]["valves"].items() if again[k] != pytest.approx(v, rel=1e-5)] == []
    assert model.training and not any(m._forward_hooks for m in model.modules())  # left as found


def test_training_valves_series(tmp_path, corpus):
    from sluice.observatory.training import training_valves, valve_summary

    run(recipe(corpus, steps=6), tmp_path / "run", log=lambda m: None, progress=False, valves=valve_summary)
    s = training_valves(tmp_path / "run")
    assert list(s) == ["steps", "residual_rms", "final_norm_in", "final_norm_out", "logit_max",
                       "logsumexp", "entropy", "top1_prob", "heldout_loss"]
    assert s["steps"] == [3, 6] and all(len(v) == 2 for v in s.values())
    assert all(len(layers) == 3 for layers in s["residual_rms"])
    assert s == training_valves(tmp_path / "run" / "log.jsonl")


def test_training_valves_refuses_a_log_without_them(tmp_path):
    from sluice.observatory.training import training_valves

    log = tmp_path / "old" / "log.jsonl"
    log.parent.mkdir()
    log.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.5, "heldout_loss": 8.7}\n')
    with pytest.raises(sluice.SluiceError, match=r"old/log\.jsonl has no valve records"):
        training_valves(tmp_path / "old")
    with pytest.raises(sluice.SluiceError, match="no training log at .*nowhere"):
        training_valves(tmp_path / "nowhere")


def test_recording_valves_leaves_training_unchanged(tmp_path, corpus):
    from sluice.observatory.training import valve_summary

    run(recipe(corpus), tmp_path / "with", log=lambda m: None, progress=False, valves=valve_summary)
    run(recipe(corpus), tmp_path / "without", log=lambda m: None, progress=False)
    assert losses(tmp_path / "with") == losses(tmp_path / "without")


def test_autocast_auto_follows_the_cpu_flags(tmp_path, corpus):
    """train.autocast_bf16 = "auto": bf16 where the CPU has AVX-512 bf16 or AMX, fp32 elsewhere; the
    run records what it chose, and a recipe's true/false is taken as written."""
    from sluice.engine.native import cpu_flags
    from sluice.training.train import bf16_autocast
    assert bf16_autocast("auto", {"avx2", "fma"}) is False
    assert bf16_autocast("auto", {"avx2", "avx512_bf16"}) is True
    assert bf16_autocast("auto", {"amx_bf16"}) is True
    assert bf16_autocast(True, set()) is True and bf16_autocast(False, {"amx_bf16"}) is False
    said = []
    summary = run(recipe(corpus, steps=2, autocast_bf16="auto", eval_every=2), tmp_path / "run", log=said.append,
                  progress=False)
    expected = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert summary["autocast_bf16"] is expected
    assert any(m.startswith(f"bf16 autocast: {'on' if expected else 'off'} (auto") for m in said)
