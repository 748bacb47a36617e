"""Prefill of one prompt chunk: the native step (engine/native/step.cpp, in pieces of MAX_CHUNK tokens) against
the torch path, as the continuous-batching scheduler runs them (paged KV pool, batch 1).

For each T: ms for one chunk of T tokens at positions 0..T-1 through FastStep (final-normed hidden
states, as the scheduler asks for a prefill chunk) and through the model's torch forward with logits at
the last token, the medians of --repeats calls, and us per token. Run it under the bench lock:

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/prefill.py [--model DIR] [--lengths 16,64,128]

Results are in docs/changelog-benchmarks.md (2026-12-01 "Prefill through the native step"), with the CPU's flags.
"""

from __future__ import annotations

import argparse
import random

import torch

from common import call_times
from sluice import LLM, SamplingParams
from sluice.engine.native import cpu_flags
from sluice.engine.paged_cache import PagedView


def median_ms(fn, repeats: int) -> float:
    times = call_times(fn, repeats)  # one warm-up call: first-touch of scratch and cache pages
    return times[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model, fp32)")
    ap.add_argument("--lengths", default="16,32,64,96,128,192,256")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=1) if args.model else LLM(dtype="float32", max_num_seqs=1)
    engine = llm.batch_engine()
    llm.generate(["warm up"], SamplingParams(max_tokens=2, temperature=0.0))  # builds the native step
    sched, lengths = engine.scheduler, [int(t) for t in args.lengths.split(",")]
    if sched.forward.fast is None:
        raise SystemExit(f"the native step cannot run this model here: {sched.forward.native_reason}")
    pool, model = sched.pool, sched.model
    blocks = [pool.take() for _ in range(-(-max(lengths) // pool.block_size))]
    view = PagedView(pool, [blocks], sched.device)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    print(f"threads {torch.get_num_threads()}, CPU flags {' '.join(flags)}")
    rng = random.Random(0)
    for T in lengths:
        tokens = torch.tensor([[rng.randrange(1, model.config.vocab_size) for _ in range(T)]])
        positions = torch.arange(T)[None]
        last = torch.full((1,), T - 1)
        with torch.inference_mode():
            native = median_ms(lambda t=tokens, p=positions: sched.forward.fast(t, p, pool.k, pool.v, hidden=True,
                                                                         block_table=view.table), args.repeats)
            eager = median_ms(lambda t=tokens, p=positions, at=last: model(t, p, view, logits_at=at), args.repeats)
        print(f"T={T:4d}  native {native:8.2f} ms ({native / T * 1e3:6.1f} us/token)   "
              f"torch {eager:8.2f} ms ({eager / T * 1e3:6.1f} us/token)   torch / native {eager / native:5.2f}x")
    pool.release_all(blocks)


if __name__ == "__main__":
    main()
