"""int8 (or, with --quantize int4, int4) decode on the native step (step.cpp reading the quantized codes) against
the path such models took before it: for int8 the torch step with sluice's int8 decode kernel under each linear
(gemv.FastInt8Linear), for int4 the torch step on torch's int4 op (_weight_int4pack_mm_for_cpu).

Both run on the same quantized model (loaded in fp32, as `sluice bench --quantize int8` loads it), on one
paged KV pool prefilled with the same prompt, at batch 1 (and --batch rows), one token per step. Rounds
alternate native and torch, so a disturbance hits both; each round times --steps decode steps at the next
positions (every round rewrites the same slots). Reported: median and best ms per step, tok/s, and the bytes a
step reads from its weights (the codes, their scales (and zeros), biases and norm gains) with the rate that
makes.

    flock /tmp/sluice-bench.lock .venv/bin/python bench/int8_step.py --model /path/to/qwen3-0.6b \
        [--quantize int4] [--out docs/results/bench-int8-step.json]
    .venv/bin/python bench/int8_step.py --quick       # the bundled model, a few rounds: a smoke test

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
from sluice.engine import gemv
from sluice.engine.fast_step import FastStep, unsupported
from sluice.engine.paged_cache import DEFAULT_BLOCK_SIZE, BlockPool, PagedView
from sluice.model.quant import Int4Linear, Int8Linear


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: every quantized linear's codes, scales (int8: fp32 copies;
    int4: bf16 scales and zeros, read in place) and bias, the norm gains (the embedding is one row per token:
    left out)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.qweight.nbytes + 4 * m.out_features + (0 if m.bias is None else m.bias.nbytes)
        elif isinstance(m, Int4Linear):
            total += m.qweight.nbytes + m.scales_zeros.nbytes + (0 if m.bias is None else m.bias.nbytes)
        elif "Norm" in type(m).__name__:
            total += sum(p.nbytes for p in m.parameters(recurse=False))
    return total


def run(model, batch: int, prompt: int, steps: int, rounds: int) -> dict:
    vocab = model.config.vocab_size
    per_row = -(-(prompt + steps) // DEFAULT_BLOCK_SIZE)
    pool = BlockPool(model.config, batch * per_row, DEFAULT_BLOCK_SIZE, torch.float32, "cpu")
    view = PagedView(pool, [[pool.take() for _ in range(per_row)] for _ in range(batch)])
    fast = FastStep(model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=g)
    tokens = torch.randint(0, vocab, (batch, steps), generator=g)
    with torch.inference_mode():
        fast(prompts, torch.arange(prompt).expand(batch, prompt), pool.k, pool.v, hidden=True, block_table=view.table)
    paths = {"native": lambda t, p: fast(t, p, pool.k, pool.v, block_table=view.table),
             "torch": lambda t, p: model(t, p, view)}
    per_step = {name: [] for name in paths}
    with torch.inference_mode():
        for name, fn in paths.items():  # warm-up: first calls allocate and fault in pages
            fn(tokens[:, :1], torch.full((batch, 1), prompt))
        for _ in range(rounds):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                for s in range(steps):
                    fn(tokens[:, s:s + 1], torch.full((batch, 1), prompt + s))
                per_step[name].append((time.perf_counter() - t0) / steps)
        # both decode the same tokens over the same cache: their logits agree to the tests' bounds
        t, p = tokens[:, :1], torch.full((batch, 1), prompt)
        diff = float((paths["native"](t, p) - paths["torch"](t, p)).abs().max())
    wbytes = weight_bytes(model)
    out = {"batch": batch, "steps_per_round": steps, "rounds": rounds, "max_abs_logit_diff": diff}
    for name, times in per_step.items():
        med, best = statistics.median(times), min(times)
        out[name] = {"ms_median": round(med * 1e3, 3), "ms_best": round(best * 1e3, 3),
                     "tok_s_median": round(batch / med, 2), "tok_s_best": round(batch / best, 2),
                     "weight_GB_s_median": round(wbytes / med / 1e9, 2)}
    out["native_over_torch_median"] = round(out["torch"]["ms_median"] / out["native"]["ms_median"], 2)
    out["native_over_torch_per_round"] = [round(t / n, 2) for n, t in zip(per_step["native"], per_step["torch"],
                                                                          strict=True)]
    return out


def print_table(result: dict) -> None:
    print("| row | ms/step native | ms/step torch | tok/s native | tok/s torch | native/torch | weight GB/s native |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, r in result["rows"].items():
        n, t = r["native"], r["torch"]
        print(f"| {key} | {n['ms_median']} | {t['ms_median']} | {n['tok_s_median']} | {t['tok_s_median']} | "
              f"{r['native_over_torch_median']}x | {n['weight_GB_s_median']} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--batch", default="1", help="comma-separated rows per step (default 1)")
    ap.add_argument("--prompt", type=int, default=128, help="tokens in the cache before the timed steps")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per path, alternating")
    ap.add_argument("--quantize", choices=("int8", "int4"), default="int8", help="the scheme (default int8)")
    ap.add_argument("--quick", action="store_true", help="the bundled model, 3 rounds of 4 steps: a smoke test")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.rounds, a.prompt = 4, 3, 16
    model = sluice.load(a.model, dtype="float32", quantize=a.quantize)
    if a.quantize == "int8":  # the torch step as the engine ran int8 models before: the decode kernel
        gemv.use_fast_linears(model)  # (int4 ones: torch's int4 op)
    why = unsupported(model)
    if why is not None:
        raise SystemExit(f"the native step cannot run this model: {why}")
    result = {"environment": environment(), "quick": a.quick, "model": str(a.model or "bundled"),
              "quantize": a.quantize,
              "weight_bytes_per_step": weight_bytes(model), "prompt_tokens_in_cache": a.prompt, "rows": {}}
    for batch in (int(b) for b in a.batch.split(",")):
        result["rows"][f"decode B={batch}"] = run(model, batch, a.prompt, a.steps, a.rounds)
        save_json(a.out, result)  # after each row: a long run cut short keeps what it measured
    result["loadavg_at_end"] = list(os.getloadavg())
    save_json(a.out, result)
    print_table(result)


if __name__ == "__main__":
    main()
