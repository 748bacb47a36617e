"""What the engine alone lets `sluice serve`'s C-clients-over-1 ratio be, on the load bench/serve_load.py sends,
and what would have to get faster for a target ratio (docs/serve-load.md, "The engine's ceiling").

    flock /tmp/sluice-bench.lock .venv/bin/python bench/serve_ceiling.py --out docs/results/serve-ceiling.json

No server and no clients: the same seeded requests (serve_load.make_specs and fit_prompts, same defaults) go
straight to one LLM with max_num_seqs = C, the scheduler and native step the server drives. Per round, each
timed once and the rounds interleaved (the median is kept):
  batch     llm.generate(every request) at once (C at a time): T_c
  serial    llm.generate([request]) for each of the first --serial requests: T_1
  prefill   the same two with max_tokens = 1: P_c (batched) and P_1 (one by one): the prompts' prefill and one
            sampled token each
Each part starts with the prefix cache emptied (BlockPool.drop_cached): serve_load's C run sends prompts the
server has not seen, and its 1-client run finds few of them still cached.
Decode is the rest, D = T - P. The ratio of output tokens/s, (out_c / T_c) / (out_1 / T_1), is what a server with no
cost of its own would reach: HTTP, the event loop and the clients only add to both runs, and what they add per
token is more at C = 1 (one request's overhead spread over fewer steps) than at C.

From the split: the prefill speed-up that alone would bring the ratio to --target (prefill scaled by f in both
runs: out_c (f P_1 + D_1) = target out_1 (f P_c + D_c)), none when even free prefill would not; the same for the
C-row decode alone; and the ratio with no prefill at all. Then why prefill costs what it does: the prompts'
linear-layer FLOPs over P_c (the native step's effective rate, attention and all included) against torch.mm
(oneDNN/MKL) on the same weight shapes at the step's chunk of 64 rows, the CPU's fp32/bf16 GEMM rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import Load, fit_prompts, make_specs, parse_range  # noqa: E402
from serve_servers import sluice_counter  # noqa: E402

from sluice.benchmarks.common import environment, save_json  # noqa: E402
from sluice.benchmarks.speed import params_read_per_token, read_bandwidth  # noqa: E402
from sluice.engine.gemv import cpu_flags  # noqa: E402
from sluice.observatory.disturbance import LoadWatch  # noqa: E402


def sampling(spec, max_tokens: int | None = None):
    from sluice import SamplingParams
    kw = dict(max_tokens=max_tokens or spec.max_tokens, ignore_eos=True, temperature=spec.temperature)
    if spec.seed is not None:  # serve_load's sampled requests: temperature 0.8, top_k 40, top_p 0.95, a seed
        kw.update(seed=spec.seed, top_k=40, top_p=0.95)
    return SamplingParams(**kw)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def solve(target: float, out_c: int, out_1: int, p_c: float, d_c: float, p_1: float, d_1: float) -> dict:
    """The ratio's parts and what it would take to reach `target` (None where one part alone cannot)."""
    ratio = (out_c / (p_c + d_c)) / (out_1 / (p_1 + d_1))
    no_prefill = (out_c / d_c) / (out_1 / d_1) if d_c > 0 and d_1 > 0 else None
    # prefill f times as long in both runs: out_c (f P_1 + D_1) = target out_1 (f P_c + D_c)
    den = out_c * p_1 - target * out_1 * p_c
    f = (target * out_1 * d_c - out_c * d_1) / den if den else None
    prefill_speedup = 1 / f if f is not None and f > 0 else None
    # the C-row decode g times as long: out_c (P_1 + D_1) = target out_1 (P_c + g D_c)
    g = (out_c * (p_1 + d_1) / (target * out_1) - p_c) / d_c if d_c > 0 else None
    decode_speedup = 1 / g if g is not None and g > 0 else None
    return {"ratio": ratio, "ratio_without_prefill": no_prefill, "prefill_share_c": p_c / (p_c + d_c),
            "prefill_share_1": p_1 / (p_1 + d_1), "target": target,
            "prefill_speedup_for_target": prefill_speedup, "decode_c_speedup_for_target": decode_speedup}


def linear_shapes(model) -> list[tuple[int, int]]:
    """(out, in) of each linear of the blocks (the head is left out: a prompt token before the last needs none).
    The weights are fp32 or bf16 (the script takes no --quantize)."""
    shapes = []
    for name, p in model.named_parameters():
        if p.dim() == 2 and ".layers." in f".{name}" and "norm" not in name:
            shapes.append(tuple(p.shape))
    return shapes


def gemm_rate(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: int = 64, seconds: float = 0.5) -> float:
    """GFLOP/s of torch.mm over the shapes, `rows` activation rows each, in the weights' dtype."""
    ws = [torch.randn(n, k, dtype=dtype) for n, k in shapes]
    xs = [torch.randn(rows, k, dtype=dtype) for _, k in shapes]
    flops = sum(2 * rows * n * k for n, k in shapes)
    for x, w in zip(xs, ws):
        x @ w.T
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for x, w in zip(xs, ws):
            x @ w.T
        n += 1
    return n * flops / (time.perf_counter() - start) / 1e9


def last_level_cache() -> int | None:
    """Bytes of the largest CPU cache sysfs lists for cpu0 (None where it lists none)."""
    sizes = []
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes) if sizes else None


def step_profile(llm, prompts: list[str], params: list) -> dict:
    """One more, untimed-for-the-ratio run of `prompts`, with the native step's phase counters on every one-token
    call (the decode rows of a step: batch_forward runs them as one call, prompt chunks as calls of their own): per
    such call, the rows, the seconds of each phase (fast_step.PHASES) and the key/value slots its attention reads
    (a row at position p reads p + 1; sliding windows are not discounted, so this is an upper bound there). The rest
    of the run's wall time is the prompt chunks' native calls and everything outside the native step (scheduler,
    sampler, detokenizer, Python). Empty where the engine does not run the native step."""
    from sluice.engine import fast_step
    counters = fast_step.FastStep.counters()
    acc = {"calls": 0, "rows": 0, "kv_slots": 0, "decode_s": 0.0, "chunk_s": 0.0}
    plain = fast_step.FastStep.__call__

    def counted(self, tokens, positions, k, v, hidden=False, block_table=None, counters_=None):
        one = tokens.shape[-1] == 1
        t = time.perf_counter()
        out = plain(self, tokens, positions, k, v, hidden, block_table, counters if one else counters_)
        acc["decode_s" if one else "chunk_s"] += time.perf_counter() - t
        if one:
            acc["calls"] += 1
            acc["rows"] += tokens.shape[0]
            acc["kv_slots"] += int(positions.sum()) + tokens.shape[0]
        return out

    llm.batch_engine().pool.drop_cached()
    fast_step.FastStep.__call__ = counted
    try:
        wall = timed(lambda: llm.generate(prompts, params))
    finally:
        fast_step.FastStep.__call__ = plain
    if not acc["calls"]:
        return {}
    cfg, n = llm.model.config, acc["calls"]
    kv_slot_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * llm.batch_engine().pool.k.element_size()
    return {"wall_s": wall, "decode_calls": n, "rows_per_call": acc["rows"] / n,
            "decode_call_s": acc["decode_s"], "chunk_call_s": acc["chunk_s"],
            "outside_native_s": wall - acc["decode_s"] - acc["chunk_s"],
            "us_per_call": 1e6 * acc["decode_s"] / n,
            "phases_us_per_call": {k: 1e6 * s / n for k, s in zip(fast_step.PHASES, counters.tolist())},
            "kv_slot_bytes": kv_slot_bytes, "kv_slots": acc["kv_slots"],
            "kv_bytes_per_call": kv_slot_bytes * acc["kv_slots"] / n}


def measure(args) -> dict:
    from sluice import LLM
    load = Load(args.concurrency, args.requests, args.serial, args.prompt_tokens, args.max_tokens, args.sampled,
                0.0, args.seed)
    specs = fit_prompts(make_specs(load.concurrency * load.requests, load.prompt_tokens, load.max_tokens,
                                   load.sampled, 0.0, load.seed), sluice_counter(args.model), load.seed)
    serial = specs[: load.serial or len(specs)]
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=load.concurrency, kv_cache_dtype=args.kv_cache_dtype)
    prompts = [s.prompt for s in specs]
    full, first = [sampling(s) for s in specs], [sampling(s, 1) for s in specs]
    llm.generate(prompts[:2], full[:2])  # warmup: kernels built, pools sized
    parts = {"batch": lambda: llm.generate(prompts, full), "prefill_batch": lambda: llm.generate(prompts, first),
             "serial": lambda: [llm.generate([s.prompt], [q]) for s, q in zip(serial, full)],
             "prefill_serial": lambda: [llm.generate([s.prompt], [q]) for s, q in zip(serial, first)]}
    samples: dict[str, list[float]] = {k: [] for k in parts}
    pool = llm.batch_engine().pool
    for rnd in range(args.reps):
        for name, fn in parts.items():
            pool.drop_cached()  # every part over prompts the engine has not seen, as in serve_load's C run
            samples[name].append(timed(fn))
        print(f"serve_ceiling: round {rnd + 1}/{args.reps}: " +
              ", ".join(f"{k} {v[-1]:.3f} s" for k, v in samples.items()), file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    # where a decode step's time goes, at C rows and alone (the serial requests one by one)
    profile = {"c": step_profile(llm, prompts, full), "1": {}}
    parts1 = [step_profile(llm, [s.prompt], [q]) for s, q in zip(serial, full)]
    if all(parts1):
        n = sum(p["decode_calls"] for p in parts1)
        profile["1"] = {"wall_s": sum(p["wall_s"] for p in parts1), "decode_calls": n,
                        "rows_per_call": sum(p["rows_per_call"] * p["decode_calls"] for p in parts1) / n,
                        **{k: sum(p[k] for p in parts1) for k in ("decode_call_s", "chunk_call_s", "outside_native_s",
                                                                 "kv_slots")},
                        "us_per_call": 1e6 * sum(p["decode_call_s"] for p in parts1) / n,
                        "phases_us_per_call": {k: sum(p["phases_us_per_call"][k] * p["decode_calls"] for p in parts1) / n
                                               for k in parts1[0]["phases_us_per_call"]},
                        "kv_slot_bytes": parts1[0]["kv_slot_bytes"]}
        profile["1"]["kv_bytes_per_call"] = profile["1"]["kv_slot_bytes"] * profile["1"]["kv_slots"] / n
    out_c, out_1 = sum(s.max_tokens for s in specs), sum(s.max_tokens for s in serial)
    p_c, p_1 = med["prefill_batch"], med["prefill_serial"]
    d_c, d_1 = med["batch"] - p_c, med["serial"] - p_1
    prompt_c = sum(s.prompt_tokens for s in specs)
    shapes = linear_shapes(llm.model)
    flops_per_token = sum(2 * n * k for n, k in shapes)
    head_flops = 2 * llm.model.config.vocab_size * llm.model.config.hidden_size
    wdtype = next(p.dtype for n, p in llm.model.named_parameters() if p.dim() == 2 and ".layers." in f".{n}")
    # what `sluice bench` counts as a decode step's weight reads (every matrix, the embedding's one row)
    wbytes, llc = params_read_per_token(Path(llm.model.model_dir)) * wdtype.itemsize, last_level_cache()
    probe = max(4 * (llc or 0), 2 << 30) if args.probe_mib is None else args.probe_mib << 20
    mm_dtype = wdtype if wdtype in (torch.float32, torch.bfloat16) else torch.float32
    for prof in profile.values():  # the rate a one-token call reads its weights and keys/values at while it runs
        if prof:
            prof["read_GB_s"] = (wbytes + prof["kv_bytes_per_call"]) / prof["us_per_call"] / 1e3
    return {
        "workload": {"concurrency": load.concurrency, "requests": len(specs), "serial": len(serial),
                 "prompt_tokens": list(load.prompt_tokens), "max_tokens": list(load.max_tokens),
                 "sampled": load.sampled, "seed": load.seed},
        "model": args.model or "bundled", "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "reps": args.reps, "samples_s": samples,
        "out_tokens": {"c": out_c, "1": out_1}, "prompt_tokens": {"c": prompt_c, "1": sum(s.prompt_tokens for s in serial)},
        "seconds": {"prefill_c": p_c, "decode_c": d_c, "prefill_1": p_1, "decode_1": d_1},
        "tok_s": {"c": out_c / med["batch"], "1": out_1 / med["serial"]},
        "prefill_tok_s": {"c": prompt_c / p_c, "1": sum(s.prompt_tokens for s in serial) / p_1},
        "decode_ms_per_token": {"c": 1e3 * d_c / out_c, "1": 1e3 * d_1 / out_1},
        "ceiling": solve(args.target, out_c, out_1, p_c, d_c, p_1, d_1),
        "decode": {"weight_bytes_per_step": wbytes, "last_level_cache_bytes": llc,
                   "dram_read_GB_s": read_bandwidth(probe)["GB_s"] if probe else None, "probe_bytes": probe,
                   "weights_GB_s_1": wbytes * out_1 / d_1 / 1e9 if d_1 > 0 else None,
                   "flops_per_token": head_flops + flops_per_token,
                   "GFLOP_s_c": (head_flops + flops_per_token) * out_c / d_c / 1e9 if d_c > 0 else None},
        "gemm": {"linear_flops_per_prompt_token": flops_per_token,
                 "native_prefill_gflops": prompt_c * flops_per_token / p_c / 1e9,
                 "torch_mm_gflops": gemm_rate(shapes, mm_dtype), "torch_mm_dtype": str(mm_dtype).split(".")[-1],
                 "rows": 64},
        "step_profile": profile,
    }


def report(r: dict) -> str:
    c, ce, g = r["workload"]["concurrency"], r["ceiling"], r["gemm"]
    fmt = lambda x, s="{:.2f}x": "none" if x is None else s.format(x)  # noqa: E731
    lines = [
        f"engine alone, {r['workload']['requests']} requests at C={c} and {r['workload']['serial']} one by one "
        f"({r['model']}, {r['dtype']}): {r['tok_s']['c']:.1f} / {r['tok_s']['1']:.1f} out tok/s = {ce['ratio']:.2f}x",
        f"  prefill: {r['seconds']['prefill_c']:.3f} s of the C run ({100 * ce['prefill_share_c']:.0f}%), "
        f"{r['seconds']['prefill_1']:.3f} s of the 1 run ({100 * ce['prefill_share_1']:.0f}%); "
        f"{r['prefill_tok_s']['c']:.0f} / {r['prefill_tok_s']['1']:.0f} prompt tok/s",
        f"  decode: {r['decode_ms_per_token']['c']:.3f} ms a token at C, {r['decode_ms_per_token']['1']:.3f} ms alone; "
        f"ratio without prefill {fmt(ce['ratio_without_prefill'])}",
        f"  for {ce['target']:.1f}x: prefill {fmt(ce['prefill_speedup_for_target'])} faster (alone), or the C-row decode "
        f"{fmt(ce['decode_c_speedup_for_target'])} faster (alone)",
        f"  decode reads {r['decode']['weight_bytes_per_step'] / 1e6:.1f} MB of weights a step: "
        f"{fmt(r['decode']['weights_GB_s_1'], '{:.1f}')} GB/s at 1 row (DRAM reads: "
        f"{fmt(r['decode']['dram_read_GB_s'], '{:.1f} GB/s').replace('none', 'not probed')}; last-level cache "
        f"{fmt(r['decode']['last_level_cache_bytes'] and r['decode']['last_level_cache_bytes'] / 2**20, '{:.0f} MiB')}); "
        f"{fmt(r['decode']['GFLOP_s_c'], '{:.0f}')} GFLOP/s at C rows",
        f"  prefill's linears: {g['native_prefill_gflops']:.0f} GFLOP/s effective (attention and all) vs torch.mm "
        f"{g['torch_mm_gflops']:.0f} GFLOP/s ({g['torch_mm_dtype']}, {g['rows']} rows, same shapes)",
    ]
    prof, wbytes = r.get("step_profile") or {}, r["decode"]["weight_bytes_per_step"]
    if prof.get("c") and prof.get("1"):
        def phases(p):
            big = ("qkv_proj", "attention", "o_proj", "mlp", "lm_head")
            ph = p["phases_us_per_call"]
            rest = sum(v for k, v in ph.items() if k not in big)
            return ", ".join(f"{k} {ph[k]:.0f}" for k in big) + f", other {rest:.0f}"
        pc, p1 = prof["c"], prof["1"]
        lines += [
            f"  a decode call of the native step, us: at C ({pc['rows_per_call']:.1f} rows) {pc['us_per_call']:.0f} = "
            f"{phases(pc)}; alone {p1['us_per_call']:.0f} = {phases(p1)}",
            f"  it reads {wbytes / 1e6:.1f} MB of weights and {pc['kv_bytes_per_call'] / 1e6:.2f} MB of keys and values "
            f"at C ({p1['kv_bytes_per_call'] / 1e6:.2f} MB alone): {pc['read_GB_s']:.1f} / {p1['read_GB_s']:.1f} GB/s while it runs",
            f"  outside the native step (scheduler, sampler, detokenizer): {pc['outside_native_s']:.2f} s of the C run's "
            f"{pc['wall_s']:.2f} s ({100 * pc['outside_native_s'] / pc['wall_s']:.0f}%), "
            f"{p1['outside_native_s']:.2f} s of {p1['wall_s']:.2f} s alone "
            f"({100 * p1['outside_native_s'] / p1['wall_s']:.0f}%)",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="LLM(kv_cache_dtype=): the pool's dtype")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("-r", "--requests", type=int, default=12, help="requests per client (serve_load's -r)")
    ap.add_argument("--serial", type=int, default=48, help="requests in the 1-at-a-time run (0: all)")
    ap.add_argument("--prompt-tokens", type=parse_range, default=(16, 256), metavar="LO:HI")
    ap.add_argument("--max-tokens", type=parse_range, default=(16, 128), metavar="LO:HI")
    ap.add_argument("--sampled", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--target", type=float, default=4.0, help="the C-over-1 ratio to solve for")
    ap.add_argument("--probe-mib", type=int, default=None,
                    help="the DRAM read probe's array (default: 4x the last-level cache, at least 2 GiB; 0: none)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    args = ap.parse_args(argv)
    if args.concurrency < 2 or args.requests < 1 or args.reps < 1 or args.target <= 1 or (args.probe_mib or 0) < 0:
        ap.error("need --concurrency >= 2, --requests >= 1, --reps >= 1, --target > 1 and --probe-mib >= 0")
    args.serial = args.serial or None
    watch = LoadWatch()
    result = {"benchmark": "serve_ceiling", **environment(), "cpu_flags": sorted(cpu_flags()),
              "argv": sys.argv[1:] if argv is None else list(argv), **measure(args)}
    load = watch.result()
    result.update(loadavg_at_end=load["loadavg_at_end"], disturbed=load["disturbed"], load=load)
    save_json(args.out, result)  # (with the native builds the run loaded and the code as it was written)
    print(report(result))
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in result["cpu_flags"]]
    print(f"\n{result['cpu']['model']}, {result['torch_threads']} threads, {' '.join(simd)}")
    if result["disturbed"]:
        print("DISTURBED: " + "; ".join(load["disturbed_reasons"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
