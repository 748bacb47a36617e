"""The greedy walk the quantized native-step tests share: the fast step and a reference model, each from the same
first tokens and caches, feed back their own argmax for `steps` tokens; the two token lists must agree."""

from __future__ import annotations

import torch


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
