"""The continuous-batching draw of one step: BatchDraw.__call__ on a joined sampler, as the scheduler
calls it (the penalty write-back included), at 1, 4 and 8 rows, on the bundled model's vocabulary
(8,192) and Qwen3's (151,936), for six mixes of sampling params.

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/sampler.py --json docs/results/sampler.json

Each configuration times the native draw (engine/sample.py's kernel) and the torch path (the reference,
what every draw ran before the kernel) interleaved in one process, so a neighbour's load hits both
alike: medians of --repeats calls in microseconds, with the 10th percentile. A row also records how
often the native draw handed a step to the torch path (its margins could not prove the same token), and for
top_p with top_k off, the fraction of rows whose cut needed the sort (native/top_p_cut.h could not prove it).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import environment, save_json
from sluice.engine import sample
from sluice.engine.batch_sampling import BatchDraw, FullHead
from sluice.engine.sampling import SamplingParams

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "T=0.8": lambda i: SamplingParams(temperature=0.8, seed=i),
    "T=0.8 top_k=40": lambda i: SamplingParams(temperature=0.8, top_k=40, seed=i),
    "T=0.8 top_p=0.9": lambda i: SamplingParams(temperature=0.8, top_p=0.9, seed=i),
    "all filters + penalties": lambda i: SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                                         repetition_penalty=1.1, presence_penalty=0.5, seed=i),
    "half greedy, half top_k+top_p": lambda i: (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=i)
                                                if i % 2 else SamplingParams(temperature=0.0)),
}
STEPS = 16  # distinct logits the timed calls cycle through


@dataclass(eq=False)
class FakeSeq:
    """What BatchDraw reads of a sequence: its id and its sampler."""

    id: int
    sampler: object


@contextlib.contextmanager
def torch_path():
    """The draw with the native kernel out: the torch reference."""
    saved = sample.kernel
    sample.kernel = lambda: None
    try:
        yield
    finally:
        sample.kernel = saved


def setup(mix: str, rows: int, V: int, seed: int = 0):
    head = FullHead(V, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(rows):
        s = head.sampler(MIXES[mix](i))
        s.add_context(0, torch.randint(0, V, (64,), generator=g))  # a prompt, for the repetition penalty
        seqs.append(FakeSeq(i, s))
    logits = [torch.randn(rows, V, generator=g) * 4 for _ in range(STEPS)]
    return BatchDraw(head), seqs, logits


def time_pair(mix: str, rows: int, V: int, repeats: int) -> dict:
    """Interleaved: a native call, then a torch one, each on its own draw object and sequences."""
    native, torch_ = setup(mix, rows, V), setup(mix, rows, V)
    times = {"native": [], "torch": []}
    fallbacks0 = sample.STATS["fallback"]
    calls0 = sample.STATS["calls"]
    cut0 = top_p_rows()
    for rep in range(repeats + 10):
        for name, (draw, seqs, logits) in (("native", native), ("torch", torch_)):
            x = logits[rep % STEPS]
            with torch_path() if name == "torch" else contextlib.nullcontext():
                t0 = time.perf_counter()
                draw(seqs, x)
                dt = time.perf_counter() - t0
            if rep >= 10:  # the first calls join the rows and touch pages
                times[name].append(dt * 1e6)
    out = {"mix": mix, "rows": rows, "vocab": V}
    for name, t in times.items():
        t.sort()
        out[f"{name}_us"], out[f"{name}_p10_us"] = round(t[len(t) // 2], 1), round(t[len(t) // 10], 1)
    calls = sample.STATS["calls"] - calls0
    out["native_calls"] = calls
    out["fallback_fraction"] = (sample.STATS["fallback"] - fallbacks0) / calls if calls else 0.0
    bounded, sorted_, moving = (now - then for now, then in zip(top_p_rows(), cut0, strict=True))
    rows_cut = bounded + sorted_ + moving
    out["top_p_sorted_fraction"] = sorted_ / rows_cut if rows_cut else 0.0
    out["top_p_moving_fraction"] = moving / rows_cut if rows_cut else 0.0
    return out


def top_p_rows() -> tuple[int, int, int]:
    """The kernel's counts of top_p rows cut without a sort, sorted, and drawn from a cut proven to within a
    few tokens (native/top_p_cut.h; zeros without the kernel)."""
    kern = sample.kernel()
    return kern.top_p_rows() if kern is not None else (0, 0, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--quick", action="store_true", help="a few repeats of 1 and 8 rows: the smoke test")
    ap.add_argument("--threads", type=int, help="torch's thread count (default: as it is); 1 keeps a busy "
                    "machine's OpenMP waits out of a comparison")
    ap.add_argument("--vocab", default="8192,151936", help="comma-separated vocabulary sizes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 12 if args.quick else args.repeats
    sizes = (1, 8) if args.quick else (1, 4, 8)
    print(f"native sampling kernel: {sample.why_unavailable() or 'loaded'}; threads {torch.get_num_threads()}")
    result = {"env": environment(), "quick": args.quick, "repeats": repeats, "threads": torch.get_num_threads(),
              "rows": []}
    print("| config | rows | vocab | native us (p10) | torch us (p10) | torch / native | fallbacks | top_p sorted "
          "| top_p moving |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for V in map(int, args.vocab.split(",")):
        for mix in MIXES:
            for B in sizes:
                r = time_pair(mix, B, V, max(6, repeats // (8 if V > 8192 else 1)))
                result["rows"].append(r)
                print(f"| {mix} | {B} | {V} | {r['native_us']:.0f} ({r['native_p10_us']:.0f}) | {r['torch_us']:.0f} "
                      f"({r['torch_p10_us']:.0f}) | {r['torch_us'] / r['native_us']:.2f}x | "
                      f"{r['fallback_fraction']:.3f} | {r['top_p_sorted_fraction']:.2f} | "
                      f"{r['top_p_moving_fraction']:.2f} |", flush=True)
    result["loadavg_at_end"] = list(__import__("os").getloadavg())
    save_json(args.json, result)


if __name__ == "__main__":
    main()
