"""`sluice inspect`: the report is produced, parses, has every section, stays offline; --json holds
the probes' numbers; bad input (empty, too long, bad --out, a NaN model) gets a clear message."""

import json
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import sluice
from sluice.cli import main
from sluice.observatory.analysis import inspect, jsonable
from sluice.observatory.plots import FIGURES
from sluice.observatory.report import SECTIONS, save

PROMPT = "def add(a, b):\n    return a + b"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def sluice_cli(*args, timeout=300):  # a hang-stopper: 10x+ the ~20 s an inspect run takes here under load
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True, text=True,
                          timeout=timeout)


class Page(HTMLParser):
    """Collects what the checks need: h2 texts, every src/href, tags used."""

    def __init__(self):
        super().__init__()
        self.h2, self.refs, self.tags, self._in_h2 = [], [], set(), False

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href", "srcset", "action", "data") and v]
        self._in_h2 = self._in_h2 or tag == "h2"
        if tag == "h2":
            self.h2.append("")

    def handle_endtag(self, tag):
        if tag == "h2":
            self._in_h2 = False

    def handle_data(self, data):
        if self._in_h2:
            self.h2[-1] += data


# shown only with a tuned lens or a --target (tests/observatory/test_trajectories.py), as are their figures
LENS_VIEWS = {"tuned": ("lens_kl", "trajectory"), "trajectory": ("trajectory",)}


def sections(training: bool):
    return [title for anchor, title in SECTIONS if (training or anchor != "training") and anchor not in LENS_VIEWS]


def check_report(out: Path, training: bool = False) -> str:
    html = (out / "report.html").read_text(encoding="utf-8")
    page = Page()
    page.feed(html)
    page.close()
    for title in sections(training):
        assert any(title in h for h in page.h2), f"section {title!r} missing from {page.h2}"
    assert len(page.h2) == len(sections(training))
    assert "http://" not in html and "https://" not in html
    assert not page.tags & {"script", "link", "iframe", "object", "embed"}
    for ref in page.refs:  # data: URIs and in-page anchors only: opens from disk with no network
        assert ref.startswith(("data:image/png;base64,", "#")), ref[:60]
    assert sum(r.startswith("data:") for r in page.refs) >= 7  # the figures are embedded
    for name in FIGURES:
        if (name == "training_valves" and not training) or name in LENS_VIEWS["tuned"]:
            assert not (out / f"{name}.png").exists()
            continue
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(PNG_SIGNATURE) and len(png) > 1000, name
    json.loads((out / "report.json").read_text())
    return html


def fake_run(run: Path, num_layers: int = 3) -> list[dict]:
    """A training log as `sluice train` writes it: valves at every evaluation (steps 10, 20, 30),
    plain lines in between, and step 20 logged twice: a run resumed from an older checkpoint logs
    it again later in the file, and that later record is the one that counts."""
    rows = []
    for step in range(1, 31):
        row = {"step": step, "loss": 9.0 - step / 10}
        if step % 10 == 0:
            valves = {"residual_rms": [0.02 * step + layer for layer in range(num_layers + 1)],
                      "final_norm_in": 0.1 * step, "final_norm_out": 1.0, "logit_max": step / 3,
                      "logsumexp": 8.0, "entropy": 9.0 - step / 10, "top1_prob": step / 100}
            row.update(heldout_loss=8.5 - step / 10, valves=valves)
        rows.append(row)
    stale = dict(rows[19], valves=dict(rows[19]["valves"], logit_max=-1.0))
    run.mkdir(parents=True)
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows[:19], stale, *rows[19:]]))
    return [r for r in rows if "valves" in r]


@pytest.fixture(scope="module")
def cli_run(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect")
    out = tmp / "new" / "dir"  # created, parents too
    evals = fake_run(tmp / "run")
    r = sluice_cli("inspect", "--model", str(tiny_dir), PROMPT, "--out", str(out), "--json",
                   "--training", str(tmp / "run"))
    assert r.returncode == 0, r.stderr
    return r, out, evals


@pytest.mark.slow
def test_cli_report_and_json(cli_run, tiny_dir):
    r, out, evals = cli_run
    html = check_report(out, training=True)
    data = json.loads(r.stdout)  # stdout is only the JSON document
    assert data == json.loads((out / "report.json").read_text())
    # the residual RMS per layer and position is exactly what observe() measures
    model = sluice.load(str(tiny_dir))
    ids = sluice.Tokenizer.from_pretrained(tiny_dir).encode(PROMPT)
    assert data["tokens"]["ids"] == ids
    with sluice.observe(model) as obs, torch.inference_mode():
        model(torch.tensor([ids]))
    assert torch.allclose(torch.tensor(data["residual"]["rms"]), obs.stats["resid_rms"][:, 0])
    assert data["growth"]["num_layers"] == model.config.num_layers
    assert len(data["lens"]["top_ids"]) == model.config.num_layers + 1
    assert {r["method"] for r in data["softmax_safety"]["without_final_norm"]} == {"naive", "safe", "online"}
    assert data["nonfinite"]["first"] is None and data["findings"] == [] and data["skipped"] == {}
    assert "report.html" in r.stderr
    assert "\u21b5" in html  # the newline token is drawn visibly
    # the training section: the series of the run's evaluations, the latest record of a step kept
    tr = data["training"]
    assert tr["steps"] == [10, 20, 30] and tr["logit_max"] == [e["valves"]["logit_max"] for e in evals]
    assert tr["residual_rms"] == [e["valves"]["residual_rms"] for e in evals]
    assert tr["heldout_loss"] == [e["heldout_loss"] for e in evals]


def test_python_api_and_tables(tiny_dir, tmp_path, capsys):
    model = sluice.load(str(tiny_dir))
    tok = sluice.Tokenizer.from_pretrained(tiny_dir)
    data = inspect(model, tok, "<b>&amp; x</b>", progress=True)  # progress goes to stderr
    html = check_report(Path(save(data, tmp_path)["html"]).parent)  # no training section without a run
    assert "<b>&amp;" not in html.split("<h2")[0].split("class=\"prompt\"")[1]  # the prompt is escaped
    assert main(["inspect", "--model", str(tiny_dir), PROMPT]) == 0
    shown = capsys.readouterr().out
    for title in ("the four valves", "logit lens", "softmax safety", "growth", "massive activations"):
        assert title in shown


def test_jsonable_writes_nonfinite_as_strings():
    assert jsonable({"a": [float("nan"), float("inf"), -float("inf"), 1.5]}) == {"a": ["nan", "inf", "-inf", 1.5]}


def test_training_tables_and_bad_run(tiny_dir, tmp_path, capsys):
    fake_run(tmp_path / "run")
    assert main(["inspect", "--model", str(tiny_dir), PROMPT, "--training", str(tmp_path / "run")]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # rich wraps a long title
    assert "the valves over training" in shown and "3 evaluations)" in shown
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    for run, why in (("old", "has no valve records"), ("missing", "no training log")):
        assert main(["inspect", "--model", str(tiny_dir), PROMPT, "--training", str(tmp_path / run)]) == 2
        err = capsys.readouterr().err
        assert why in err and str(tmp_path / run) in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["empty", "too_long", "out_is_file", "out_under_file"])
def test_bad_input(case, tiny_dir, tmp_path, capsys):
    prompt, out, n = PROMPT, tmp_path / "out", 0
    if case == "empty":
        prompt = ""
    elif case == "too_long":
        prompt = "hello world " * 400
        n = len(sluice.Tokenizer.from_pretrained(tiny_dir).encode(prompt))
        assert n > 512
    elif case == "out_is_file":
        out.write_text("not a dir")
    elif case == "out_under_file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "out"
    assert main(["inspect", "--model", str(tiny_dir), prompt, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    expected = {"empty": ["prompt is empty"], "too_long": [f"{n:,} tokens", "512"],
                "out_is_file": [str(out), "is an existing file"],
                "out_under_file": [str(out), "not a writable directory"]}[case]
    for text in expected:
        assert text in err, err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="running as root: a chmod 0500 directory is still writable, so there is no "
                           "unwritable directory to test (the path-under-a-file case covers the message)")
def test_out_not_writable(tiny_dir, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["inspect", "--model", str(tiny_dir), PROMPT, "--out", str(locked)]) == 2
    finally:
        locked.chmod(0o700)
    assert "not a writable directory" in capsys.readouterr().err


@pytest.mark.slow
def test_nan_model_is_a_finding_not_a_crash(tmp_path):
    """Poison one weight of layer 1's MLP with NaN: the report names layers.1.mlp.down as the origin,
    the analyses that cannot run on NaN are skipped with a reason, and the exit status is 3."""
    from safetensors.torch import load_file, save_file

    from ckpt import build_with_tokenizer
    model_dir = tmp_path / "nan-model"
    build_with_tokenizer(model_dir, "qwen3", max_position_embeddings=512)
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})

    out = tmp_path / "report"
    r = sluice_cli("inspect", "--model", str(model_dir), PROMPT, "--out", str(out), "--json")
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert "layers.1.mlp.down" in r.stderr and "layer 1" in r.stderr and "position 0" in r.stderr
    data = json.loads(r.stdout)
    first = data["nonfinite"]["first"]
    assert (first["module"], first["layer"], first["position"]) == ("layers.1.mlp.down", 1, 0)
    assert data["findings"][0]["kind"] == "nonfinite"
    assert "growth" in data["skipped"]  # a fit of NaN is refused, with the reason recorded
    html = check_report_sections_only(out)
    assert "layers.1.mlp.down" in html


def check_report_sections_only(out: Path) -> str:
    """The NaN report: every section is there (some say why they are empty), nothing off-line."""
    html = (out / "report.html").read_text(encoding="utf-8")
    page = Page()
    page.feed(html)
    for title in sections(training=False):
        assert any(title in h for h in page.h2), title
    assert all(ref.startswith(("data:", "#")) for ref in page.refs)
    return html
