"""The only code that runs the model during generation: one batched prefill, then decode steps.

The decode step has fixed shapes for a given batch: tokens (B, 1), positions (B, 1), a cache of
(B, S) slots. Rows that have finished keep stepping (their output is ignored) so shapes never
change mid-batch; with compile=True the step is traced once per (B, S) by torch.compile.
With hidden=True prefill and step return the final-normed hidden states (B, C) instead of the
logits, for the fused LM head + sampler (fused_head.py), which applies the head itself.
"""

from __future__ import annotations

import torch

from ..model.layers import Transformer
from .kv_cache import KVCache

SLOT_BUCKET = 64  # cache sizes are rounded up to this, so nearby request sizes share a compiled step


class Runner:
    def __init__(self, model: Transformer, compile: bool = False):
        self.model = model
        self.cache: KVCache | None = None
        self.pos: torch.Tensor | None = None  # (B,) next position to write, per row
        wrap = (lambda f: torch.compile(f, dynamic=False, fullgraph=True)) if compile else (lambda f: f)
        self._step, self._step_hidden = wrap(self._decode), wrap(self._decode_hidden)  # compiled on first use

    @staticmethod
    def slots_for(needed: int) -> int:
        return -(-needed // SLOT_BUCKET) * SLOT_BUCKET

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], num_slots: int, hidden: bool = False) -> torch.Tensor:
        """Run all prompts in one forward (right-padded); return each row's last logits (B, V)
        (or, with hidden=True, last final-normed hidden states (B, C))."""
        cfg = self.model.config
        dtype, dev = self.model.embed.weight.dtype, self.model.embed.weight.device
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids, lengths = ids.to(dev), torch.tensor([len(p) for p in prompts], device=dev)  # one copy each
        positions = torch.arange(T, device=dev).expand(B, T)  # padding sits at positions no real token sees
        self.cache = KVCache(cfg, B, num_slots, dtype, dev)
        out = self.model(ids, positions, self.cache, logits_at=lengths - 1, return_hidden=hidden)  # (B, 1, V|C)
        self.pos = lengths.clone()
        return out[:, 0]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        """tokens (B,) just sampled -> logits (B, V) for the next ones (hidden states (B, C) if hidden)."""
        pos = self.pos.clamp(max=self.cache.num_slots - 1)  # finished rows idle at the last slot
        out = (self._step_hidden if hidden else self._step)(tokens[:, None], pos[:, None], self.cache.k, self.cache.v)
        self.pos += 1
        return out

    def _decode(self, tokens, positions, k, v) -> torch.Tensor:
        # The cache comes in as arguments, not via self, so a compiled step is reused across batches.
        return self.model(tokens, positions, KVCache.wrap(k, v))[:, 0]  # (B, V)

    def _decode_hidden(self, tokens, positions, k, v) -> torch.Tensor:
        return self.model(tokens, positions, KVCache.wrap(k, v), return_hidden=True)[:, 0]  # (B, C)

    def release(self) -> None:
        self.cache = None
        self.pos = None
