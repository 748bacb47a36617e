"""Micro bench of engine/fast_step.py (step.cpp) against the engine's torch step.

Per model and weight dtype: ms per decode step (batch 1 and a few batch sizes) and the cost of a
verification chunk of T = 1, 2, 4, 8, 16 tokens in one call (what decides whether speculative
decoding pays). Both run as the continuous-batching scheduler calls them (batch_forward.py): on a
paged KV pool read through each row's block table, the native step with block_table=, the torch
step as the model's forward over a PagedView, on the model as the engine runs it: fp32 with
gemv.use_fast_linears, or bf16 weights in mixed.py's fp32-compute mode. Both are timed on the same
prefilled pool at the same positions; each number is the best and the median of several repeats
(the best is what a quiet machine gives; this 2-core box is shared). Run it under the bench lock:

    flock /tmp/sluice-bench.lock .venv/bin/python bench/fast_step.py [--q06 /tmp/sluice-speed-q06] \
        [--out docs/results/bench-fast-step.json]

The results below were measured before the static path retired, on its static (B, S) cache, with
the same kernels.

Results (AMD EPYC, 2 cores, AVX2 + FMA + F16C, no AVX-512; torch 2 threads), docs/results/bench-fast-step.json.
Measured 2026-11-30 17:13 and 18:05-18:16 under the lock, but with a load of 4-9 from unlocked test
runs, so medians are 3-10x the bests and only the bests say what the code can do:
  bundled fp32, decode B=1:   fast 1.45 ms (692 tok/s)  torch step 19-67 ms
  bundled bf16-weight mode, T=1: fast 1.28 ms (781 tok/s)  torch step 36-49 ms
  bundled bf16, verify T=4 / T=8 per call: 4.3 / 6.6 ms (T=1 1.3 ms): a chunk of 8 costs ~5 steps
  Qwen3-0.6B shape and B=4/16: not trustworthy in that load (a 2-thread region whose partner is
  descheduled waits a time slice at each of its ~6 barriers per layer); re-measure on a quiet box.

Batched decode on an Intel Xeon (2 cores, AVX-512F/BW/VL + AMX, 2 threads), 2026-12-01, after step.cpp's
AVX-512 path (register tiles of 4 weight rows x 4 token rows, attention per KV head; docs/benchmarks.md
"Batched decode on AVX-512"): the bundled fp32 model's native step, best of 15 alternating rounds
against the previous step.cpp in the same process, context ~64: B=1 0.66 ms (was 0.66), B=2 0.62
(0.76), B=4 0.77 (1.05), B=8 1.17 (2.00). Decode of 8 rows now costs ~1.8 single-row steps, not ~3.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import sluice
from common import environment, save_json
from sluice.engine import gemv, mixed
from sluice.engine.fast_step import FastStep
from sluice.engine.paged_cache import DEFAULT_BLOCK_SIZE, BlockPool, PagedView

PROMPT = 64  # tokens already in the cache when the timed steps run


def engine_model(path, weights: str):
    """The model as the engine runs it on this CPU (fast linears or bf16-weight mode)."""
    model = sluice.load(path, dtype=weights)
    if weights == "bfloat16":
        mixed.use_fp32_compute(model)
    else:
        gemv.use_fast_linears(model)
    return model


def timed(fn, repeats: int, min_seconds: float) -> tuple[float, float]:
    """(best, median) seconds per call over `repeats` runs of enough calls to take min_seconds."""
    fn()
    t0 = time.perf_counter()
    fn()
    n = max(1, int(min_seconds / max(time.perf_counter() - t0, 1e-6)))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n)
    return min(runs), statistics.median(runs)


def measure(model, batch: int, T: int, repeats: int, min_seconds: float) -> dict:
    vocab = model.config.vocab_size
    per_row = -(-(PROMPT + 32) // DEFAULT_BLOCK_SIZE)  # blocks for the prompt and the timed tokens
    pool = BlockPool(model.config, batch * per_row, DEFAULT_BLOCK_SIZE, mixed.activation_dtype(model),
                     model.embed.weight.device)
    view = PagedView(pool, [[pool.take() for _ in range(per_row)] for _ in range(batch)])
    fast = FastStep(model)
    prompts = torch.tensor([[(7 * i + b) % vocab for i in range(PROMPT)] for b in range(batch)])
    tokens = torch.randint(0, vocab, (batch, T))
    positions = PROMPT + torch.arange(T).expand(batch, T)
    k, v = pool.k, pool.v
    out = {}
    with torch.inference_mode():
        # the prompts' keys and values, as the scheduler's prefill chunks write them
        fast(prompts, torch.arange(PROMPT).expand(batch, PROMPT), k, v, hidden=True, block_table=view.table)
        for name, fn in (("fast", lambda: fast(tokens, positions, k, v, block_table=view.table)),
                         ("torch", lambda: model(tokens, positions, view))):
            best, med = timed(fn, repeats, min_seconds)
            out[name] = {"ms_best": round(best * 1e3, 3), "ms_median": round(med * 1e3, 3),
                         "tok_per_s_best": round(batch * T / best, 1)}
        # both read the same prefilled pool: their logits agree to the parity bounds of tests/engine
        out["max_abs_logit_diff"] = float((fast(tokens, positions, k, v, block_table=view.table)
                                           - model(tokens, positions, view)).abs().max())
    out["speedup_best"] = round(out["torch"]["ms_best"] / out["fast"]["ms_best"], 2)
    return out


def bench_model(path, weights: str, batches, chunks, repeats: int, min_seconds: float) -> dict:
    model = engine_model(path, weights)
    res = {"decode": {}, "verify_batch1": {}}
    for B in batches:
        res["decode"][f"B={B}"] = measure(model, B, 1, repeats, min_seconds)
        print(weights, f"decode B={B}", res["decode"][f"B={B}"], flush=True)
    for T in chunks:
        res["verify_batch1"][f"T={T}"] = measure(model, 1, T, repeats, min_seconds)
        print(weights, f"verify T={T}", res["verify_batch1"][f"T={T}"], flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--q06", type=Path, default=None, help="a Qwen3-0.6B-shaped checkpoint directory")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.3, help="minimum time per repeat")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", type=Path, action="append", default=[],
                    help="another checkpoint directory (any family, e.g. a random Gemma-2-shaped one): decode "
                         "at B=1 and 4 and a verify chunk of 4, fp32 and bf16 weights; with it the bundled model "
                         "is skipped")
    a = ap.parse_args()
    result = {"environment": environment(), "prompt_tokens_in_cache": PROMPT, "models": {}}
    for path in a.model:
        for weights in ("float32", "bfloat16"):
            result["models"][f"{path.name}/{weights}"] = bench_model(path, weights, (1, 4), (4,), a.repeats, a.seconds)
            save_json(a.out, result)
    if a.model:
        return
    for weights in ("float32", "bfloat16"):
        result["models"][f"bundled/{weights}"] = bench_model(None, weights, (1, 2, 4, 8, 16), (1, 2, 4, 8, 16),
                                                             a.repeats, a.seconds)
        save_json(a.out, result)  # after each model: a long run cut short keeps what it measured
    if a.q06 is not None:
        for weights in ("bfloat16", "float32"):
            result["models"][f"q06/{weights}"] = bench_model(a.q06, weights, (1,), (1, 4, 8), 3, 1.0)
            save_json(a.out, result)


if __name__ == "__main__":
    main()
