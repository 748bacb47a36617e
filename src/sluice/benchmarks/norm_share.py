"""The norms' share of a whole decode step, on real model shapes (part 2 of `sluice bench norms`).

One model per (shape, dtype) with random weights, and views of it that share every weight tensor:
  rms    the model as built: RMSNorm everywhere (pre-attention, pre-MLP, final; Qwen3's per-head
         q/k norms too)
  layer  every RMSNorm swapped for LayerNorm(dim, eps, bias=True)
  none   every RMSNorm swapped for nn.Identity: the module call stays, the arithmetic goes
and a 0-layer twin of each (embedding, RoPE tables, mask, final norm, LM head: the "head"), so
per layer = (step - head) / layers and a model built with fewer layers than the real one (Llama-3-8B
in fp32 does not fit 24 GiB) extrapolates to full depth as head + depth x per layer.

A step is what Runner.step runs: 1 token at position kv_len against a KVCache of
Runner.slots_for(kv_len + 1) slots. The cache is filled with random keys and values instead of a
prefill (a step's cost does not depend on what the cache holds), and every step writes the same
slot, so shapes and work stay fixed. Views are timed round-robin; the measured share is the median
over rounds of (rms - none) / rms of the same round. The direct estimate adds up the isolated
(eager) time of every norm call the step makes, minus an nn.Identity call.
"""

from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
from collections import Counter

import torch
from torch import nn

from ..engine.kv_cache import KVCache
from ..engine.runner import Runner
from ..model.config import ModelConfig
from ..model.layers import LayerNorm, RMSNorm, Transformer
from ..observatory.disturbance import watched
from .common import median, time_interleaved

# config.json values of the two checkpoints (weights are random: speed does not depend on them).
SHAPES = {
    "qwen3-0.6b": {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rope_theta": 1e6, "norm_eps": 1e-6,
                   "qk_norm": "head", "tie_word_embeddings": True, "architecture": "Qwen3ForCausalLM"},
    "llama-3-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 8192, "rope_theta": 5e5, "norm_eps": 1e-5,
                   "qk_norm": None, "tie_word_embeddings": False, "architecture": "LlamaForCausalLM"},
}
QUICK_SHAPE = {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2,
               "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "max_position_embeddings": 1024}
VIEWS = ("rms", "layer", "none")


def build(shape: dict, dtype: torch.dtype) -> Transformer:
    """Random weights (normal 0.02, unit norm gains), built on meta and materialised once in dtype."""
    with torch.device("meta"):
        model = Transformer(ModelConfig(**shape))
    model = model.to(dtype).to_empty(device="cpu")
    model.tie_weights()
    model.reset_rope(torch.device("cpu"))
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    return model.eval().requires_grad_(False)


def share_weights(model: nn.Module) -> nn.Module:
    """A structural copy whose parameters and buffers are the very same tensors (no extra memory)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def view(model: Transformer, kind: str) -> Transformer:
    if kind == "rms":
        return model
    m = share_weights(model)
    dtype = model.embed.weight.dtype
    for name, mod in list(m.named_modules()):
        if isinstance(mod, RMSNorm):
            parent, _, attr = name.rpartition(".")
            new = nn.Identity() if kind == "none" else LayerNorm(mod.weight.shape[0], mod.eps, bias=True).to(dtype)
            setattr(m.get_submodule(parent), attr, new)
    return m.requires_grad_(False)


def head_only(model: Transformer) -> Transformer:
    m = share_weights(model)
    m.layers = nn.ModuleList()
    return m


def norm_calls(model: Transformer, step) -> Counter:
    """(dim, eps, input shape, "layers" or "final") -> calls per decode step, counted with
    pre-hooks on one eager step."""
    calls: Counter = Counter()

    def hook(mod, args):
        where = "final" if mod is model.final_norm else "layers"
        calls.update([(mod.weight.shape[0], mod.eps, tuple(args[0].shape), where)])
    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, RMSNorm)]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return calls


def direct_estimate(calls: Counter, dtype: torch.dtype, reps: int, min_sample_s: float) -> list[dict]:
    """Isolated eager time of each kind of norm call the step makes, next to LayerNorm and Identity."""
    rows = []
    for (dim, eps, shape, where), count in sorted(calls.items()):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        mods = {"rms": RMSNorm(dim, eps).to(dtype), "layer": LayerNorm(dim, eps, bias=True).to(dtype),
                "identity": nn.Identity()}
        samples, _ = time_interleaved({k: (lambda m=m, x=x: m(x)) for k, m in mods.items()}, reps, min_sample_s)
        rows.append({"dim": dim, "shape": list(shape), "where": where, "count": count,
                     **{f"{k}_us": median(v) * 1e6 for k, v in samples.items()}})
    return rows


def _steppers(views: dict, cache: KVCache, kv_len: int, compile: bool) -> dict:
    token = torch.tensor([1])
    steppers = {}
    for name, m in views.items():
        runner = Runner(m, compile=compile)
        runner.cache, runner.pos = cache, torch.tensor([kv_len])

        def step(runner=runner):
            runner.pos.fill_(kv_len)  # the same slot every time: fixed shapes, fixed work
            return runner.step(token)
        steppers[name] = step
    return steppers


@torch.inference_mode()
def measure_one(name: str, dtype_name: str, s: dict) -> list[dict]:
    dtype = getattr(torch, dtype_name)
    shape = dict(SHAPES[name], **(QUICK_SHAPE if s["quick"] else {}))
    full_depth = shape["num_layers"]
    if name == "llama-3-8b" and not s["quick"]:
        shape["num_layers"] = s["llama_layers"]
    layers, kv_len = shape["num_layers"], s["kv_len"]
    t0 = time.perf_counter()
    model = build(shape, dtype)
    print(f"decode {name} {dtype_name}: built {layers} layers in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    slots = Runner.slots_for(kv_len + 1)
    cache = KVCache(model.config, 1, slots, dtype)
    gen = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    views = {kind: view(model, kind) for kind in VIEWS}
    views.update({f"{kind} head": head_only(m) for kind, m in views.items()})

    eager = _steppers(views, cache, kv_len, compile=False)
    calls = norm_calls(model, eager["rms"])
    direct = direct_estimate(calls, dtype, s["reps"], s["min_sample_s"])
    finite = {k: bool(torch.isfinite(f()).all()) for k, f in eager.items()}
    results = []
    for compile in [False] + ([True] if s["decode_compile"] else []):
        steppers = eager
        compile_s = None
        if compile:
            torch._dynamo.reset()
            # Runner._decode is one code object for all six runners: let each keep its own graph.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            steppers = _steppers(views, cache, kv_len, compile=True)
            t0 = time.perf_counter()
            for f in steppers.values():
                f()
            compile_s = time.perf_counter() - t0
        samples, _ = time_interleaved(steppers, s["reps"], s["min_sample_s"])
        ms = {k: median(v) * 1e3 for k, v in samples.items()}
        rounds = [(a - b) / a for a, b in zip(samples["rms"], samples["none"])]
        per_layer = {k: (ms[k] - ms[f"{k} head"]) / layers for k in VIEWS}
        full = {k: ms[f"{k} head"] + full_depth * per_layer[k] for k in VIEWS}
        row = {"model": name, "dtype": dtype_name, "mode": "compile" if compile else "eager",
               "shape": shape, "layers": layers, "full_depth": full_depth, "kv_len": kv_len,
               "cache_slots": slots, "step_ms": {k: ms[k] for k in VIEWS},
               "head_ms": {k: ms[f"{k} head"] for k in VIEWS},
               "norm_share": statistics.median(rounds), "norm_share_rounds": rounds,
               # the least-disturbed sample of each view (this machine may be shared)
               "step_ms_min": {k: min(samples[k]) * 1e3 for k in VIEWS},
               "norm_share_min": 1 - min(samples["none"]) / min(samples["rms"]),
               "layer_vs_rms": ms["layer"] / ms["rms"],
               "per_layer_ms": per_layer, "per_layer_norm_ms": per_layer["rms"] - per_layer["none"],
               "per_layer_share": 1 - per_layer["none"] / per_layer["rms"],
               "full_depth_ms": full, "full_depth_share": 1 - full["none"] / full["rms"],
               "full_depth_layer_vs_rms": full["layer"] / full["rms"],
               "compile_s": compile_s, "logits_finite": finite,
               "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()}}
        if not compile:
            row["norm_calls"] = sum(calls.values())
            row["norm_call_kinds"] = direct
            row["direct_norm_ms"] = sum(d["count"] * (d["rms_us"] - d["identity_us"]) for d in direct) / 1e3
            row["direct_layer_ms"] = sum(d["count"] * (d["layer_us"] - d["identity_us"]) for d in direct) / 1e3
            row["direct_share"] = row["direct_norm_ms"] / ms["rms"]
            # The same per layer and at full depth: steadier than differences of whole-step medians.
            in_layers = sum(d["count"] * (d["rms_us"] - d["identity_us"]) for d in direct
                            if d["where"] == "layers") / 1e3
            row["direct_per_layer_ms"] = in_layers / layers
            row["direct_per_layer_share"] = in_layers / layers / per_layer["rms"]
            row["direct_full_depth_ms"] = row["direct_norm_ms"] + (full_depth - layers) * in_layers / layers
            row["direct_full_depth_share"] = row["direct_full_depth_ms"] / full["rms"]
        results.append(row)
        print(f"decode {name} {dtype_name} {row['mode']}: rms {ms['rms']:.1f} ms, layer {ms['layer']:.1f}, "
              f"none {ms['none']:.1f}; share {100 * row['norm_share']:.1f}%", file=sys.stderr, flush=True)
    return results


def measure(s: dict) -> list[dict]:
    rows = []
    for name in s["models"]:
        for dtype_name in s["dtypes"]:
            # decode configurations are long: marked when disturbed, not repeated
            got, load = watched(lambda: measure_one(name, dtype_name, s), repeats=0)
            rows += [{**row, "disturbed": load["disturbed"], "load": load} for row in got]
            gc.collect()  # the previous model's weights go before the next one is built
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def print_decode_tables(r: dict) -> None:
    short = {"float32": "fp32", "bfloat16": "bf16"}
    rows = r["decode"]
    kv = rows[0]["kv_len"]
    print(f"\nDecode step, batch 1, {kv} tokens in the KV cache, random weights; ms per token "
          f"(median of {r['settings']['reps']} round-robin samples). norm share: median over rounds of "
          f"(rms - none) / rms; share (min): 1 - fastest none / fastest rms; "
          f"direct = sum of isolated eager norm calls (minus an Identity call) / rms step.\n")
    print("| config | layers built | rms ms | layer ms | none ms | norm share | share (min) | layer / rms "
          "| norm calls | direct norm ms | direct share | logits finite |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for d in rows:
        st = d["step_ms"]
        direct = (f"{d['norm_calls']} | {d['direct_norm_ms']:.2f} | {100 * d['direct_share']:.1f}%"
                  if "direct_norm_ms" in d else "- | - | -")
        print(f"| {d['model']} {short[d['dtype']]} {d['mode']} | {d['layers']} of {d['full_depth']} "
              f"| {st['rms']:.1f} | {st['layer']:.1f} | {st['none']:.1f} | {100 * d['norm_share']:.1f}% "
              f"| {100 * d['norm_share_min']:.1f}% | {d['layer_vs_rms']:.3f}x | {direct} | {'yes' if all(d['logits_finite'].values()) else 'NO'} |")
    print("\nPer layer = (step - 0-layer head) / layers built; full depth = head + depth x per layer. "
          "Direct: the isolated norm calls inside the layers / per-layer time, and extrapolated.\n")
    print("| config | head ms (rms) | per-layer ms (rms) | per-layer norms ms | per-layer share "
          "| direct per-layer share | full-depth ms (rms) | full-depth norm share | direct full-depth share "
          "| full-depth layer / rms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d in rows:
        print(f"| {d['model']} {short[d['dtype']]} {d['mode']} | {d['head_ms']['rms']:.1f} "
              f"| {d['per_layer_ms']['rms']:.2f} | {d['per_layer_norm_ms']:.3f} "
              f"| {100 * d['per_layer_share']:.1f}% | {_pct(d.get('direct_per_layer_share'))} "
              f"| {d['full_depth_ms']['rms']:.1f} | {100 * d['full_depth_share']:.1f}% "
              f"| {_pct(d.get('direct_full_depth_share'))} | {d['full_depth_layer_vs_rms']:.3f}x |")
