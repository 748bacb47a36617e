"""The load test's requests fed to the continuous-batching engine directly, without HTTP: how much of
`sluice serve`'s throughput the engine itself gives at C requests in flight against 1.

Same request mix as bench/serve_load.py (its make_specs / fit_prompts: prompts 16-256 tokens, 16-128
output tokens, half greedy, half sampled at temperature 0.8 with top_k 40 / top_p 0.95 and a seed),
the bundled model in fp32, stepped from this thread through LLM.add_request / step (the server's
API); C and 1 alternate for --rounds. Run it under the bench lock:

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/engine_load.py [-n 48] [-c 8] [--rounds 2] [--json F]

Besides tokens/s, each run splits its steps in two: a step that admitted a request (the step prefills its
prompt, and every row in flight waits for it) and a decode-only step; the JSON keeps both kinds' mean
milliseconds and counts, which is what says where the C-over-1 ratio goes.

2026-12-01, 2-core Intel Xeon (AVX-512, AMX), commit 3279881's engine: 8 in flight 2,731-3,319 tok/s,
1 in flight 899-925 (3.0-3.6x); through the server at the same time ~1,700 / ~610 (docs/serve-load.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import fit_prompts, make_specs  # noqa: E402

from sluice import LLM, SamplingParams  # noqa: E402
from sluice.benchmarks.common import environment, save_json  # noqa: E402


def params(spec) -> SamplingParams:
    if spec.seed is None:
        return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.8, top_k=40, top_p=0.95, seed=spec.seed,
                          ignore_eos=True)


def run(engine, prompts, specs, concurrency: int) -> dict:
    """Output tokens per second with `concurrency` requests in flight until every spec is done, and the
    seconds of the steps that admitted a request (prefill) and of the others (decode only)."""
    todo, live, tokens = list(zip(prompts, specs, strict=True)), [], 0
    prefill_steps, decode_steps = [], []
    start = time.perf_counter()
    while todo or live:
        admitted = False
        while todo and len(live) < concurrency:
            ids, spec = todo.pop(0)
            live.append(engine.add_request(engine.requests([ids], params(spec))[0]))
            admitted = True
        t0 = time.perf_counter()
        engine.step()
        (prefill_steps if admitted else decode_steps).append(time.perf_counter() - t0)
        for seq in [s for s in live if s.finished]:
            live.remove(seq)
            tokens += len(seq.token_ids)
    seconds = time.perf_counter() - start

    def ms(xs):
        return {"count": len(xs), "mean_ms": 1e3 * sum(xs) / len(xs) if xs else None,
                "total_s": sum(xs)}
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "prefill_steps": ms(prefill_steps), "decode_steps": ms(decode_steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=48, help="requests per run")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the runs here (docs/results/engine-load-*.json)")
    args = ap.parse_args()
    env = environment()
    llm = LLM(dtype="float32", max_num_seqs=args.concurrency)
    engine, tok = llm, llm.tokenizer
    specs = fit_prompts(make_specs(args.n, (16, 256), (16, 128), 0.5, 0.0, 0), lambda t: len(tok.encode(t)), 0)
    prompts = [tok.encode(s.prompt) for s in specs]
    print(f"torch threads {torch.get_num_threads()}; {args.n} requests, mean prompt "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens")
    run(engine, prompts[:4], specs[:4], args.concurrency)  # warm: builds the native step and the pool's pages
    rounds = []
    for _ in range(args.rounds):
        many, one = run(engine, prompts, specs, args.concurrency), run(engine, prompts, specs, 1)
        rounds.append({"c": many, "one": one, "ratio": many["tok_s"] / one["tok_s"]})
        print(f"{args.concurrency} in flight {many['tok_s']:.0f} tok/s, 1 in flight {one['tok_s']:.0f} tok/s, "
              f"ratio {many['tok_s'] / one['tok_s']:.2f}x; decode step {many['decode_steps']['mean_ms']:.2f} ms "
              f"at {args.concurrency} against {one['decode_steps']['mean_ms']:.2f} ms at 1; a prefill step "
              f"{one['prefill_steps']['mean_ms']:.1f} ms at 1")
    middle = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]  # the round of the median ratio
    save_json(args.json, {"environment": env, "loadavg_at_end": list(os.getloadavg()), "argv": sys.argv[1:],
                          "requests": args.n, "concurrency": args.concurrency,
                          "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
                          "rounds": rounds, "median_round": middle})


if __name__ == "__main__":
    main()
