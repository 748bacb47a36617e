"""The run directory against accidents: a bad --out, a corrupt or foreign resume state, a crash
while saving, damaged data/, and corpus files that point outside the corpus."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_train import corpus, losses, recipe  # noqa: F401  (corpus is a fixture)

from sluice.errors import CheckpointError
from sluice.training import state as state_mod
from sluice.training.corpus import CorpusError
from sluice.training.recipe import Recipe
from sluice.training.train import TrainingError, run


def quiet(r, out, **kw):
    return run(r, out, log=lambda m: None, progress=False, **kw)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped at step 2 of 4 (its own corpus: fixtures of another scope cannot be shared)."""
    root = tmp_path_factory.mktemp("stopped")
    d = root / "corpus"
    d.mkdir()
    for i in range(12):
        (d / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * (20 + i))
    r = recipe(d, steps=4)
    quiet(r, root / "run", stop_at=2)
    return r, root / "run"


@pytest.fixture
def resumable(stopped, tmp_path):
    r, src = stopped
    shutil.copytree(src, tmp_path / "run")
    return r, tmp_path / "run"


STATE = ("state", "resume.safetensors")


def _meta_and_tensors(run_dir):
    path = run_dir.joinpath(*STATE)
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


# ------------------------------------------------------------------ --out
def test_out_that_is_a_file_is_refused_before_anything_runs(tmp_path, corpus):  # noqa: F811
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(TrainingError, match=r"--out .*taken is a file, not a directory"):
        quiet(recipe(corpus), tmp_path / "taken")
    with pytest.raises(TrainingError, match=r"--out .*taken/run is not a writable directory"):
        quiet(recipe(corpus), tmp_path / "taken" / "run")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "data").write_text("x")
    with pytest.raises(TrainingError, match=r"odd/data is a file where the run keeps a directory"):
        quiet(recipe(corpus), tmp_path / "odd")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_out_without_write_permission(tmp_path, corpus):  # noqa: F811
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(TrainingError, match="not a writable directory"):
        quiet(recipe(corpus), tmp_path / "ro")


def test_stop_at_must_be_a_step(tmp_path, corpus):  # noqa: F811
    for bad in (0, -3, True):
        with pytest.raises(TrainingError, match="--stop-at must be a step >= 1"):
            quiet(recipe(corpus), tmp_path / "run", stop_at=bad)


# ------------------------------------------------------------------ --resume
def test_resume_of_a_good_state_still_works(resumable):
    r, d = resumable
    assert quiet(r, d, resume=True)["step"] == 4 and len(losses(d)) == 4


def test_truncated_state(resumable):
    r, d = resumable
    path = d.joinpath(*STATE)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="resume.safetensors is not a readable sluice resume state"):
        quiet(r, d, resume=True)


def test_a_pickle_is_never_unpickled(resumable, tmp_path):
    r, d = resumable
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"x": Evil()}, d.joinpath(*STATE))
    with pytest.raises(CheckpointError, match="not a readable sluice resume state"):
        quiet(r, d, resume=True)
    assert not marker.exists()


def test_state_from_another_recipe(resumable):
    r, d = resumable
    other = Recipe.from_dict({"corpus": {"source": r.corpus.source, "heldout_percent": 25},
                              "tokenizer": {"vocab_size": 300},
                              "model": {"hidden_size": 48, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                        "head_dim": 8, "intermediate_size": 64, "max_position_embeddings": 64},
                              "train": {"seq_len": 32, "micro_batch": 4, "grad_accum": 2, "steps": 4,
                                        "warmup_steps": 2, "eval_every": 3, "checkpoint_every": 2,
                                        "compile": False, "autocast_bf16": False}})
    with pytest.raises(CheckpointError, match=r"made by another recipe \(model\.hidden_size: state 32, recipe 48\)"):
        quiet(other, d, resume=True)


def test_state_with_wrong_shape_missing_or_nonfinite_tensors(resumable):
    r, d = resumable
    meta, tensors = _meta_and_tensors(d)
    path = d.joinpath(*STATE)
    name = "model.embed.weight"
    cases = [({**tensors, name: tensors[name][:10]}, rf"tensor {name} is torch.float32 \(10, 32\)"),
             ({k: v for k, v in tensors.items() if k != name}, rf"missing \['{name}'\]"),
             ({**tensors, "model.extra": torch.zeros(1)}, r"unexpected \['model.extra'\]"),
             ({**tensors, name: tensors[name].double()}, "torch.float64"),
             ({**tensors, name: torch.full_like(tensors[name], float("nan"))}, "NaN or infinite")]
    for bad, message in cases:
        save_file(bad, str(path), metadata=meta)
        with pytest.raises(CheckpointError, match=message):
            quiet(r, d, resume=True)


@pytest.mark.parametrize("change,message", [
    (lambda m: m.pop("sluice.resume"), "no 'sluice.resume' metadata"),
    (lambda m: m.update({"sluice.resume": "{"}), "is not JSON"),
    (lambda m: m.update({"sluice.resume": "[1]"}), "is not an object"),
    (lambda m: _edit(m, step=99), r"step must be an integer in \[0, train.steps = 4\], got 99"),
    (lambda m: _edit(m, step=True), "step must be an integer"),
    (lambda m: _edit(m, adam_step=float("nan")), "adam_step must be a finite number"),
    (lambda m: _edit(m, history=[1.0]), "history must be a list of 2 losses"),
    (lambda m: _edit(m, recipe=None), "no recipe recorded"),
])
def test_state_with_bad_metadata(resumable, change, message):
    r, d = resumable
    meta, tensors = _meta_and_tensors(d)
    change(meta)
    save_file(tensors, str(d.joinpath(*STATE)), metadata=meta)
    with pytest.raises(CheckpointError, match=message):
        quiet(r, d, resume=True)


def _edit(meta, **kw):
    m = json.loads(meta["sluice.resume"])
    m.update(kw)
    meta["sluice.resume"] = json.dumps(m)


def test_a_crash_while_saving_keeps_the_previous_state(resumable, monkeypatch):
    r, d = resumable
    before = d.joinpath(*STATE).read_bytes()

    def dies_half_way(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # a partial file, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state_mod, "save_file", dies_half_way)
    with pytest.raises(CheckpointError, match="cannot write the resume state .*No space left"):
        quiet(r, d, resume=True)
    assert d.joinpath(*STATE).read_bytes() == before
    assert sorted(p.name for p in (d / "state").iterdir()) == ["resume.safetensors"]  # no temp left
    monkeypatch.undo()
    # A process killed mid-write leaves a temp file at most, which --resume never reads.
    (d / "state" / ".resume.safetensors.12345.tmp").write_bytes(b"\x00" * 10)
    with (d / "log.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 1.')  # a line cut off by the crash
    assert quiet(r, d, resume=True)["step"] == 4
    # Steps 3-4 ran twice (before the crash and after); the log has each once, in order.
    assert [json.loads(x)["step"] for x in (d / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_state_is_written_through_a_rename(resumable, monkeypatch):
    """The state reaches its name only by os.replace of a complete, fsync'd file."""
    r, d = resumable
    calls = []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(state_mod.os, "fsync", lambda fd: calls.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(state_mod.os, "replace",
                        lambda a, b: calls.append(("replace", os.path.basename(b))) or real_replace(a, b))
    quiet(r, d, resume=True)
    calls = [c for c in calls if c == "fsync" or c[1] == "resume.safetensors"]  # not log.jsonl's
    assert calls[:3] == ["fsync", ("replace", "resume.safetensors"), "fsync"]


# ------------------------------------------------------------------ damaged data/
def test_damaged_data_is_refused_on_resume(resumable):
    r, d = resumable
    data = d / "data"
    ids = np.load(data / "train.npy")
    bad = ids.copy()
    bad[5] = 299 + 1000
    np.save(data / "train.npy", bad)
    with pytest.raises(CorpusError, match=r"train.npy: token ids must be in \[0, \d+\), found"):
        quiet(r, d, resume=True)
    np.save(data / "train.npy", ids[:-3])
    with pytest.raises(CorpusError, match="train.npy: expected .* integer token ids"):
        quiet(r, d, resume=True)
    np.save(data / "train.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CorpusError, match="train.npy is not a readable token array"):
        quiet(r, d, resume=True)
    (data / "data.json").write_text("{not json")
    with pytest.raises(CorpusError, match="data.json is unreadable"):
        quiet(r, d, resume=True)


# ------------------------------------------------------------------ corpus files outside the corpus
def test_corpus_symlink_leaving_the_corpus_is_refused(tmp_path, corpus):  # noqa: F811
    secret = tmp_path / "secret.py"
    secret.write_text("password = 'hunter2'\n")
    (corpus / "pkg0" / "leak.py").symlink_to(secret)
    with pytest.raises(CorpusError, match=r"leak.py resolves to .*secret.py, outside the corpus directory"):
        quiet(recipe(corpus), tmp_path / "run")
    (corpus / "pkg0" / "leak.py").unlink()
    (corpus / "pkg1" / "outside").symlink_to(tmp_path, target_is_directory=True)
    r = Recipe.from_dict({"corpus": {"source": str(corpus), "glob": "*/outside/*.py"}})
    with pytest.raises(CorpusError, match="outside the corpus directory"):
        quiet(r, tmp_path / "run2")
    # A link inside the corpus is corpus; one in an excluded directory is never looked at.
    (corpus / "pkg1" / "outside").unlink()
    (corpus / "pkg2" / "same.py").symlink_to(corpus / "pkg0" / "m0.py")
    (corpus / "tests").mkdir()
    (corpus / "tests" / "leak.py").symlink_to(secret)
    from sluice.training.corpus import load_corpus
    c = load_corpus(recipe(corpus).corpus)
    assert corpus / "pkg2" / "same.py" in c.train + c.heldout
    assert all("tests" not in p.parts for p in c.train + c.heldout)
