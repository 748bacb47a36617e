"""The load test's requests fed to the continuous-batching engine directly, without HTTP: how much of
`sluice serve`'s throughput the engine itself gives at C requests in flight against 1.

Same request mix as bench/serve_load.py (its make_specs / fit_prompts: prompts 16-256 tokens, 16-128
output tokens, half greedy, half sampled at temperature 0.8 with top_k 40 / top_p 0.95 and a seed),
the bundled model in fp32, stepped from this thread through LLM.add_request / step (the server's
API); C and 1 alternate for --rounds. Run it under the bench lock:

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/engine_load.py [-n 48] [-c 8] [--rounds 2]

2026-12-01, 2-core Intel Xeon (AVX-512, AMX), commit 3279881's engine: 8 in flight 2,731-3,319 tok/s,
1 in flight 899-925 (3.0-3.6x); through the server at the same time ~1,700 / ~610 (docs/serve-load.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import fit_prompts, make_specs  # noqa: E402

from sluice import LLM, SamplingParams  # noqa: E402


def params(spec) -> SamplingParams:
    if spec.seed is None:
        return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.8, top_k=40, top_p=0.95, seed=spec.seed,
                          ignore_eos=True)


def run(engine, prompts, specs, concurrency: int) -> float:
    """Output tokens per second with `concurrency` requests in flight until every spec is done."""
    todo, live, tokens = list(zip(prompts, specs, strict=True)), [], 0
    start = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            ids, spec = todo.pop(0)
            live.append(engine.add_request(engine.requests([ids], params(spec))[0]))
        engine.step()
        for seq in [s for s in live if s.finished]:
            live.remove(seq)
            tokens += len(seq.token_ids)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=48, help="requests per run")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(dtype="float32", max_num_seqs=args.concurrency)
    engine, tok = llm, llm.tokenizer
    specs = fit_prompts(make_specs(args.n, (16, 256), (16, 128), 0.5, 0.0, 0), lambda t: len(tok.encode(t)), 0)
    prompts = [tok.encode(s.prompt) for s in specs]
    print(f"torch threads {torch.get_num_threads()}; {args.n} requests, mean prompt "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens")
    run(engine, prompts[:4], specs[:4], args.concurrency)  # warm: builds the native step and the pool's pages
    for _ in range(args.rounds):
        many, one = run(engine, prompts, specs, args.concurrency), run(engine, prompts, specs, 1)
        print(f"{args.concurrency} in flight {many:.0f} tok/s, 1 in flight {one:.0f} tok/s, ratio {many / one:.2f}x")


if __name__ == "__main__":
    main()
