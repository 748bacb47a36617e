"""Which part of each tensor a rank keeps (Megatron-style tensor parallelism), as pure functions.

For N ranks, rank r keeps:
  q, k, v (and their biases)   column-parallel: its heads' output rows
  o                            row-parallel: the input columns of its heads; one all-reduce after
  gate, up (and biases)        column-parallel: rows r*I/N .. (r+1)*I/N of the intermediate size
  down                         row-parallel: the matching input columns; one all-reduce after
  embed, lm_head               vocabulary-parallel: rows r*V/N .. (r+1)*V/N (tied or not)
  norms, o/down biases, pos    replicated (biases of row-parallel layers are added once, after the reduce)
  full-width q/k norm gains    like q's / k's rows (OLMo 2; its sum of squares is all-reduced, layers.py)
Fused q|k|v checkpoints (GPT-2, NeoX) get the same slices of q, k and v; weights.py cuts them from
the fused tensor after splitting it as for one process.
With fewer KV heads than ranks (GQA), each KV head is replicated on the N/K ranks whose query heads
use it, so every rank's query heads still meet the KV head they were trained with.
"""

from __future__ import annotations

import re

from ..errors import ConfigError
from ..model.config import ModelConfig


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Raise ConfigError naming the first reason `cfg` cannot be split over `world` ranks."""
    if not (isinstance(world, int) and world >= 1):
        raise ConfigError(f"the tensor-parallel size must be a positive integer, got {world!r}")
    for what, n in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size),
                    ("vocab_size", cfg.vocab_size)):
        if n % world:
            raise ConfigError(f"tensor parallelism over {world} ranks needs {what} ({n}) to be a multiple of "
                              f"{world}")
    K = cfg.num_kv_heads
    if K >= world and K % world:
        raise ConfigError(f"tensor parallelism over {world} ranks needs num_key_value_heads ({K}) to be a "
                          f"multiple of {world}")
    if K < world and world % K:
        raise ConfigError(f"with fewer KV heads than ranks, each KV head is replicated: {world} ranks need "
                          f"num_key_value_heads ({K}) to divide {world}")


def rank_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's part: its heads, KV heads, intermediate and vocabulary widths.
    Building sluice's own Transformer from it gives exactly the shapes that rank holds."""
    check_shardable(cfg, world)
    return cfg.replace(num_heads=cfg.num_heads // world, num_kv_heads=max(1, cfg.num_kv_heads // world),
                       intermediate_size=cfg.intermediate_size // world, vocab_size=cfg.vocab_size // world)


def kv_heads_of(cfg: ModelConfig, rank: int, world: int) -> range:
    """The global KV heads rank `rank` keeps: its own share, or the one head its query heads use."""
    K = cfg.num_kv_heads
    if K >= world:
        return range(rank * K // world, (rank + 1) * K // world)
    h = rank // (world // K)  # ranks r*N/K .. (r+1)*N/K - 1 hold the query heads of KV head r
    return range(h, h + 1)


def vocab_range(cfg: ModelConfig, rank: int, world: int) -> range:
    V = cfg.vocab_size // world
    return range(rank * V, (rank + 1) * V)


_LAYER = re.compile(r"layers\.\d+\.")


def slice_of(cfg: ModelConfig, rank: int, world: int, name: str) -> tuple | None:
    """The index (into the full tensor) of the part of sluice tensor `name` that `rank` keeps, or
    None when it keeps the whole tensor (replicated)."""
    D = cfg.head_dim
    heads = cfg.num_heads // world
    q_rows = slice(rank * heads * D, (rank + 1) * heads * D)
    kv = kv_heads_of(cfg, rank, world)
    kv_rows = slice(kv.start * D, kv.stop * D)
    inter = cfg.intermediate_size // world
    i_rows = slice(rank * inter, (rank + 1) * inter)
    v = vocab_range(cfg, rank, world)
    key = _LAYER.sub("layers.{i}.", name, count=1)
    table = {
        "layers.{i}.attn.q.weight": (q_rows,), "layers.{i}.attn.q.bias": (q_rows,),
        "layers.{i}.attn.k.weight": (kv_rows,), "layers.{i}.attn.k.bias": (kv_rows,),
        "layers.{i}.attn.v.weight": (kv_rows,), "layers.{i}.attn.v.bias": (kv_rows,),
        "layers.{i}.attn.o.weight": (slice(None), q_rows),
        "layers.{i}.mlp.gate.weight": (i_rows,), "layers.{i}.mlp.gate.bias": (i_rows,),
        "layers.{i}.mlp.up.weight": (i_rows,), "layers.{i}.mlp.up.bias": (i_rows,),
        "layers.{i}.mlp.down.weight": (slice(None), i_rows),
        # full-width qk-norm (OLMo 2): the gain of each channel lives with that channel's rows
        "layers.{i}.attn.q_norm.weight": (q_rows,) if cfg.qk_norm == "full" else None,
        "layers.{i}.attn.k_norm.weight": (kv_rows,) if cfg.qk_norm == "full" else None,
        "embed.weight": (slice(v.start, v.stop),), "lm_head.weight": (slice(v.start, v.stop),),
    }
    return table.get(key)
