"""What `sluice inspect` will cost, said before it starts, and signs of life while it runs.

The work of one inspect is set by four numbers: layers L, hidden C, vocabulary V and prompt tokens T.
- two forwards (the probes' and the lens's): ~2 N T FLOPs each for N parameters, plus attention's
  4 L T^2 (heads x head_dim) (scores and values, a causal half of T^2 counted);
- the logit lens: every x_l through the LM head, 2 (L+1) T C V FLOPs (lens.lens_flops), the
  biggest term by far at a 150k vocabulary (Qwen3-0.6B at 512 tokens: 4.7 TFLOP);
- the softmax-safety table: 3 methods x 3 dtypes x 2 (with and without the final norm) = 18 passes
  over T x V logits, each checked against an fp64 reference.
The memory is the lens's working set (lens.lens_bytes) plus a few (T, V) fp32 logit tensors.

Time is not guessed from FLOPs alone (a CPU's rate depends on shapes, dtype and who else runs):
a short calibration times one chunk of the lens exactly as the lens will run it, and the safety
table on a few rows, and scales both. The forward is timed at the lens chunk's FLOP rate. Below
CALIBRATE_FLOPS of work nothing is timed: it finishes before an estimate would be useful.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from .lens import chunk_rows, head_logits, lens_bytes, lens_flops
from .softmax import METHODS, softmax_safety

SAFETY_PASSES = 2 * len(METHODS) * 3  # with/without the final norm x methods x (fp32, fp16, bf16)
CALIBRATE_FLOPS = 50e9  # less work than this is not worth a calibration (a second or two at most)
ANNOUNCE_S = 10.0  # an estimate at least this long is printed even without a progress display
SAFETY_ROWS = 4  # rows of the softmax-safety calibration


def estimate(model, T: int, calibrate: bool | None = None) -> dict:
    """FLOPs, bytes and (when calibrated) seconds of an inspect of T tokens on `model`. calibrate:
    None = only when the work passes CALIBRATE_FLOPS."""
    cfg = getattr(model, "full_config", model.config)
    L, V = cfg.num_layers, cfg.vocab_size
    forward = 2.0 * cfg.num_params * T + 2.0 * L * T * T * cfg.num_heads * cfg.head_dim
    lens = lens_flops(cfg, 1, T)
    out = {"tokens": T, "forward_flops": forward, "lens_flops": lens,
           "safety_logits": SAFETY_PASSES * T * V, "total_flops": 2 * forward + lens,
           "weight_bytes": sum(p.nbytes for p in model.parameters()),
           # the lens's working set, plus the forward's logits, the raw (no final norm) logits and
           # the probes' log-softmax temporaries, each (T, V) fp32
           "peak_bytes_estimate": lens_bytes(model, 1, T) + 4 * T * V * 4}
    if calibrate is None:
        calibrate = out["total_flops"] >= CALIBRATE_FLOPS
    if calibrate:
        out.update(_calibrate(model, T))
        out["seconds_estimate"] = (2 * forward / out["calibration"]["lens_flop_s"] + out["lens_s"] + out["safety_s"])
    return out


@torch.inference_mode()
def _calibrate(model, T: int) -> dict:
    """Time one lens chunk and the safety table on SAFETY_ROWS rows; scale them to T tokens."""
    cfg = getattr(model, "full_config", model.config)
    C, V, L = cfg.hidden_size, model.config.vocab_size, cfg.num_layers  # a rank's own vocabulary part
    w = model.embed.weight
    n = min(T, chunk_rows(V))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, C, generator=g).to(dtype=w.dtype, device=w.device)
    head_logits(model, x[:1]).log_softmax(-1)  # warm-up: first-call costs are not the lens's
    t0 = time.perf_counter()
    head_logits(model, x).log_softmax(-1).exp()
    chunk_s = time.perf_counter() - t0
    rows = min(T, SAFETY_ROWS)
    z = 5 * torch.randn(rows, V, generator=g)
    t0 = time.perf_counter()
    softmax_safety(z)
    safety_row_s = (time.perf_counter() - t0) / rows
    chunks = (L + 1) * math.ceil(T / n)
    return {"lens_s": 1.3 * chunks * chunk_s,  # 1.3: top-k, KL and entropy on each chunk's log-probs
            "safety_s": 2 * T * safety_row_s,
            "calibration": {"lens_chunk_rows": n, "lens_chunk_s": chunk_s,
                            "lens_flop_s": 2 * n * C * V / max(chunk_s, 1e-9), "safety_row_s": safety_row_s}}


def describe(cost: dict) -> str:
    """One paragraph for stderr: what will be done and about how long it takes."""
    tf = lambda x: f"{x / 1e12:.2f} TFLOP" if x >= 1e11 else f"{x / 1e9:.1f} GFLOP"  # noqa: E731
    text = (f"inspect of {cost['tokens']:,} tokens: two forwards {tf(2 * cost['forward_flops'])}, logit lens "
            f"{tf(cost['lens_flops'])}, softmax safety {SAFETY_PASSES} passes over "
            f"{cost['safety_logits'] / SAFETY_PASSES / 1e6:,.1f}M logits; weights "
            f"{cost['weight_bytes'] / 2**30:.2f} GiB, working memory ~{cost['peak_bytes_estimate'] / 2**30:.2f} GiB")
    if "seconds_estimate" in cost:
        c = cost["calibration"]
        text += (f"; estimated {_duration(cost['seconds_estimate'])} (calibrated here: LM head "
                 f"{c['lens_flop_s'] / 1e9:,.0f} GFLOP/s, softmax safety {1e3 * c['safety_row_s']:.1f} ms a row)")
    return text


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


class LineProgress:
    """The progress display's three methods as plain lines on stderr, for logs and pipes where a
    live bar draws nothing: a line when a stage starts, then about every tenth of it, then at its end."""

    def __init__(self, stream=None):
        self.stream, self.tasks, self.t0 = stream or sys.stderr, [], time.perf_counter()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self._say(f"done in {_duration(time.perf_counter() - self.t0)}")

    def add_task(self, description: str, total: int = 1) -> int:
        self.tasks.append([description, total, 0, 0])
        self._say(f"{description}: started")
        return len(self.tasks) - 1

    def advance(self, task: int, n: int = 1) -> None:
        t = self.tasks[task]
        t[2] += n
        step = max(1, t[1] // 10)
        if t[2] >= t[1] or t[2] - t[3] >= step:
            t[3] = t[2]
            self._say(f"{t[0]}: {t[2]}/{t[1]}")

    def update(self, *a, **k) -> None:
        pass

    def _say(self, text: str) -> None:
        print(f"[inspect {time.perf_counter() - self.t0:6.1f} s] {text}", file=self.stream, flush=True)
