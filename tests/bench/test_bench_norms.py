"""RMSNorm-vs-LayerNorm benchmark (bench/norms.py, `sluice bench norms`): it runs and reports
the documented JSON. No timing asserts: the numbers live in docs/benchmarks.md."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.benchmarks.norms import QUICK_HIDDEN, QUICK_TOKENS, VARIANTS
from sluice.cli import main

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "norms.py"
DTYPES = ("float32", "bfloat16")
# Quick shapes have 2 layers: Qwen3 runs 2 hidden norms + q_norm + k_norm per layer + the final
# norm, Llama 2 per layer + the final one.
NORM_CALLS = {"qwen3-0.6b": 2 * 4 + 1, "llama-3-8b": 2 * 2 + 1}


def check_result(r: dict) -> None:
    assert r["benchmark"] == "norms" and r["quick"]
    assert r["settings"]["compile"] is False and r["settings"]["dtypes"] == list(DTYPES)
    assert {"model", "avx2", "avx512_bf16", "amx_bf16"} <= set(r["cpu"])
    assert r["torch_threads"] >= 1 and r["versions"]["torch"] and "commit" in r["code"]

    cells = {(c["dtype"], c["mode"], c["hidden"], c["tokens"]): c for c in r["kernels"]}
    assert set(cells) == set(itertools.product(DTYPES, ["eager"], QUICK_HIDDEN, QUICK_TOKENS))
    for c in cells.values():
        assert set(c["us"]) == set(VARIANTS)
        assert all(c["us"][v] > 0 and c["GB_s"][v] > 0 and c["us_min"][v] > 0 for v in VARIANTS)
        assert all(len(c["samples_us"][v]) == r["settings"]["reps"] for v in VARIANTS)
        assert math.isclose(c["saving"], 1 - c["us"]["rms"] / c["us"]["layer"])
        assert c["compile_s"] is None

    rows = {(d["model"], d["dtype"], d["mode"]): d for d in r["decode"]}
    assert set(rows) == set(itertools.product(NORM_CALLS, DTYPES, ["eager"]))
    for (model, _, _), d in rows.items():
        for part in ("step_ms", "head_ms"):  # measured times
            assert set(d[part]) == {"rms", "layer", "none"} and all(v > 0 for v in d[part].values()), part
        # derived from differences of noisy medians (step - head): may come out negative on a busy
        # machine in a --quick run, so only their presence and finiteness are checked
        for part in ("per_layer_ms", "full_depth_ms"):
            assert set(d[part]) == {"rms", "layer", "none"} and all(map(math.isfinite, d[part].values())), part
        assert d["norm_calls"] == NORM_CALLS[model] == sum(k["count"] for k in d["norm_call_kinds"])
        kinds = d["norm_call_kinds"]
        assert all(k["rms_us"] > 0 and k["layer_us"] > 0 and k["identity_us"] > 0 for k in kinds)  # measured
        assert sum(k["count"] for k in kinds if k["where"] == "final") == 1
        # the direct costs are differences of those (a norm's call minus an identity's), which a busy machine can
        # make negative in a --quick run: what they are made of is checked, not their sign
        cost = lambda v, where=None: sum(k["count"] * (k[v] - k["identity_us"]) for k in kinds  # noqa: E731
                                         if where in (None, k["where"])) / 1e3
        assert math.isclose(d["direct_norm_ms"], cost("rms_us"))
        assert math.isclose(d["direct_layer_ms"], cost("layer_us"))
        assert math.isclose(d["direct_per_layer_ms"] * d["layers"], cost("rms_us", "layers"))
        assert d["direct_full_depth_ms"] == d["direct_norm_ms"]  # the run is at full depth (2 of 2 layers)
        assert len(d["norm_share_rounds"]) == r["settings"]["reps"] and math.isfinite(d["norm_share"])
        assert all(d["logits_finite"].values())  # swapping the norms did not blow the forward up
        assert d["layers"] == d["full_depth"] == 2 and d["kv_len"] == 512 and d["cache_slots"] >= 513


@pytest.mark.slow
def test_script_quick(tmp_path):
    out = tmp_path / "norms.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-compile", "--json", str(out)],
                          capture_output=True, text=True, timeout=1200, check=False)  # hang-stopper: 10x+ ~17-40 s
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "| row |" in proc.stdout and "| config |" in proc.stdout  # kernel and decode tables
    check_result(json.loads(out.read_text()))


@pytest.mark.slow
def test_cli_quick(tmp_path, capsys):
    out = tmp_path / "sub" / "norms.json"
    assert main(["bench", "norms", "--quick", "--no-compile", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| row |" in printed and "| fp32 eager | 1024 | 1 |" in printed
    assert "| qwen3-0.6b bf16 eager |" in printed
    check_result(json.loads(out.read_text()))


@pytest.mark.parametrize("flag,value,named", [
    ("--dtypes", "float32,fp16", "'fp16'"),
    ("--hidden", "1024,0", "--hidden"),
    ("--tokens", "1,x", "--tokens"),
    ("--models", "gpt-5", "'gpt-5'"),
    ("--layers", "33", "--layers"),
    ("--kv-len", "0", "--kv-len"),
    ("--reps", "-1", "--reps"),
])
def test_cli_bad_input(flag, value, named, capsys):
    assert main(["bench", "norms", "--quick", "--no-compile", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sluice bench: error:") and named in err and len(err.splitlines()) == 1


def test_script_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)  # hang-stopper: 10x+ ~8 s
    assert proc.returncode == 2 and "is a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_disturbed_cells_are_repeated_then_marked(tmp_path, capsys, monkeypatch):
    """A made-up disturbance (a LoadWatch that always says so): each kernel cell is measured twice,
    and the JSON, the warning and the table rows say it stayed disturbed; decode rows are marked."""
    from sluice.observatory import disturbance

    class Busy:
        rounds = 0

        def __init__(self, start_sample_s=None):
            Busy.rounds += 1

        def result(self):
            return {"disturbed": True, "disturbed_reasons": ["other processes used 1.20 cores during the run"]}

    monkeypatch.setattr(disturbance, "LoadWatch", Busy)
    out = tmp_path / "norms.json"
    assert main(["bench", "norms", "--quick", "--no-compile", "--dtypes", "float32", "--hidden", "1024",
                 "--tokens", "1", "--models", "qwen3-0.6b", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    (cell,) = r["kernels"]
    assert cell["disturbed"] and cell["load"]["attempts"] == 2
    assert r["decode"] and all(d["disturbed"] and d["load"]["attempts"] == 1 for d in r["decode"])
    assert Busy.rounds == 2 + 1  # the cell twice, the decode configuration once
    assert r["disturbed"] and r["disturbed_parts"][0] == "kernels fp32 eager hidden 1024 tokens 1"
    printed = capsys.readouterr().out
    assert "DISTURBED RUN" in printed and "| DISTURBED |" in printed
