"""A check the native step's product modes share: a token's numbers never depend on its batch or its chunk."""

import torch

from sluice.engine import fast_step
from sluice.engine.kv_cache import KVCache


def assert_same_numbers_in_any_chunk_and_batch(model, step, kv_dtype: torch.dtype = torch.float32) -> None:
    """Decode rows batched (3 and 8 rows) and each alone, and one row's tokens in chunks of 1, 2, 4, 1, 8, 3 and a
    chunk past MAX_CHUNK, and one at a time: bit for bit the same logits and cache (a model of vocabulary >= 50),
    over a cache of kv_dtype."""
    T, D = fast_step.MAX_CHUNK + 11, 12  # all tokens of one row; the first D of 8 rows
    tokens = torch.randint(0, 50, (8, T), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(T)[None]
    outs = []
    for cuts in ([0, 1, 3, 7, 8, 16, 19, T], [0, T], list(range(T + 1))):
        cache = KVCache(model.config, 1, 96, kv_dtype)
        with torch.inference_mode():
            outs.append((torch.cat([step(tokens[:1, a:b], positions[:, a:b], cache.k, cache.v)
                                    for a, b in zip(cuts, cuts[1:], strict=False)], 1), cache.k))
    for logits, k in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(k, outs[0][1])
    for B in (3, 8):
        cache = KVCache(model.config, B, 32, kv_dtype)
        with torch.inference_mode():
            batched = torch.cat([step(tokens[:B, t:t + 1], positions[:, t:t + 1].expand(B, 1), cache.k, cache.v)
                                 for t in range(D)], 1)
        for b in range(B):
            alone = KVCache(model.config, 1, 32, kv_dtype)
            with torch.inference_mode():
                one = torch.cat([step(tokens[b:b + 1, t:t + 1], positions[:, t:t + 1], alone.k, alone.v)
                                 for t in range(D)], 1)
            assert torch.equal(one, batched[b:b + 1]) and torch.equal(alone.k, cache.k[:, b:b + 1])
