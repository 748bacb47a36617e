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


def test_resume_follows_the_same_loss_curve(tmp_path, corpus):
    r = recipe(corpus, steps=8)
    run(r, tmp_path / "straight", log=lambda m: None, progress=False)
    run(r, tmp_path / "split", stop_at=4, log=lambda m: None, progress=False)
    assert not (tmp_path / "split" / "model").exists()  # interrupted: nothing exported yet
    state = json.loads((tmp_path / "split" / "state" / "resume.json").read_text())
    assert state["step"] == 4
    summary = run(r, tmp_path / "split", resume=True, log=lambda m: None, progress=False)
    assert summary["step"] == 8
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    a = sluice.load(tmp_path / "straight" / "model")
    b = sluice.load(tmp_path / "split" / "model")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_cli_train_and_errors(tmp_path, corpus):
    toml = tmp_path / "r.toml"
    toml.write_text(f'[corpus]\nsource = "{corpus}"\n[train]\nsteps = 1\nbogus = 3\n')
    r = subprocess.run([sys.executable, "-m", "sluice", "train", "--recipe", str(toml), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown key(s) ['bogus']" in r.stderr and "Traceback" not in r.stderr


def test_unknown_section_and_bad_type():
    with pytest.raises(RecipeError, match=r"unknown section\(s\) \['optimiser'\]"):
        Recipe.from_dict({"optimiser": {}})
    with pytest.raises(RecipeError, match="steps must be a int, got 'ten'"):
        Recipe.from_dict({"train": {"steps": "ten"}})


def test_missing_corpus_directory(tmp_path):
    with pytest.raises(CorpusError, match="does-not-exist.*does not exist"):
        run(recipe(tmp_path / "does-not-exist"), tmp_path / "run", log=lambda m: None)


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
