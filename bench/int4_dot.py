"""int4 on the native step: decode with the integer dot (fast_step INT4_DOT "int8", native/q4i.h) against the
fp32-widening dot (q4.h), and prefill chunks of the native step (both modes) against torch's int4 op
(_weight_int4pack_mm_for_cpu, the torch forward int4 models ran before the native step took them).

One quantized model (loaded in fp32, as `sluice bench --quantize int4` loads it), one paged KV pool prefilled with
the same prompt. Decode: rounds alternate the two modes, each timing --steps steps at the next positions (every
round rewrites the same slots). Prefill: rounds alternate native and torch over a --prefill-token prompt.
Reported: median and best ms, tok/s, the per-round ratios, and the largest logit difference of each pair.

    flock /tmp/sluice-bench.lock .venv/bin/python bench/int4_dot.py --model /path/to/qwen3-0.6b \
        [--batch 1,4] [--out docs/results/bench-int4-dot.json]
    .venv/bin/python bench/int4_dot.py --quick       # the bundled model, a few rounds: a smoke test

On a shared machine (other processes on its cores) the numbers steer work, they are not results.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import sluice
from common import environment, save_json
from sluice.engine.fast_step import FastStep, unsupported
from sluice.engine.paged_cache import DEFAULT_BLOCK_SIZE, BlockPool, PagedView


def _pool(model, batch: int, tokens: int):
    per_row = -(-tokens // DEFAULT_BLOCK_SIZE)
    pool = BlockPool(model.config, batch * per_row, DEFAULT_BLOCK_SIZE, torch.float32, "cpu")
    return pool, PagedView(pool, [[pool.take() for _ in range(per_row)] for _ in range(batch)])


def _summary(per_round: dict, rows: int) -> dict:
    out = {}
    for name, times in per_round.items():
        med, best = statistics.median(times), min(times)
        out[name] = {"ms_median": round(med * 1e3, 3), "ms_best": round(best * 1e3, 3),
                     "tok_s_median": round(rows / med, 2), "tok_s_best": round(rows / best, 2)}
    (a, ta), *others = per_round.items()  # the first path's speed over each other's
    for b, tb in others:
        out[f"{a}_over_{b}_median"] = round(statistics.median(tb) / statistics.median(ta), 3)
        out[f"{a}_over_{b}_per_round"] = [round(y / x, 3) for x, y in zip(ta, tb, strict=True)]
    return out


def _alternate(paths: dict, rounds: int, reps: int) -> dict:
    per_round = {name: [] for name in paths}
    for fn in paths.values():  # warm-up: first calls allocate and fault in pages
        fn(0)
    for _ in range(rounds):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            for s in range(reps):
                fn(s)
            per_round[name].append((time.perf_counter() - t0) / reps)
    return per_round


def decode(model, batch: int, prompt: int, steps: int, rounds: int) -> dict:
    vocab = model.config.vocab_size
    pool, view = _pool(model, batch, prompt + steps)
    steps_by = {mode: FastStep(model, int4_dot=mode) for mode in ("int8", "fp32")}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=g)
    tokens = torch.randint(0, vocab, (batch, steps), generator=g)
    with torch.inference_mode():
        steps_by["fp32"](prompts, torch.arange(prompt).expand(batch, prompt), pool.k, pool.v, hidden=True,
                         block_table=view.table)

        def one(step):
            return lambda s: step(tokens[:, s:s + 1], torch.full((batch, 1), prompt + s), pool.k, pool.v,
                                  block_table=view.table)
        paths = {mode: one(st) for mode, st in steps_by.items()}
        per_round = _alternate({m: lambda i, f=f: [f(s) for s in range(steps)] for m, f in paths.items()}, rounds, 1)
        per_round = {m: [t / steps for t in ts] for m, ts in per_round.items()}
        logits = [f(0) for f in paths.values()]
    out = {"batch": batch, "steps_per_round": steps, "rounds": rounds,
           "max_abs_logit_diff": float((logits[0] - logits[1]).abs().max()),
           "max_abs_logit": float(logits[1].abs().max())}
    return out | _summary(per_round, batch)


def prefill(model, tokens: int, rounds: int) -> dict:
    vocab = model.config.vocab_size
    pool, view = _pool(model, 1, tokens)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(tokens)[None]

    def native(mode):
        fast = FastStep(model, int4_dot=mode)
        return lambda s: fast(ids, pos, pool.k, pool.v, block_table=view.table)[:, -1]
    with torch.inference_mode():
        paths = {"int8": native("int8"), "fp32": native("fp32"), "torch": lambda s: model(ids, pos, view)[:, -1]}
        per_round = _alternate(paths, rounds, 1)
        last = {k: f(0) for k, f in paths.items()}
    out = {"tokens": tokens, "rounds": rounds, "max_abs_logit": float(last["torch"].abs().max()),
           "max_abs_logit_diff_vs_torch": {k: float((v - last["torch"]).abs().max()) for k, v in last.items()}}
    return out | _summary(per_round, tokens)


def print_table(result: dict) -> None:
    print("| row | path | ms median | tok/s median | tok/s best |")
    print("|---|---|---:|---:|---:|")
    for key, r in result["rows"].items():
        for path in ("int8", "fp32", "torch"):
            if path in r:
                p = r[path]
                print(f"| {key} | {path} | {p['ms_median']} | {p['tok_s_median']} | {p['tok_s_best']} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--batch", default="1", help="comma-separated rows per decode step (default 1; up to 8 take "
                    "the integer dot)")
    ap.add_argument("--prompt", type=int, default=128, help="tokens in the cache before the timed decode steps")
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens of the prefill comparison (0: none)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=9, help="rounds per path, alternating")
    ap.add_argument("--quick", action="store_true", help="the bundled model, 3 rounds of 4 steps: a smoke test")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.rounds, a.prompt, a.prefill = 4, 3, 16, 16
    model = sluice.load(a.model, dtype="float32", quantize="int4")
    why = unsupported(model)
    if why is not None:
        raise SystemExit(f"the native step cannot run this model: {why}")
    result = {"environment": environment(), "quick": a.quick, "model": str(a.model or "bundled"), "rows": {}}
    for batch in (int(b) for b in a.batch.split(",")):
        result["rows"][f"decode B={batch}"] = r = decode(model, batch, a.prompt, a.steps, a.rounds)
        print(f"decode B={batch}: int8 {r['int8']['tok_s_median']} tok/s, fp32 {r['fp32']['tok_s_median']} tok/s "
              f"(int8/fp32 {r['int8_over_fp32_median']}x)", flush=True)
        save_json(a.out, result)  # after each row: a long run cut short keeps what it measured
    if a.prefill:
        result["rows"][f"prefill {a.prefill}"] = r = prefill(model, a.prefill, a.rounds)
        print(f"prefill {a.prefill}: native int8 {r['int8']['tok_s_median']} tok/s, native fp32 "
              f"{r['fp32']['tok_s_median']}, torch's int4 op {r['torch']['tok_s_median']} (int8/fp32 "
              f"{r['int8_over_fp32_median']}x, int8/torch {r['int8_over_torch_median']}x)", flush=True)
    result["loadavg_at_end"] = list(os.getloadavg())
    save_json(a.out, result)
    print_table(result)


if __name__ == "__main__":
    main()
