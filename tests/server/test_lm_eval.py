"""The issue's acceptance run: an lm-evaluation-harness multiple-choice task (tests/server/lm_eval_task, local
and offline) through lm-eval's `local-completions` model against a `sluice serve` process gives the same
per-item loglikelihoods (within 1e-4) and the same accuracy as lm-eval's own `hf` backend on the same
checkpoint (the bundled model, fp32). bench/lm_eval_parity.py does the run; this checks what it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # a server process and two lm-eval runs: ~2 min on a busy 2-core machine

SCRIPT = Path(__file__).resolve().parents[2] / "bench/lm_eval_parity.py"


def test_local_completions_matches_the_hf_backend(tmp_path):
    out = tmp_path / "lm-eval.json"
    # offline, with lm-eval's and datasets' caches in tmp_path; the timeout stops a hang (10x+ the run)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=1800, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(out.read_text())
    assert r["items"] == 12 and len(r["rows"]) == 48  # every choice of every item was scored by both
    assert max(abs(row["sluice"] - row["hf"]) for row in r["rows"]) <= 1e-4
    assert r["sluice_acc"] == r["hf_acc"] and r["same_picks"]
    assert r["hf_acc"] > 0.5  # the bundled model knows Python: the task measures something (chance is 0.25)
    assert "| item | choice |" in proc.stdout
