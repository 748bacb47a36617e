"""`sluice roofline`: the predicted cost of one decode step from config.json and published peaks.

time >= max(bytes read / peak bandwidth, FLOPs / peak FLOP/s): the roofline bound. Batch-1 decode
does ~1 multiply-add per weight read (2 FLOPs per 2 bf16 bytes), far left of any GPU's ridge
point (~300 FLOPs/byte on an H100), so its bound is the bandwidth one until the batch is large.

Peaks are the vendors' datasheet numbers (docs/profile.md cites them), dense (without 2:4
sparsity, which the datasheets' headline tensor-core figures assume). fp32 uses the non-tensor
FP32 rate: PyTorch does not use TF32 for fp32 matmuls unless asked to. `cpu-this-machine` is not
a table row: it is measured when asked for (observatory/machine.py).

With `tp` > 1 (or an interconnect named), the costs are one rank's of a tensor-parallel model and a
"parallel" section adds the step's all-reduces and the latency split (observatory/roofline_tp.py).
"""

from __future__ import annotations

import torch

from ..errors import ObservatoryError
from ..model.config import ModelConfig
from .costs import COMPONENTS, totals

# name -> peak memory bandwidth (GB/s) and dense FLOP/s per dtype (TFLOP/s)
HARDWARE = {
    "h200": {"label": "NVIDIA H200 SXM (141 GB HBM3e)", "GB_s": 4800.0,
             "TFLOP_s": {"bfloat16": 989.4, "float32": 66.9},
             "source": "NVIDIA H200 datasheet: 4.8 TB/s; BF16 tensor core 1,979 TFLOPS with sparsity "
                       "(989 dense); FP32 67 TFLOPS"},
    "h100": {"label": "NVIDIA H100 SXM (80 GB HBM3)", "GB_s": 3350.0,
             "TFLOP_s": {"bfloat16": 989.4, "float32": 66.9},
             "source": "NVIDIA H100 datasheet: 3.35 TB/s; BF16 tensor core 1,979 TFLOPS with sparsity "
                       "(989 dense); FP32 67 TFLOPS"},
    "a100": {"label": "NVIDIA A100 80GB SXM (HBM2e)", "GB_s": 2039.0,
             "TFLOP_s": {"bfloat16": 312.0, "float32": 19.5},
             "source": "NVIDIA A100 datasheet: 2,039 GB/s; BF16 tensor core 312 TFLOPS (624 with "
                       "sparsity); FP32 19.5 TFLOPS"},
}
CPU = "cpu-this-machine"
HARDWARE_NAMES = (*HARDWARE, CPU)


NEGLIGIBLE = 1e-3  # a component under this share of the step's bound time gets no roof label


def predict(costs: dict[str, dict], bandwidth: float, flops: float, batch: int) -> dict:
    """Bounds from per-component costs, `bandwidth` in bytes/s and `flops` in FLOP/s.

    tokens_per_s = batch / max(total bytes / bandwidth, total FLOPs / flops); per component, the
    time max(bytes / bandwidth, FLOPs / flops) and which roof it sits under ("negligible" when that
    time is under NEGLIGIBLE of the step's: a few thousand FLOPs and no bytes sit under no roof)."""
    tot = totals(costs)
    t_mem, t_compute = tot["read_bytes"] / bandwidth, tot["flops"] / flops
    t = max(t_mem, t_compute)
    comps = {}
    for k in COMPONENTS:
        tm, tc = costs[k]["read_bytes"] / bandwidth, costs[k]["flops"] / flops
        bound = "negligible" if max(tm, tc) < NEGLIGIBLE * t else "compute" if tc > tm else "memory"
        comps[k] = {"ms": max(tm, tc) * 1e3, "bound": bound}
    for k in COMPONENTS:
        comps[k]["share"] = comps[k]["ms"] / 1e3 / t if t else 0.0
    comp_ms = sum(c["ms"] for c in comps.values())
    return {"step_ms": t * 1e3, "tokens_per_s": batch / t,
            "bandwidth_bound_tokens_per_s": batch / t_mem, "compute_bound_tokens_per_s": batch / t_compute,
            "bound": "compute" if t_compute > t_mem else "memory",
            "arithmetic_intensity": tot["flops"] / tot["read_bytes"],
            # each component under its own roof: a little slower than the whole step's single roof
            "component_step_ms": comp_ms, "component_tokens_per_s": batch / (comp_ms / 1e3),
            "components": comps}


def hardware_peaks(name: str, dtype: torch.dtype, measured: dict | None = None) -> dict:
    """{"name", "label", "GB_s", "GFLOP_s", "source"} for a table row or this machine (measured)."""
    key = str(dtype).removeprefix("torch.")
    if name == CPU:
        from . import machine
        m = measured or machine.measure(dtype)
        return {"name": name, "label": "this machine's CPU (measured)", "GB_s": m["stream_copy"]["GB_s"],
                "GFLOP_s": m["matmul"]["GFLOP_s"], "measured": m,
                "source": "measured now: best of 7 copies of a 512 MiB tensor (read + write bytes), and the "
                          f"fastest of {len(m['matmul']['shapes'])} {key} matmul shapes"}
    if name not in HARDWARE:
        raise ObservatoryError(f"unknown --hardware {name!r}; choose one of {', '.join(HARDWARE_NAMES)}")
    row = HARDWARE[name]
    return {"name": name, "label": row["label"], "GB_s": row["GB_s"], "GFLOP_s": row["TFLOP_s"][key] * 1e3,
            "source": row["source"]}


def roofline(cfg: ModelConfig, hardware: str, batch: int = 1, context: int = 4096,
             dtype: torch.dtype = torch.bfloat16, measured: dict | None = None, tp: int = 1,
             interconnect: str | None = None, link_bandwidth: float | None = None,
             link_latency: float | None = None, collective_overhead: float | None = None) -> dict:
    """Predicted bytes, FLOPs and time per decode step by component, and the tokens/s bound.

    tp > 1: per rank of a tensor-parallel model, plus result["parallel"] (roofline_tp.py): the
    collectives over `interconnect` (default nvlink; link_bandwidth GB/s, link_latency us per ring
    step and collective_overhead us override its figures) and the per-token latency split."""
    from . import roofline_tp
    for name, v in (("batch", batch), ("context", context), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ObservatoryError(f"--{name} must be a positive integer, got {v!r}")
    notes = []
    if context > cfg.max_position_embeddings:
        notes.append(f"context {context:,} is past the model's max_position_embeddings "
                     f"({cfg.max_position_embeddings:,}); predicted anyway")
    parallel = tp > 1 or any(v is not None for v in (interconnect, link_bandwidth, link_latency,
                                                      collective_overhead))
    link = roofline_tp.interconnect(interconnect, link_bandwidth, link_latency, collective_overhead) \
        if parallel else None
    costs = roofline_tp.rank_costs(cfg, tp, batch, context, dtype)  # tp=1: step_costs() itself
    hw = hardware_peaks(hardware, dtype, measured)
    pred = predict(costs, hw["GB_s"] * 1e9, hw["GFLOP_s"] * 1e9, batch)
    tot = totals(costs)
    out = {"kind": "roofline", "config": {"architecture": cfg.architecture, "num_layers": cfg.num_layers,
                                          "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                                          "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                                          "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
                                          "tie_word_embeddings": cfg.tie_word_embeddings,
                                          "num_params": cfg.num_params},
           "hardware": hw, "batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."),
           "costs": costs, "totals": tot, "kv_bytes_share": costs["attention"]["read_bytes"] / tot["read_bytes"],
           "lm_head_softmax_bytes_share": (costs["lm_head"]["read_bytes"] + costs["sampling"]["read_bytes"])
           / tot["read_bytes"], "predicted": pred, "notes": notes,
           "hardware_table": {k: {"label": v["label"], "GB_s": v["GB_s"], "TFLOP_s": v["TFLOP_s"],
                                  "source": v["source"]} for k, v in HARDWARE.items()}}
    if parallel:
        out["parallel"] = roofline_tp.parallel_section(cfg, tp, batch, context, dtype, hw, link, costs)
        notes += out["parallel"].pop("notes")
    return out
