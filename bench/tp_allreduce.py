"""What tensor parallelism's collectives cost per decoded token on this machine (gloo over loopback).

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/tp_allreduce.py --out docs/results/bench-tp-allreduce.json
    ... --decode    also time a real 2-rank LLM(tensor_parallel=2) decode of the bundled model against
                    single-process torch-path decode (kernels=False)

One decoded token of a tensor-parallel sluice model needs, on every rank (parallel/layers.py and
parallel/sampling.py): 2L+1 all-reduces of the (B, hidden) activations (the embedding, then o and
down in each of the L layers) and, for sampled rows, the sampler's three small collectives
(all-reduce max of (B,) fp32 twice: non-finite rows and the max logit; all-gather of each rank's
(B, 2) fp64 race winner). A greedy batch sends two (non-finite, greedy winner). This script spawns 2 and 4 ranks on one process group
(sluice.parallel.group, gloo, one torch thread each) and times, for the bundled model's shape
(hidden 256, 6 layers) and Qwen3-0.6B's (hidden 1024, 28 layers) at batch 1 and 8:
  - one all-reduce of (B, hidden) fp32, alone in a loop
  - the sampler's three collectives together
  - a whole token's collectives, 2L+1 all-reduces + the sampler's three, back to back
each as the median over rounds of the mean over a loop, as rank 0 sees it (every collective ends
when the slowest rank's part has arrived, so the ranks see the same time). The tensors hold zeros:
gloo's cost does not depend on the values, and summing the same buffer over and over must not
overflow. Two cores are shared by all ranks: at 4 ranks they are oversubscribed 2:1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_info, save_json  # noqa: E402

SHAPES = {"bundled": (256, 6), "qwen3-0.6b": (1024, 28)}  # name -> (hidden_size, num_layers)
BATCHES = (1, 8)


def _time(fn, n: int, rounds: int) -> float:
    """Median over `rounds` of the mean seconds of one fn() over `n` calls, every rank starting together."""
    import torch.distributed as dist
    fn()  # warm the connection and the buffers
    out = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def measure(hidden: int, layers: int, batch: int, rounds: int, scale: float) -> dict:
    """One shape's costs on this rank's group: an all-reduce alone, the sampler's collectives, a token."""
    from sluice.parallel import group
    MAX = torch.distributed.ReduceOp.MAX
    x = torch.zeros(batch, hidden)
    small, pair = torch.zeros(batch), torch.zeros(batch, 2, dtype=torch.float64)

    def sampler():
        group.all_reduce(small, op=MAX)  # rows whose logits are not finite
        group.all_reduce(small, op=MAX)  # max logit for the race
        group.all_gather(pair)  # race winner (value, id) of each rank

    def token():
        for _ in range(2 * layers + 1):
            group.all_reduce(x)
        sampler()
    ar = _time(lambda: group.all_reduce(x), max(20, int(400 * scale)), rounds)
    samp = _time(sampler, max(10, int(100 * scale)), rounds)
    tok = _time(token, max(5, int(4000 * scale / (2 * layers + 4))), rounds)
    return {"hidden_size": hidden, "num_layers": layers, "batch": batch, "all_reduce_bytes": x.nbytes,
            "all_reduces_per_token": 2 * layers + 1, "us_per_all_reduce": ar * 1e6,
            "us_sampler_collectives": samp * 1e6, "us_per_token": tok * 1e6,
            "us_per_token_from_parts": ((2 * layers + 1) * ar + samp) * 1e6}


def collectives_worker(rank: int, world: int, init: str, rounds: int, scale: float, queue) -> None:
    torch.set_num_threads(1)
    from sluice.parallel import group
    group.init(rank, world, init_method=init, timeout_s=120, backend="gloo")
    rows = []
    for name, (hidden, layers) in SHAPES.items():
        for batch in BATCHES:
            row = {"shape": name, "world": world, **measure(hidden, layers, batch, rounds, scale)}
            rows.append(row)
            if rank == 0:
                print(f"  {world} ranks, {name} B={batch}: {row['us_per_all_reduce']:8.1f} us per all-reduce of "
                      f"{row['all_reduce_bytes']:,} B, sampler {row['us_sampler_collectives']:7.1f} us, token "
                      f"{row['us_per_token']:9.1f} us", flush=True)
    if rank == 0:
        queue.put(rows)
    group.shutdown()


def decode_worker(rank: int, world: int, init: str, tokens: int, batch: int, queue) -> None:
    """One rank of LLM(tensor_parallel=world) on the bundled model, or (world 1) the single process."""
    import sluice
    from sluice.parallel import group
    torch.set_num_threads(1 if world > 1 else 2)
    if world > 1:
        group.init(rank, world, init_method=init, timeout_s=300, backend="gloo")
        llm = sluice.LLM(tensor_parallel=world)
    else:
        llm = sluice.LLM(kernels=False)
    params = sluice.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = ["def fibonacci(n):"] * batch
    llm.generate(prompts, sluice.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm up
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        s = llm.last_stats
        runs.append({"wall_s": wall, "decode_s": s.decode_seconds, "generated": s.generated_tokens,
                     "decode_tok_s": (s.generated_tokens - s.rows) / s.decode_seconds,
                     "tokens0": out[0].token_ids})
    if rank == 0:
        queue.put(runs)
    if world > 1:
        group.shutdown()


def spawn(fn, world: int, *args) -> object:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=fn, args=(r, world, init, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        result = None
        while result is None:  # a rank that died must not leave us waiting for its result
            try:
                result = queue.get(timeout=5)
            except Exception:  # queue.Empty
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.kill()
                    raise SystemExit(f"a rank process exited with {dead[0]}") from None
        for p in procs:
            p.join(timeout=120)
            if p.exitcode != 0:
                raise SystemExit(f"rank process exited with {p.exitcode}")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the loop lengths (0.05 for a smoke run)")
    ap.add_argument("--decode", action="store_true", help="also time LLM(tensor_parallel=2) against one process")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split() if \
        Path("/proc/cpuinfo").exists() else []
    result = {"kind": "tp_allreduce", "cpu": cpu_info(), "cpu_flags": sorted(
        f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "sse4"))), "cores": os.cpu_count(),
        "torch": torch.__version__, "backend": "gloo (loopback TCP)", "threads_per_rank": 1,
        "loadavg_at_start": os.getloadavg()[0], "rounds": args.rounds, "scale": args.scale, "collectives": []}
    for world in (int(w) for w in args.worlds.split(",")):
        print(f"{world} ranks:", flush=True)
        result["collectives"] += spawn(collectives_worker, world, args.rounds, args.scale)
    if args.decode:
        result["decode"] = {}
        for batch in (1, 8):
            one = spawn(decode_worker, 1, args.decode_tokens, batch)
            two = spawn(decode_worker, 2, args.decode_tokens, batch)
            best1, best2 = max(r["decode_tok_s"] for r in one), max(r["decode_tok_s"] for r in two)
            result["decode"][f"batch_{batch}"] = {
                "single_process_kernels_false_2_threads": one, "tp2_1_thread_per_rank": two,
                "tp2_over_single_decode_tok_s": best2 / best1, "same_tokens": one[0]["tokens0"] == two[0]["tokens0"]}
            print(f"decode B={batch}: one process {best1:.1f} tok/s, 2 ranks {best2:.1f} tok/s "
                  f"({best2 / best1:.2f}x)", flush=True)
    else:
        result["decode"] = "not measured (run with --decode once LLM(tensor_parallel=N) is in)"
    result["loadavg_at_end"] = os.getloadavg()[0]
    save_json(args.out, result)


if __name__ == "__main__":
    main()
