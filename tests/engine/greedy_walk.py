"""What the quantized native-step tests share: the native step's caches after some prompts, a chunk checked against
the rounded and the dequantized model, and the greedy walk
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


def check_chunk(model, exact, plain, prompts, T: int, model_bound: float, exact_bound: float, exact_upto: int = 3,
                **step_kw):
    """A chunk of T tokens a row after `prompts` through FastStep(model, **step_kw) against `plain` (the dequantized
    model: within model_bound of the largest logit) and `exact` (the model that rounds x as the step does: within
    exact_bound, caches too, on chunks of up to `exact_upto` tokens a row, where no rounding tie flips upstream).
    Returns what a test checks further: the step's cache, the chunk's tokens and positions, plain's logits and the
    scale."""
    (cache, exact_cache, plain_cache), pos = caches_after_prompts(model, prompts, 2, **step_kw)
    tokens = torch.randint(0, model.config.vocab_size, (len(prompts), T), generator=torch.Generator().manual_seed(1))
    positions = pos[:, None] + torch.arange(T)
    with torch.inference_mode():
        want = exact(tokens, positions, exact_cache)
        near = plain(tokens, positions, plain_cache)
        got = FastStep(model, **step_kw)(tokens, positions, cache.k, cache.v)
    scale = want.abs().max()
    assert (got - near).abs().max() <= model_bound * scale, f"{(got - near).abs().max() / scale:.2e} off the model"
    if T <= exact_upto:
        assert (got - want).abs().max() <= exact_bound * scale, \
            f"{(got - want).abs().max() / scale:.2e} off the rounded model"
        assert torch.allclose(cache.k, exact_cache.k, atol=1e-5) and torch.allclose(cache.v, exact_cache.v, atol=1e-5)
    return cache, tokens, positions, near, scale
