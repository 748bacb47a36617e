"""`sluice profile`: where one decode step's time goes, by component, with the bytes it must read.

path="native" (profile_native.py) times the native step the engine ships with its own phase counters;
the default, path="torch", is described here. The step is the engine's own: Runner.step (eager) for one new token at batch 1 against a KVCache of
exactly `context` slots (filled with random keys and values: the cost of a step does not depend on
what the cache holds), then the Sampler on its logits. Every context length is measured alone.

Method: timed regions from forward pre-hooks and hooks registered from outside (ARCHITECTURE.md,
house rule "measurement attaches from outside").
A hook costs a few microseconds, so hooks are never nested: each *pass* times one level of the
module tree, and a parent's own work is its region minus its children's regions from the next pass.

    step   no hooks: the whole step (model + sampler), the reference the components must add up to
    top    embedding, each block, final norm, LM head; and the model call as a whole
    block  inside each block: its norms, attention, MLP
    attn   inside each attention: q/k/v/o projections, q/k norms

    attention = block.attention - (attn.qkv + attn.o + attn.qk norms)   RoPE, cache write, SDPA
    other     = top.model - top.(embedding + final norm + LM head) - block.(norms + attention + MLP)
                residual adds, RoPE tables, mask, glue (and the top pass's own hook calls)

The passes run round-robin (step top block attn, top block attn step, ...) so drift and background
load hit all of them alike; each number is the median over rounds of a per-step mean. The sum of
the components is top.model + sampling and is compared with the step pass, measured separately.
On this CPU every op runs synchronously, so a region's wall time is that region's compute time.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time

import torch
from torch import nn

from ..engine.gemv import cpu_flags, cpu_info
from ..engine.kv_cache import KVCache
from ..engine.kv_cache import kv_cache_dtype as kv_dtype_of
from ..engine.mixed import activation_dtype
from ..engine.runner import Runner
from ..engine.sampling import Sampler, SamplingParams
from ..errors import ObservatoryError
from . import machine
from .disturbance import REPEATS, watched
from .costs import COMPONENTS, kv_cache_bytes, step_costs, totals
from .profile_native import measure_native, native_reason
from .roofline import predict

PASSES = ("step", "top", "block", "attn")
MEMORY_MARGIN = 0.8  # refuse a context whose cache + temporaries exceed this fraction of free memory


def _groups(model) -> dict[str, list[tuple[str, nn.Module]]]:
    """pass -> [(label, module)] to time in that pass; no module in one pass contains another."""
    top = [("embedding", model.embed), ("embedding", model.pos_embed), ("final_norm", model.final_norm),
           ("lm_head", model.lm_head)] + [("block", b) for b in model.layers]
    block, attn = [], []
    for b in model.layers:
        block += [("norms", b.attn_norm), ("norms", b.attn_post_norm), ("norms", b.mlp_norm),
                  ("norms", b.mlp_post_norm), ("attention", b.attn), ("mlp", b.mlp)]
        a = b.attn
        attn += [("qkv_proj", a.q), ("qkv_proj", a.k), ("qkv_proj", a.v), ("o_proj", a.o),
                 ("qk_norms", a.q_norm), ("qk_norms", a.k_norm)]
    groups = {"step": [], "top": top, "block": block, "attn": attn}
    return {p: [(label, m) for label, m in g if m is not None] for p, g in groups.items()}


def _attach(pairs: list[tuple[str, nn.Module]], acc: dict[str, float]) -> list:
    """Add each module's forward wall time to acc[label]; returns the hook handles."""
    handles = []
    for label, module in pairs:
        start = [0.0]

        def pre(mod, args, start=start):
            start[0] = time.perf_counter()

        def post(mod, args, out, start=start, label=label):
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - start[0]
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def check_memory(cfg, context: int, dtype: torch.dtype, available: int | None) -> int:
    """Bytes the context needs (cache + one layer's attention temporaries); refuse if they cannot fit."""
    cache = kv_cache_bytes(cfg, 1, context, dtype)
    # SDPA with grouped heads (and the soft-capped path) may expand one layer's K and V to every
    # query head, and the soft-capped path materialises fp32 scores.
    temporaries = 2 * cfg.num_heads * context * cfg.head_dim * dtype.itemsize + 3 * cfg.num_heads * context * 4
    need = cache + temporaries
    if available is not None and need > MEMORY_MARGIN * available:
        raise ObservatoryError(
            f"context {context:,} needs a {cache / 1e9:.2f} GB KV cache (+{temporaries / 1e9:.2f} GB of attention "
            f"temporaries) but only {available / 1e9:.2f} GB of memory is available; pass smaller --contexts")
    return need


def plan_contexts(contexts: list[int], limit: int) -> tuple[list[int], list[str]]:
    """Validated, clamped to the model's context, deduplicated in order; plus notes on any clamping."""
    out, notes = [], []
    for c in contexts:
        if isinstance(c, bool) or not isinstance(c, int) or c <= 0:
            raise ObservatoryError(f"a context length must be a positive integer, got {c!r}")
        if c > limit:
            notes.append(f"context {c:,} clamped to the model's max_position_embeddings ({limit:,})")
            c = limit
        if c not in out:
            out.append(c)
    return out, notes


class _Bench:
    """One context: the engine's runner and sampler over a filled cache, and the timed passes."""

    def __init__(self, model, context: int, params: SamplingParams, kv_dtype: torch.dtype | None = None):
        cfg = model.config
        dtype = kv_dtype or activation_dtype(model)
        self.runner = Runner(model, compile=False)
        self.runner.cache = KVCache(cfg, 1, context, dtype)
        gen = torch.Generator().manual_seed(0)
        for t in (self.runner.cache.k, self.runner.cache.v):
            for layer in t:  # one layer at a time: no full-size fp32 temporary
                layer.normal_(generator=gen)
        self.runner.pos = torch.tensor([context - 1])
        self.sampler = Sampler([params], cfg.vocab_size)
        self.token = torch.tensor([1])
        self.context = context
        self.groups = _groups(model)

    @torch.inference_mode()
    def step(self, acc: dict[str, float]) -> None:
        self.runner.pos.fill_(self.context - 1)  # the same position every time: the same work
        t0 = time.perf_counter()
        logits = self.runner.step(self.token)
        t1 = time.perf_counter()
        self.sampler(logits)
        t2 = time.perf_counter()
        acc["model"] = acc.get("model", 0.0) + t1 - t0
        acc["sampling"] = acc.get("sampling", 0.0) + t2 - t1

    def sample(self, pass_name: str, n: int) -> dict[str, float]:
        """Per-step mean seconds of each region over n steps with `pass_name`'s hooks attached."""
        acc: dict[str, float] = {}
        handles = _attach(self.groups[pass_name], acc)
        try:
            for _ in range(n):
                self.step(acc)
        finally:
            for h in handles:
                h.remove()
        return {k: v / n for k, v in acc.items()}


def _components(med: dict[str, dict[str, float]]) -> dict[str, float]:
    """Seconds per component from the per-pass medians (see the module docstring)."""
    top, block, attn = med["top"], med["block"], med["attn"]
    g = lambda d, k: d.get(k, 0.0)  # noqa: E731 - a family may lack a region (no final norm)
    comp = {
        "embedding": g(top, "embedding"),
        "norms": g(block, "norms") + g(attn, "qk_norms"),
        "qkv_proj": g(attn, "qkv_proj"),
        "o_proj": g(attn, "o_proj"),
        "attention": g(block, "attention") - g(attn, "qkv_proj") - g(attn, "o_proj") - g(attn, "qk_norms"),
        "mlp": g(block, "mlp"),
        "final_norm": g(top, "final_norm"),
        "lm_head": g(top, "lm_head"),
        "sampling": g(med["step"], "sampling"),
    }
    comp["other"] = (top["model"] - g(top, "embedding") - g(top, "final_norm") - g(top, "lm_head")
                     - g(block, "norms") - g(block, "attention") - g(block, "mlp"))
    return comp


def measure_context(model, context: int, reps: int, params: SamplingParams, min_sample_s: float,
                    kv_dtype: torch.dtype | None = None) -> dict:
    """Median seconds per region of each pass over `reps` round-robin rounds, and the components."""
    bench = _Bench(model, context, params, kv_dtype)
    for p in PASSES:  # warm-up: allocator, lazy init, the first hooked call of each module
        bench.sample(p, 1)
    once = bench.sample("step", 1)
    n = max(1, math.ceil(min_sample_s / max(once["model"] + once["sampling"], 1e-6)))
    samples: dict[str, list[dict]] = {p: [] for p in PASSES}
    gc_was_on = gc.isenabled()
    gc.disable()  # a collection inside one sample would be charged to one region
    try:
        for r in range(reps):
            for p in PASSES[r % len(PASSES):] + PASSES[:r % len(PASSES)]:
                samples[p].append(bench.sample(p, n))
    finally:
        if gc_was_on:
            gc.enable()
    med = {p: {k: statistics.median(s[k] for s in rows) for k in rows[0]} for p, rows in samples.items()}
    step_s = [s["model"] + s["sampling"] for s in samples["step"]]
    del bench
    gc.collect()
    return {"steps_per_sample": n, "medians": med, "components": _components(med),
            "step_s": statistics.median(step_s), "step_s_samples": step_s}


PATHS = ("torch", "native")


def profile(model, contexts: list[int], reps: int = 15, params: SamplingParams | None = None,
            min_sample_s: float = 0.05, hardware: dict | None = None, progress=None, path: str = "torch",
            repeat_disturbed: int = REPEATS, kv_cache_dtype: str = "auto") -> dict:
    """The decode-step breakdown of `model` at each context length (see the module docstring). path="native":
    the native step the engine runs, timed by its own phase counters (profile_native.py).

    Each context is one round under a LoadWatch (disturbance.py): a round that other work disturbed
    (load, busy processes, steal) is measured again up to `repeat_disturbed` times, and one still
    disturbed is kept but marked, in its row ("disturbed", "load"), at the top ("disturbed") and in
    a note that the tables and the report show."""
    if path not in PATHS:
        raise ObservatoryError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if path == "native" and (why := native_reason(model)) is not None:
        raise ObservatoryError(f"the native step cannot run this model ({why}); profile the torch path")
    measure = measure_native if path == "native" else measure_context
    cfg = model.config
    dtype, act = model.embed.weight.dtype, activation_dtype(model)  # fp32 activations over bf16 weights: mixed.py
    kv = kv_dtype_of(kv_cache_dtype, act)  # the cache: LLM(kv_cache_dtype=)'s, the activations' by default
    if not (isinstance(reps, int) and not isinstance(reps, bool) and reps >= 1):
        raise ObservatoryError(f"reps must be an integer >= 1, got {reps!r}")
    contexts, notes = plan_contexts(list(contexts), cfg.max_position_embeddings)
    available = machine.available_memory()
    for c in contexts:  # all refused before any time is spent
        check_memory(cfg, c, kv, available)
    params = (params or SamplingParams(temperature=1.0, seed=0)).with_defaults(None)
    load_start = os.getloadavg()[0]
    hw_load = None
    if hardware is None:  # the peaks divide every "of peak" share: measured under the same watch
        hw, hw_load = watched(lambda: machine.measure(dtype), repeat_disturbed)
    else:
        hw = hardware
    peak_bw, peak_flops = hw["stream_copy"]["GB_s"] * 1e9, hw["matmul"]["GFLOP_s"] * 1e9
    rows = []
    for c in contexts:
        t0 = time.perf_counter()
        m, load = watched(lambda: measure(model, c, reps, params, min_sample_s, kv), repeat_disturbed)
        costs = step_costs(cfg, 1, c, dtype, act, kv)
        tot = totals(costs)
        comp_s, step_s = m["components"], m["step_s"]
        sum_s = sum(comp_s.values())
        comps = {k: {"ms": comp_s[k] * 1e3, "share": comp_s[k] / sum_s, **costs[k],
                     "GB_s": costs[k]["read_bytes"] / comp_s[k] / 1e9 if comp_s[k] > 0 else None}
                 for k in COMPONENTS}
        pred = predict(costs, peak_bw, peak_flops, batch=1)
        rows.append({
            "context": c, "cache_slots": c, "kv_cache_bytes": costs["attention"]["read_bytes"],
            "steps_per_sample": m["steps_per_sample"], "reps": reps,
            "step_ms": step_s * 1e3, "step_ms_samples": [s * 1e3 for s in m["step_s_samples"]],
            "components_sum_ms": sum_s * 1e3, "sum_vs_step": sum_s / step_s - 1,
            "tokens_per_s": 1 / step_s, "components": comps, "read_bytes": tot["read_bytes"],
            "flops": tot["flops"], "achieved_GB_s": tot["read_bytes"] / step_s / 1e9,
            "fraction_of_peak_bandwidth": tot["read_bytes"] / step_s / peak_bw,
            "lm_head_softmax_share": comps["lm_head"]["share"] + comps["sampling"]["share"],
            "kv_time_share": comps["attention"]["share"],
            "kv_bytes_share": costs["attention"]["read_bytes"] / tot["read_bytes"],
            "predicted": pred, "prediction_error": pred["tokens_per_s"] / (1 / step_s) - 1,
            "passes_ms": {p: {k: v * 1e3 for k, v in d.items()} for p, d in m["medians"].items()},
            "seconds": time.perf_counter() - t0,
            # the machine may be shared: a 1-minute load above the core count means the numbers are not clean
            "loadavg_1min_after": os.getloadavg()[0],
            "disturbed": load["disturbed"], "load": load,
        })
        if progress:
            progress(rows[-1])
    notes += disturbed_notes(rows, hw_load)
    name = getattr(model, "model_dir", None)
    return {
        "kind": "profile",
        "model": {"name": str(name) if name else "(in memory)", "architecture": cfg.architecture,
                  "dtype": str(dtype).removeprefix("torch."), "activation_dtype": str(act).removeprefix("torch."),
                  "kv_cache_dtype": str(kv).removeprefix("torch."),
                  "num_layers": cfg.num_layers,
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                  "max_position_embeddings": cfg.max_position_embeddings,
                  "param_bytes": sum(p.nbytes for p in model.parameters()),
                  "num_params": sum(p.numel() for p in model.parameters()),
                  "kv_bytes_per_token": kv_cache_bytes(cfg, 1, 1, kv)},
        "settings": {"contexts": contexts, "reps": reps, "min_sample_s": min_sample_s, "batch": 1,
                     "sampling": {"temperature": params.temperature, "top_k": params.top_k,
                                  "top_p": params.top_p, "min_p": params.min_p},
                     "threads": torch.get_num_threads(), "mode": "native" if path == "native" else "eager",
                     "path": path, "loadavg_at_start": load_start},
        "machine": hw, "cpu": cpu_info(), "cpu_flags": sorted(cpu_flags()),  # which kernels the step could choose
        "notes": notes, "rows": rows,
        "disturbed": any(r["disturbed"] for r in rows) or bool(hw_load and hw_load["disturbed"]),
        "machine_load": hw_load,
    }


def disturbed_notes(rows: list[dict], hw_load: dict | None) -> list[str]:
    """What a reader must know when other work shared the CPU: which rounds, why, after how many tries."""
    notes = []
    if hw_load and hw_load["disturbed"]:
        notes.append("DISTURBED: the machine's peak bandwidth and FLOP/s were measured while other work used the "
                     f"CPU ({'; '.join(hw_load['disturbed_reasons'])}): every 'of peak' share is suspect")
    bad = [r for r in rows if r["disturbed"]]
    if bad:
        why = "; ".join(bad[0]["load"]["disturbed_reasons"])
        contexts = ", ".join(f"{r['context']:,}" for r in bad)
        notes.append(f"DISTURBED: context {contexts} measured while other work "
                     f"used the CPU, still after {bad[0]['load']['attempts']} tries ({why}): those times and "
                     "shares are not clean; rerun on a quiet machine")
    return notes
