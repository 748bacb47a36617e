"""The valves over training: what `sluice train` records at each evaluation, and reading it back.

At every evaluation the trainer runs one fixed held-out window through the model under `observe`
and writes `obs.summary()` as `"valves"` in that step's log.jsonl line. `training_valves(run_dir)`
turns those lines into aligned series for plotting how the norms, residual stream and softmax
settled as the model learned.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ObservatoryError
from .attach import observe

# Scalars of obs.summary() that are plotted over training, one value per evaluation.
SCALARS = ("final_norm_in", "final_norm_out", "logit_max", "logsumexp", "entropy", "top1_prob")


def valve_summary(model, ids: torch.Tensor, autocast: bool = False) -> dict:
    """obs.summary() of one eval-mode, no-grad forward of `ids` (B, T).

    Pass the eager model, never its torch.compile wrapper: the hooks then run in plain Python and
    are removed on leaving the `with`, and dynamo does not guard on module hooks by default
    (skip_nnmodule_hook_guards), so the compiled training step is not recompiled (measured: no new
    frames or graphs after observing between compiled steps)."""
    was_training = model.training
    model.eval()
    try:
        with observe(model, capacity=tuple(ids.shape)) as obs, torch.no_grad(), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(ids)
    finally:
        model.train(was_training)
    return obs.summary()


def training_valves(run_dir_or_log: str | Path) -> dict:
    """Series from a run's log.jsonl, one entry per evaluation that recorded valves.

    Keys: steps, residual_rms (per evaluation, a list of L+1 values: x_0 .. x_L), the SCALARS above,
    and heldout_loss. Every value is a list as long as `steps`. A step logged twice (a run resumed
    from a checkpoint older than its last log line) keeps its latest record."""
    path = Path(run_dir_or_log)
    if path.is_dir():
        path = path / "log.jsonl"
    if not path.is_file():
        raise ObservatoryError(f"no training log at {path}")
    rows = {}
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "valves" in row:
            rows[row["step"]] = row
    if not rows:
        raise ObservatoryError(f"{path} has no valve records: it was written by a `sluice train` that "
                               "did not record them, or before its first evaluation; rerun the "
                               "training (recipes/stdlib-valves.toml is a short one)")
    rows = [rows[s] for s in sorted(rows)]
    return {"steps": [r["step"] for r in rows],
            "residual_rms": [r["valves"]["residual_rms"] for r in rows],
            **{k: [r["valves"][k] for r in rows] for k in SCALARS},
            "heldout_loss": [r.get("heldout_loss") for r in rows]}
