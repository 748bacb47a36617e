"""Preallocated, static-shaped key/value cache.

One (B, K, S, D) tensor for keys and one for values per layer, allocated once per batch, so each
KV head's slots are contiguous (a decode step reads them in place). Slot s of row b holds the keys
of row b's token at position s, so writing is an index_put at the token's
position and nothing ever grows: the decode step keeps fixed shapes (compile-friendly) and the
attention mask is a pure function of positions (see Transformer.attention_mask).
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, batch_size: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, num_slots, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, K, S, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.batch_size = batch_size

    @classmethod
    def wrap(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """A cache over existing (L, B, K, S, D) tensors: lets a compiled step take them as inputs."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache.batch_size, cache.num_slots = k.shape[1], k.shape[3]
        return cache

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @staticmethod
    def nbytes_for(cfg: ModelConfig, batch_size: int, num_slots: int, dtype: torch.dtype) -> int:
        per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        return per_slot * batch_size * num_slots

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
