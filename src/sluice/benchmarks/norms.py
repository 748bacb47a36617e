"""RMSNorm versus LayerNorm, measured: the claim is "RMSNorm saves 10-50% versus LayerNorm".

Part 1, the kernels alone: the forward time of one call on a (1, tokens, hidden) input, for

    rms           sluice RMSNorm(dim, eps): fp32 statistics, cast back, then the gain (Llama, Qwen)
    rms gemma     sluice RMSNorm(dim, eps, offset=1.0, gain_in_fp32=True): gain 1 + w, in fp32
    layer         sluice LayerNorm(dim, eps, bias=True), i.e. F.layer_norm (GPT-2, NeoX)
    F.rms_norm    torch's own, same weight (reference)
    F.layer_norm  torch's own, same weight and bias (reference: `layer` minus the module call)

eager and torch.compile'd (fullgraph, static shapes, one fresh compile per cell), fp32 and bf16.
The variants of a cell are timed round-robin, median of `reps` samples; saving = 1 - rms / layer
(positive: RMSNorm is faster). GB/s counts the bytes no norm can avoid: read x, write y.

The machine may be shared: each cell runs under a LoadWatch (observatory/disturbance.py) and is
measured once more when other work disturbed it; a cell still disturbed, and each decode
configuration measured under contention, is marked ("disturbed" in the JSON, a column and a
warning in the tables).

Part 2 (norm_share.py): the norms' share of a whole decode step on Qwen3-0.6B and Llama-3-8B shapes.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import BenchmarkError
from ..model.layers import LayerNorm, RMSNorm
from ..observatory.disturbance import watched
from .common import environment, median, time_interleaved

HIDDEN, TOKENS = (1024, 2048, 4096, 8192), (1, 16, 256, 4096)
QUICK_HIDDEN, QUICK_TOKENS = (1024, 4096), (1, 256)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
VARIANTS = ("rms", "rms gemma", "layer", "F.rms_norm", "F.layer_norm")
EPS = 1e-6
CELL_LOOK_S = 0.2  # the LoadWatch's look at the machine before each cell (many cells: keep it short)


def _ints(text: str | None, default: tuple[int, ...], flag: str) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise BenchmarkError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values:
        raise BenchmarkError(f"{flag} is empty")
    for v in values:
        if v <= 0:
            raise BenchmarkError(f"{flag} sizes must be positive, got {v}")
    return values


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value <= 0:
        raise BenchmarkError(f"{flag} must be positive, got {value}")


def settings(args) -> dict:
    """The checked, JSON-able settings of a run; bad input raises BenchmarkError before any work."""
    from .norm_share import SHAPES
    dtypes = []
    for name in (args.dtypes or "float32,bfloat16").split(","):
        name = name.strip()
        if name not in DTYPES:
            raise BenchmarkError(f"unknown dtype {name!r} in --dtypes (known: {', '.join(DTYPES)})")
        canonical = str(DTYPES[name]).removeprefix("torch.")
        if canonical not in dtypes:
            dtypes.append(canonical)
    models = [m.strip() for m in (args.models or ",".join(SHAPES)).split(",") if m.strip()]
    for m in models:
        if m not in SHAPES:
            raise BenchmarkError(f"unknown model {m!r} in --models (known: {', '.join(SHAPES)})")
    for value, flag in ((args.reps, "--reps"), (args.threads, "--threads"), (args.layers, "--layers"),
                        (args.kv_len, "--kv-len")):
        _positive(value, flag)
    if args.layers > SHAPES["llama-3-8b"]["num_layers"]:
        raise BenchmarkError(f"--layers is at most {SHAPES['llama-3-8b']['num_layers']} "
                             f"(Llama-3-8B's depth), got {args.layers}")
    if args.no_kernels and args.no_decode:
        raise BenchmarkError("--no-kernels and --no-decode together leave nothing to measure")
    if args.json and Path(args.json).is_dir():
        raise BenchmarkError(f"--json {args.json} is a directory; give a file path")
    quick = bool(args.quick)
    return {"quick": quick, "kernels": not args.no_kernels, "compile": not args.no_compile, "dtypes": dtypes,
            "hidden": list(_ints(args.hidden, QUICK_HIDDEN if quick else HIDDEN, "--hidden")),
            "tokens": list(_ints(args.tokens, QUICK_TOKENS if quick else TOKENS, "--tokens")),
            "reps": args.reps or (3 if quick else 15), "min_sample_s": 0.002 if quick else 0.01,
            "threads": args.threads, "models": [] if args.no_decode else models,
            "llama_layers": args.layers, "kv_len": args.kv_len, "decode_compile": bool(args.decode_compile)}


def make_norms(hidden: int, dtype: torch.dtype) -> dict:
    """The five variants, weights in `dtype` as a loaded model has them (values do not matter)."""
    rms = RMSNorm(hidden, EPS).to(dtype)
    gemma = RMSNorm(hidden, EPS, offset=1.0, gain_in_fp32=True).to(dtype)
    layer = LayerNorm(hidden, EPS, bias=True).to(dtype)
    w, b = layer.weight, layer.bias

    def torch_rms(x):
        return F.rms_norm(x, (hidden,), w, EPS)

    def torch_layer(x):
        return F.layer_norm(x, (hidden,), w, b, EPS)
    return {"rms": rms, "rms gemma": gemma, "layer": layer, "F.rms_norm": torch_rms, "F.layer_norm": torch_layer}


@torch.inference_mode()
def time_cell(dtype: str, hidden: int, tokens: int, compile: bool, reps: int, min_sample_s: float) -> dict:
    x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(0)).to(DTYPES[dtype])
    norms = make_norms(hidden, x.dtype)
    compile_s = None
    if compile:
        torch._dynamo.reset()  # a fresh compile per cell: no cache-size limit, no graph reused by accident
        norms = {k: torch.compile(f, fullgraph=True, dynamic=False) for k, f in norms.items()}
        t0 = time.perf_counter()
        for f in norms.values():
            f(x)
        compile_s = time.perf_counter() - t0
    samples, calls = time_interleaved({k: (lambda f=f: f(x)) for k, f in norms.items()}, reps, min_sample_s)
    us = {k: median(v) * 1e6 for k, v in samples.items()}
    io_bytes = 2 * x.nbytes  # read x, write y
    return {"dtype": dtype, "mode": "compile" if compile else "eager", "hidden": hidden, "tokens": tokens,
            "us": us, "us_min": {k: min(v) * 1e6 for k, v in samples.items()}, "rms_over_layer": us["rms"] / us["layer"], "saving": 1 - us["rms"] / us["layer"],
            "saving_gemma": 1 - us["rms gemma"] / us["layer"],
            "saving_torch": 1 - us["F.rms_norm"] / us["F.layer_norm"],
            "GB_s": {k: io_bytes / (t * 1e-6) / 1e9 for k, t in us.items()},
            "compile_s": compile_s, "calls_per_sample": calls,
            "samples_us": {k: [s * 1e6 for s in v] for k, v in samples.items()}}


def run(args) -> dict:
    s = settings(args)
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    env = environment()  # after set_num_threads, so the recorded count is the one used
    kernels, t_start = [], time.perf_counter()
    for compile in ([False] + ([True] if s["compile"] else [])) * s["kernels"]:
        for dtype in s["dtypes"]:
            for hidden in s["hidden"]:
                for tokens in s["tokens"]:
                    cell, load = watched(lambda: time_cell(dtype, hidden, tokens, compile, s["reps"],
                                                           s["min_sample_s"]), start_sample_s=CELL_LOOK_S)
                    kernels.append({**cell, "disturbed": load["disturbed"], "load": load})
                    print(f"kernels {SHORT[dtype]} {cell['mode']} hidden {hidden} tokens {tokens}: "
                          f"rms {cell['us']['rms']:.1f} us, layer {cell['us']['layer']:.1f} us "
                          f"[{time.perf_counter() - t_start:.0f} s]", file=sys.stderr, flush=True)
    decode = []
    if s["models"]:
        from .norm_share import measure
        decode = measure(s)
    disturbed = [f"kernels {SHORT[c['dtype']]} {c['mode']} hidden {c['hidden']} tokens {c['tokens']}"
                 for c in kernels if c["disturbed"]]
    disturbed += [f"decode {d['model']} {SHORT.get(d['dtype'], d['dtype'])} {d['mode']}" for d in decode if d.get("disturbed")]
    return {"benchmark": "norms", "quick": s["quick"], "settings": s, **env,
            "seconds": time.perf_counter() - t_start, "loadavg_at_end": list(os.getloadavg()),
            "disturbed": bool(disturbed), "disturbed_parts": disturbed, "kernels": kernels, "decode": decode}


# ------------------------------------------------------------------ tables
def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def print_tables(r: dict) -> None:
    cpu, code, s = r["cpu"], r["code"], r["settings"]
    quick = " (QUICK: smoke test, the numbers mean nothing)" if r["quick"] else ""
    print(f"\n### RMSNorm versus LayerNorm{quick}\n")
    if r.get("disturbed"):
        print(f"DISTURBED RUN (keep these numbers out of the docs): other work used the CPU during "
              f"{len(r['disturbed_parts'])} measurements, still after a repeat: {', '.join(r['disturbed_parts'])}. "
              "Their rows say so.\n")
    print(f"CPU: {cpu.get('model', '?')}, {cpu.get('logical_cpus', '?')} logical CPUs, "
          f"{r['torch_threads']} torch threads; AVX2 {cpu.get('avx2')}, AVX-512 {cpu.get('avx512f')}, "
          f"AVX-512 bf16 {cpu.get('avx512_bf16')}, AMX bf16 {cpu.get('amx_bf16')}. torch "
          f"{r['versions']['torch']}, sluice {code['commit']}"
          f"{' + uncommitted changes' if code['uncommitted_changes'] else ''}, {r['date']}.")
    if r["kernels"]:
        tokens = sorted({c["tokens"] for c in r["kernels"]})
        for key, what in (("us", "median"), ("us_min", "fastest sample")):
            print(f"\nSaving = 1 - RMSNorm / LayerNorm time (sluice modules), {what} of {s['reps']} "
                  f"samples per kernel; per token count the median over hidden {s['hidden']} "
                  f"[min .. max].\n")
            print("| row | " + " | ".join(f"tokens {t}" for t in tokens) + " |")
            print("|---|" + "---:|" * len(tokens))
            for dtype in s["dtypes"]:
                for mode in ("eager", "compile"):
                    cells = [c for c in r["kernels"] if c["dtype"] == dtype and c["mode"] == mode]
                    if not cells:
                        continue
                    out = []
                    for t in tokens:
                        sv = [1 - c[key]["rms"] / c[key]["layer"] for c in cells if c["tokens"] == t]
                        out.append(f"{_pct(statistics.median(sv))} [{_pct(min(sv))} .. {_pct(max(sv))}]")
                    print(f"| {SHORT[dtype]} {mode} | " + " | ".join(out) + " |")
        print("\n| row | hidden | tokens | rms us | rms gemma us | layer us | F.rms_norm us | F.layer_norm us "
              "| saving | saving (gemma) | saving (torch F.) | rms GB/s | layer GB/s | CPU shared? |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for c in r["kernels"]:
            us = c["us"]
            print(f"| {SHORT[c['dtype']]} {c['mode']} | {c['hidden']} | {c['tokens']} | "
                  + " | ".join(f"{us[v]:.1f}" for v in VARIANTS)
                  + f" | {_pct(c['saving'])} | {_pct(c['saving_gemma'])} | {_pct(c['saving_torch'])} "
                  f"| {c['GB_s']['rms']:.1f} | {c['GB_s']['layer']:.1f} "
                  f"| {'DISTURBED' if c.get('disturbed') else 'no'} |")
    if r["decode"]:
        from .norm_share import print_decode_tables
        print_decode_tables(r)
