"""The LM head + sampling: plain (full logits, then Sampler) versus fused (engine/fused_head.py), CPU.

    python bench/fused_head.py --json runs/bench/fused_head.json   # the full grid
    python bench/fused_head.py --engine --json runs/bench/fused_head_engine.json  # the engine, bundled model
    python bench/fused_head.py --quick                              # seconds-long smoke test

plain  logits = F.linear(h, W).float(), (B, V) as Transformer.logits makes them; then Sampler: a
       full-row argmax (greedy), or for top-p one stable sort of the row, softmax, cumsum, the mask
       scattered back, (B, V) Exp(1) noise and the exponential race.
fused  FusedHead(Sampler): W is walked in chunks of rows; each (B, chunk) block of logits feeds
       the running argmax / online softmax / per-chunk top-K candidates and is dropped; rows whose
       top-p cut is not provably inside the candidates fall back to the plain path (counted).

W is random N(0, 1/C) in the weight dtype and h is N(0, logit_std^2) in the same dtype, so each
row's logits are about N(0, logit_std^2): logit_std 5 gives ~3 nats of entropy and top-p 0.9
nuclei of a few to a few hundred tokens, which is what decides how often the fused path falls
back. Every rep draws new hidden states, and both paths run on them back to back (alternating
which goes first); the table shows mean times (a step that falls back costs what it costs) and the
median of the per-rep ratios (steadier when other work shares the machine).

--engine times whole generations instead: the bundled (trained) model through LLM(fused_head=False)
and LLM(fused_head=True), decode tokens/s, so its fallback rate is that of a real model's
distributions (a random checkpoint is flat: top-p would fall back at nearly every step).

Peak memory is the allocator's own account: the call runs once under torch.profiler with
profile_memory=True, its allocation (+bytes) and free (-bytes) events are replayed in time order,
and the peak of the running sum is reported: the most bytes the call held at once beyond what
existed before it (weights and hidden states excluded; the Sampler is fresh, so its lazily made
(B, V) noise buffer counts, as it is state the plain path needs).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from common import environment, save_json

SHAPES = {"qwen3-0.6b": (1024, 151936), "llama-3-8b": (4096, 128256), "2048x262k": (2048, 262144)}
QUICK_SHAPES = {"quick": (128, 5003)}
MODES = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=1.0, top_p=0.9),
         "top_k": dict(temperature=1.0, top_k=50), "temperature": dict(temperature=0.8)}


def peak_bytes(fn) -> int:
    """Peak of live bytes allocated by torch during fn() (allocations minus frees, in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def loadavg() -> list[float]:
    """1, 5 and 15-minute load averages: above ~2 on this 2-core machine, someone else was computing."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return [math.nan] * 3


def make_paths(W, B: int, mode: str, chunk: int, candidates: int):
    """Two callables hidden (B, C) -> tokens (plain, fused), each with a fresh Sampler of B rows."""
    from sluice.engine.fused_head import FusedHead
    from sluice.engine.sampling import Sampler, SamplingParams

    V = W.shape[0]
    params = [SamplingParams(seed=1000 + i, **MODES[mode]) for i in range(B)]
    plain_sampler = Sampler(params, V)
    head = FusedHead(Sampler(params, V), chunk=chunk, candidates=candidates)
    return (lambda h: plain_sampler(F.linear(h, W).float())), (lambda h: head(h, W))


@torch.no_grad()
def measure(W, hs: list, mode: str, chunk: int, candidates: int) -> dict:
    """Time both paths on hidden states hs (one (B, C) batch per rep, the first is the warmup)."""
    B = hs[0].shape[0]
    plain, fused = make_paths(W, B, mode, chunk, candidates)
    plain(hs[0]), fused(hs[0])  # warmup: first calls pay for allocator growth and lazy init
    t_plain, t_fused, fallback, same = [], [], [], []
    for rep, h in enumerate(hs[1:]):
        out = {}
        for name in ("plain", "fused")[:: 1 if rep % 2 == 0 else -1]:  # alternate which goes first
            t0 = time.perf_counter()
            out[name] = (plain if name == "plain" else fused)(h)
            (t_plain if name == "plain" else t_fused).append(time.perf_counter() - t0)
        fallback.append(out["fused"].fallback.float().mean().item())
        same.append(torch.equal(out["plain"], out["fused"].tokens))
    ms = lambda ts: [1e3 * t for t in ts]  # noqa: E731
    row = {"plain_ms": 1e3 * statistics.mean(t_plain), "fused_ms": 1e3 * statistics.mean(t_fused),
           "plain_median_ms": 1e3 * statistics.median(t_plain), "fused_median_ms": 1e3 * statistics.median(t_fused),
           "plain_samples_ms": ms(t_plain), "fused_samples_ms": ms(t_fused),
           "fallback_fraction": statistics.mean(fallback)}
    # Means, not medians: a step that falls back costs what it costs, and steps add up.
    row["speedup"] = row["plain_ms"] / row["fused_ms"]
    # Each rep times the two back to back on the same hidden states, so a burst of load from
    # elsewhere hits both: the median of the per-rep ratios is the steadier number.
    row["speedup_paired"] = statistics.median(p / f for p, f in zip(t_plain, t_fused, strict=True))
    # Greedy: both paths saw the same h, so the tokens must be the same (the engine's promise).
    row["same_tokens"] = all(same) if mode == "greedy" else None
    plain, fused = make_paths(W, B, mode, chunk, candidates)  # fresh state: lazy buffers count
    row["plain_peak_bytes"] = peak_bytes(lambda: plain(hs[0]))
    row["fused_peak_bytes"] = peak_bytes(lambda: fused(hs[0]))
    return row


# The engine's modes: "model defaults" is what generation_config.json asks for (T 0.7, top-p 0.95).
ENGINE_MODES = {"greedy": MODES["greedy"], "top_p": MODES["top_p"], "model defaults": {}}
VARIANTS = {"plain": False, "fused": True, "auto": "auto"}


def engine_rows(modes: list[str], batches: list[int], reps: int, new_tokens: int) -> list[dict]:
    """Decode tokens/s of the bundled model with each fused_head setting, interleaved; medians."""
    import sluice

    llms = {name: sluice.LLM(fused_head=v) for name, v in VARIANTS.items()}
    source = Path(sluice.llm.__file__).read_text()  # a fixed prompt: the LLM facade's own source
    prompt = llms["plain"].tokenizer.encode(source)[:200]
    rows = []
    for mode in modes:
        for B in batches:
            params = [sluice.SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=s, **ENGINE_MODES[mode])
                      for s in range(B)]
            rates, fallback, auto_fused = {name: [] for name in VARIANTS}, [], []
            for rep in range(reps + 1):  # rep 0 is the warmup
                for name in list(VARIANTS)[:: 1 if rep % 2 == 0 else -1]:
                    llms[name].generate([prompt] * B, params)
                    stats = llms[name].last_stats
                    if rep:
                        rates[name].append(stats.decode_tok_s)
                        if name == "fused":
                            fallback.append(stats.fallback_rate)
                        if name == "auto":  # tokens auto sampled on the fused head, of all it sampled
                            auto_fused.append(stats.fused_head_steps / new_tokens)
            row = {"row": f"bundled B={B} {mode}", "batch": B, "mode": mode, "new_tokens": new_tokens,
                   "fallback_fraction": statistics.mean(fallback), "auto_fused_fraction": statistics.mean(auto_fused)}
            for name, r in rates.items():
                row[f"{name}_tok_s"], row[f"{name}_samples"] = statistics.median(r), r
            row["speedup"] = row["fused_tok_s"] / row["plain_tok_s"]
            row["auto_speedup"] = row["auto_tok_s"] / row["plain_tok_s"]
            print(f"{row['row']}: plain {row['plain_tok_s']:.1f} tok/s, fused {row['fused_tok_s']:.1f} tok/s, "
                  f"auto {row['auto_tok_s']:.1f} tok/s, fallback {row['fallback_fraction']:.2f}", flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write results here as JSON")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="greedy,top_p", help=f"comma-separated subset of {list(MODES)}")
    ap.add_argument("--logit-std", type=float, default=5.0)
    ap.add_argument("--chunk", type=int, default=None, help="fused_head.CHUNK if not given")
    ap.add_argument("--candidates", type=int, default=None, help="fused_head.CANDIDATES if not given")
    ap.add_argument("--engine", action="store_true", help="whole generations with the bundled model instead")
    ap.add_argument("--new-tokens", type=int, default=64, help="per generation, with --engine")
    ap.add_argument("--engine-batch", default="1,8", help="batch sizes, with --engine")
    ap.add_argument("--engine-modes", default=",".join(ENGINE_MODES), help=f"with --engine: {list(ENGINE_MODES)}")
    ap.add_argument("--quick", action="store_true", help="one tiny shape, batch 1 and 4, 1 rep: a smoke test")
    args = ap.parse_args(argv)
    if args.engine:
        return main_engine(args)
    from sluice.engine import fused_head

    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    batches = [int(b) for b in args.batch.split(",")]
    chunk = args.chunk or fused_head.CHUNK
    candidates = args.candidates or fused_head.CANDIDATES
    if args.quick:
        shapes, batches, args.reps, chunk = QUICK_SHAPES, [1, 4], 1, 1024
    modes = args.modes.split(",")
    rows = []
    t_start = time.perf_counter()
    for shape, (C, V) in shapes.items():
        g = torch.Generator().manual_seed(0)
        W32 = torch.randn(V, C, generator=g) / C ** 0.5  # (V, C): logits ~ N(0, |h|^2 / C)
        for dtype in args.dtypes.split(","):
            W = W32.to(getattr(torch, dtype))
            for B in batches:
                # (B, C) hidden states, new ones for every rep: how often top-p falls back varies
                # from one distribution to the next, so one batch of B = 1 would be one coin flip.
                hs = [(torch.randn(B, C, generator=g) * args.logit_std).to(W.dtype) for _ in range(args.reps + 1)]
                for mode in modes:
                    r = measure(W, hs, mode, chunk, candidates)
                    r.update(row=f"{shape} B={B} {dtype} {mode}", shape=shape, hidden=C, vocab=V, batch=B,
                             dtype=dtype, mode=mode, loadavg_1min=loadavg()[0])
                    rows.append(r)
                    print(f"{r['row']}: plain {r['plain_ms']:.1f} ms, fused {r['fused_ms']:.1f} ms, "
                          f"fallback {r['fallback_fraction']:.2f} ({time.perf_counter() - t_start:.0f} s)", flush=True)
            del W
    load = loadavg()
    result = {"benchmark": "fused_head", "quick": args.quick, "reps": args.reps, "chunk": chunk,
              "candidates": candidates, "logit_std": args.logit_std, "top_p": MODES["top_p"]["top_p"],
              "loadavg_end": load, **environment(), "rows": rows}
    print_table(result)
    save_json(args.json, result)
    return result


def main_engine(args) -> dict:
    batches = [1, 2] if args.quick else [int(b) for b in args.engine_batch.split(",")]
    reps, new = (1, 8) if args.quick else (args.reps, args.new_tokens)
    rows = engine_rows(args.engine_modes.split(","), batches, reps, new)
    result = {"benchmark": "fused_head_engine", "quick": args.quick, "reps": reps, **environment(), "rows": rows}
    print(f"\n### The engine, bundled model: decode tokens/s, median of {reps}, {new} new tokens"
          f"{' (QUICK: smoke test only)' if args.quick else ''}\n")
    print("| row | plain tok/s | fused tok/s | fused / plain | fallback rows (fused) | auto tok/s | auto / plain "
          "| tokens auto took fused |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['row']} | {x['plain_tok_s']:.1f} | {x['fused_tok_s']:.1f} | {x['speedup']:.2f}x "
              f"| {100 * x['fallback_fraction']:.0f}% | {x['auto_tok_s']:.1f} | {x['auto_speedup']:.2f}x "
              f"| {100 * x['auto_fused_fraction']:.0f}% |")
    save_json(args.json, result)
    return result


def print_table(r: dict) -> None:
    cpu = r["cpu"]
    print(f"\n### LM head + sampling, plain vs fused: mean of {r['reps']} steps, chunk {r['chunk']}, "
          f"{r['candidates']} candidates, logit std {r['logit_std']}"
          f"{' (QUICK: smoke test only)' if r['quick'] else ''}\n")
    print(f"CPU: {cpu.get('model', '?')}, {cpu.get('torch_threads')} torch threads, AVX2: {cpu.get('avx2')}, "
          f"AVX-512 bf16: {cpu.get('avx512_bf16')}, AMX bf16: {cpu.get('amx_bf16')}; "
          f"load average at the end {' '.join(map(str, r['loadavg_end']))}\n")
    print("| row | plain ms | fused ms | plain / fused | median step ratio | plain peak MiB | fused peak MiB "
          "| fallback rows | greedy tokens equal | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for x in r["rows"]:
        same = {True: "yes", False: "**no**", None: "-"}[x["same_tokens"]]
        print(f"| {x['row']} | {x['plain_ms']:.1f} | {x['fused_ms']:.1f} | {x['speedup']:.2f}x "
              f"| {x['speedup_paired']:.2f}x "
              f"| {x['plain_peak_bytes'] / 2**20:.1f} | {x['fused_peak_bytes'] / 2**20:.1f} "
              f"| {100 * x['fallback_fraction']:.0f}% | {same} | {x['loadavg_1min']:.1f} |")


if __name__ == "__main__":
    main()
