"""`sluice profile --path native`: where a decode step of the native step (engine/fast_step.py, step.cpp)
spends its time, the step the engine runs wherever a model can take it.

The torch path is measured with forward hooks (profile.py); the native step calls no module, so it times
itself instead: FastStep's counters, which step.cpp's thread 0 fills at each phase boundary (embedding,
norms, q/k/v with the qk-norms, RoPE and the cache writes, attention over the KV cache, o, MLP, final norm,
LM head), and most boundaries are barriers, so a phase's count is its wall time. The counters cost one
branch per boundary, so the whole step is timed in the same calls: "other" is what the call took beyond
the phases (the Python call, step.cpp's checks and scratch allocation), and the components add up to the
step by construction. Sampling is timed around the engine's Sampler, as on the torch path.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from ..engine.fast_step import PHASES, FastStep, unsupported
from ..engine.kv_cache import KVCache
from ..engine.sampling import Sampler, SamplingParams
from ..errors import ObservatoryError


def native_reason(model) -> str | None:
    """Why the native step cannot run `model` (then the profile takes the torch path), or None."""
    return unsupported(model)


class _NativeBench:
    """One context: the native step over a static cache of exactly `context` slots filled at random (a
    step's cost does not depend on what the cache holds), the token at the last slot, then the sampler."""

    def __init__(self, model, context: int, params: SamplingParams, kv_dtype: torch.dtype | None = None):
        why = unsupported(model)
        if why is not None:
            raise ObservatoryError(f"the native step cannot run this model ({why}); profile the torch path")
        cfg = model.config
        self.fast = FastStep(model)
        self.cache = KVCache(cfg, 1, context, kv_dtype or torch.float32)  # fp32 or bf16 (LLM(kv_cache_dtype=))
        gen = torch.Generator().manual_seed(0)
        for t in (self.cache.k, self.cache.v):
            for layer in t:  # one layer at a time, as profile.py fills its cache
                layer.normal_(generator=gen)
        self.sampler = Sampler([params], cfg.vocab_size)
        self.token, self.position = torch.tensor([[1]]), torch.tensor([[context - 1]])
        self.counters = FastStep.counters()

    @torch.inference_mode()
    def sample(self, n: int) -> dict[str, float]:
        """Per-step mean seconds of each phase, of the whole native call ("model") and of sampling, over n steps."""
        self.counters.zero_()
        model_s = sampling_s = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            logits = self.fast(self.token, self.position, self.cache.k, self.cache.v, counters=self.counters)[:, 0]
            t1 = time.perf_counter()
            self.sampler(logits)
            t2 = time.perf_counter()
            model_s, sampling_s = model_s + t1 - t0, sampling_s + t2 - t1
        out = dict(zip(PHASES, (self.counters / n).tolist(), strict=True))
        return {**out, "model": model_s / n, "sampling": sampling_s / n}


def measure_native(model, context: int, reps: int, params: SamplingParams, min_sample_s: float,
                   kv_dtype: torch.dtype | None = None) -> dict:
    """profile.measure_context's result for the native step: medians over `reps` samples, the components."""
    bench = _NativeBench(model, context, params, kv_dtype)
    once = bench.sample(1)  # warm-up: scratch, the sampler's first call
    n = max(1, math.ceil(min_sample_s / max(once["model"] + once["sampling"], 1e-6)))
    gc_was_on = gc.isenabled()
    gc.disable()  # a collection inside one sample would be charged to one phase
    try:
        rows = [bench.sample(n) for _ in range(reps)]
    finally:
        if gc_was_on:
            gc.enable()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    comp = {p: med[p] for p in PHASES}
    comp["sampling"] = med["sampling"]
    comp["other"] = med["model"] - sum(med[p] for p in PHASES)
    step_s = [r["model"] + r["sampling"] for r in rows]
    del bench
    gc.collect()
    # The step is the median call plus the median sampling, so the components (medians too) add up to it.
    return {"steps_per_sample": n, "medians": {"native": med}, "components": comp,
            "step_s": med["model"] + med["sampling"], "step_s_samples": step_s}
