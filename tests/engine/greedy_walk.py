"""What the quantized native-step tests share: the native step's caches after some prompts, and the greedy walk
(the fast step and a reference model, each from the same first tokens and caches, feed back their own argmax for
`steps` tokens; the two token lists must agree)."""

from __future__ import annotations

import torch

from sluice.engine.fast_step import FastStep
from sluice.engine.kv_cache import KVCache


def greedy_walks(step, ref, first, pos, cache, ref_cache, steps: int = 20) -> dict:
    tokens = {"fast": [], "ref": []}
    with torch.inference_mode():
        for key in tokens:
            last = first
            for i in range(steps):
                p = pos[:, None] + i
                out = step(last[:, None], p, cache.k, cache.v) if key == "fast" else ref(last[:, None], p, ref_cache)
                last = out[:, 0].argmax(-1)
                tokens[key].append(last.tolist())
    return tokens


def caches_after_prompts(model, prompts, copies: int, slots: int = 64, **step_kw):
    """The native step's cache (FastStep(model, **step_kw)) after `prompts`, one row at a time, and `copies` copies of
    it for the references (whose own prefill would round differently: not what is tested); the prompts' lengths."""
    cache = KVCache(model.config, len(prompts), slots)
    step = FastStep(model, **step_kw)
    for b, p in enumerate(prompts):
        with torch.inference_mode():
            step(torch.tensor([p]), torch.arange(len(p))[None], cache.k[:, b:b + 1], cache.v[:, b:b + 1])
    copied = [KVCache.wrap(cache.k.clone(), cache.v.clone()) for _ in range(copies)]
    return [cache, *copied], torch.tensor([len(p) for p in prompts])
