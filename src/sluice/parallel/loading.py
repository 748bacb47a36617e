"""One rank's part of a checkpoint: sluice's own Transformer built on the rank's config, with o,
down, the embedding and the LM head swapped for their parallel forms (and OLMo 2's full-width q/k
norms for their distributed form), and filled with only this rank's slices of each tensor (sluice's
loader reads them with safetensors' get_slice; a fused q|k|v tensor, GPT-2's or NeoX's, is read
whole one layer at a time and cut after splitting).

The model's forward returns this rank's shard of the logits, (B, T, V/N) for the vocabulary ids
vocab_range(cfg, rank, world); parallel/sampling.py turns shards into tokens and log Z without
gathering them.
"""

from __future__ import annotations

import socket
from functools import partial
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..model.hub import resolve_model_dir
from ..model.hugepages import movable_bytes, move_to_huge_pages
from ..model.layers import Transformer
from ..model.loading import parse_device, parse_dtype
from ..model.weights import load_weights, plan_checkpoint
from . import group
from .layers import FullWidthRMSNorm, RowParallelLinear, VocabParallelEmbedding
from .sharding import rank_config, slice_of, vocab_range


def build_rank_model(cfg: ModelConfig, rank: int, world: int) -> Transformer:
    """The model of rank `rank`, on the meta device (no memory), ready for load_state_dict(assign=True)."""
    local = rank_config(cfg, world)
    with torch.device("meta"):
        model = Transformer(local)
        start = vocab_range(cfg, rank, world).start
        model.embed = VocabParallelEmbedding(local.vocab_size, local.hidden_size, start)
        for block in model.layers:
            o, down = block.attn.o, block.mlp.down
            block.attn.o = RowParallelLinear(o.in_features, o.out_features, bias=o.bias is not None)
            block.mlp.down = RowParallelLinear(down.in_features, down.out_features, bias=down.bias is not None)
            if cfg.qk_norm == "full":
                _full_width_qk_norm(block.attn, cfg, rank, world)
        model.tie_weights()
    model.full_config = cfg  # the whole model's config, for what needs the global sizes
    model.rank, model.world = rank, world
    return model


def _full_width_qk_norm(attn, cfg: ModelConfig, rank: int, world: int) -> None:
    """Swap OLMo 2's q/k norms (over all heads at once) for their distributed form. With KV heads
    replicated (K < N), the N/K ranks of one KV head hold the same k channels and only the first
    of them counts its sum of squares."""
    D, replicas = cfg.head_dim, max(1, world // cfg.num_kv_heads)
    for name, full, counted in (("q_norm", cfg.num_heads * D, True),
                                ("k_norm", cfg.num_kv_heads * D, rank % replicas == 0)):
        old = getattr(attn, name)
        setattr(attn, name, FullWidthRMSNorm(old.weight.shape[0], old.eps, full, counted, offset=old.offset,
                                             gain_in_fp32=old.gain_in_fp32))


def load_rank(path_or_repo_id: str | Path, ranks: group.Ranks, dtype="float32", device="cpu") -> Transformer:
    """This rank's part of the checkpoint, in eval mode. Every rank checks the whole checkpoint
    against its config (headers only) and that all ranks read the same one, before reading data."""
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    model_dir = resolve_model_dir(path_or_repo_id)
    cfg = ModelConfig.from_hf(model_dir)
    plan = plan_checkpoint(cfg, model_dir)  # the full checkpoint, so a bad file fails as it would unsharded
    group.check_same_checkpoint(model_dir)
    model = build_rank_model(cfg, ranks.rank, ranks.world)
    load_weights(model, model_dir, torch_dtype, dev, plan,
                 slices=partial(slice_of, cfg, ranks.rank, ranks.world))
    model.tie_weights()
    model.reset_rope(dev)
    model.model_dir = model_dir
    model.eval().requires_grad_(False)
    # This rank's slices into huge pages, as model/loading.load does for a whole model (model.huge_pages says what
    # moved, or why nothing did). The ranks on one machine move at the same time, so each checks the memory
    # available against all of theirs (every rank takes part in the gather; a rank off the CPU has nothing to move).
    mine = movable_bytes(model)
    host = socket.gethostname()
    others = sum(b for h, b in group.all_gather_object((host, mine)) if h == host) - mine
    model.huge_pages = move_to_huge_pages(model, others)
    return model


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters the model holds (a tied weight once; RoPE tables not counted)."""
    seen, total = set(), 0
    for t in model.parameters():
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
