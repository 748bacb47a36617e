"""Which order the native step's AVX-512 decode tiles should read their weight rows in, on this machine.

    python bench/decode_order.py --model DIR [--dtype bfloat16] [--quantize int8] [--rounds 12] [--steps 16] \
        [--json docs/results/decode-order-<cpu>-<model>-<commit>.json]

fast_step.DECODE_ORDERS: "rows" (each of a tile's 16 rows read whole, one after the other) or "interleaved" (a
line of each of the 16 in turn). Both give the same sums bit for bit (checked here on the first step), so the
choice is speed alone. Two FastSteps over one model, one per order, take turns in this process: --rounds rounds,
each running --steps decode steps of each (the order alternating between rounds, so a drift of the machine's speed
falls on both), after a --prompt-token prefill into a static cache. Written: tokens/s and the weight phases' ms
(FastStep's counters) per order, and the paired ratio rows / interleaved per round, with the CPU, the load average
before and after, and the commit. On an AVX2 build both orders run the same tiles (the ratio is ~1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import cpu_info, save_json

from sluice.benchmarks.common import code_version
from sluice.engine import fast_step, mixed
from sluice.engine.kv_cache import KVCache
from sluice.model import load

WEIGHT_PHASES = ("qkv_proj", "o_proj", "mlp", "lm_head")


def measure(model, orders, prompt: int, steps: int, rounds: int) -> dict:
    steps_of = {o: fast_step.FastStep(model, decode_order=o) for o in orders}
    cache = KVCache(model.config, 1, prompt + steps + 1)
    tokens = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    idx = [fast_step.PHASES.index(p) for p in WEIGHT_PHASES]
    runs = {o: [] for o in orders}
    with torch.inference_mode():
        first = {}
        for o, step in steps_of.items():
            step(tokens, torch.arange(prompt)[None], cache.k, cache.v)
            first[o] = step(torch.tensor([[1]]), torch.tensor([[prompt]]), cache.k, cache.v)
        same = all(torch.equal(first[o], first[orders[0]]) for o in orders)
        for r in range(rounds + 1):  # round 0 warms up
            for o in (orders if r % 2 == 0 else orders[::-1]):
                c = fast_step.FastStep.counters()
                t0 = time.perf_counter()
                for s in range(steps):
                    steps_of[o](torch.tensor([[1 + s]]), torch.tensor([[prompt + s]]), cache.k, cache.v, counters=c)
                dt = time.perf_counter() - t0
                if r:
                    runs[o].append({"tok_s": steps / dt, **{p: c[i].item() / steps * 1e3 for p, i in
                                                            zip(WEIGHT_PHASES, idx, strict=True)}})
    out = {"same_logits": same, "orders": {}}
    for o in orders:
        out["orders"][o] = {k: statistics.median(x[k] for x in runs[o]) for k in runs[o][0]}
        out["orders"][o]["rounds"] = runs[o]
    a, b = orders
    out["paired_ratio_tok_s"] = statistics.median(y["tok_s"] / x["tok_s"] for x, y in zip(runs[b], runs[a],
                                                                                           strict=True))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--quantize", choices=("int8", "int4"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if fast_step.kernel() is None:
        print("decode_order: the native step is not available here", file=sys.stderr)
        return 1
    load_start = list(os.getloadavg())
    model = load(args.model, dtype=args.dtype, quantize=args.quantize)
    if args.dtype == "bfloat16":
        mixed.use_fp32_compute(model)  # the engine's mode for bf16 weights where the native step runs
    orders = ("rows", "interleaved")
    r = measure(model, orders, args.prompt, args.steps, args.rounds)
    load_end = list(os.getloadavg())
    result = {"benchmark": "decode_order", "model": str(args.model), "dtype": args.dtype, "quantize": args.quantize,
              "prompt": args.prompt, "steps": args.steps, "rounds": args.rounds, "cpu": cpu_info(),
              "code": code_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "loadavg_at_start": load_start, "loadavg_at_end": load_end, "cores": os.cpu_count(),
              # another process on the cores (load above their count) makes the ratio noise, not a result
              "disturbed": max(load_start[0], load_end[0]) > (os.cpu_count() or 1),
              "bf16_dot": mixed.bf16_dot() if args.dtype == "bfloat16" and not args.quantize else None, **r}
    for o in orders:
        m = r["orders"][o]
        print(f"{o:12s} {m['tok_s']:7.2f} tok/s  " + "  ".join(f"{p} {m[p]:.3f} ms" for p in WEIGHT_PHASES))
    print(f"rows / interleaved, paired median over {args.rounds} rounds: {r['paired_ratio_tok_s']:.3f}; "
          f"same logits: {r['same_logits']}; load {load_start[0]:.2f} -> {load_end[0]:.2f}"
          + ("  (DISTURBED: load above the core count)" if result["disturbed"] else ""))
    save_json(args.json, result)
    return 0 if r["same_logits"] else 2


if __name__ == "__main__":
    raise SystemExit(main())
