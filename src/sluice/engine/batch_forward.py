"""One scheduler step's model work (scheduler.py): every 1-token row in one forward over the paged
KV pool, each prefill chunk in its own; the logits of the rows that reached their end come back.

The native step (fast_step.py) runs the model where it can (native_check says why not: hooks, an
unsupported family, kernels=False); that is decided once per busy period (refresh()), so hooks added
between requests take effect and a request never switches paths midway.
"""

from __future__ import annotations

import torch

from ..model.layers import Transformer
from .fast_step import FastStep, native_check
from .paged_cache import BlockPool, PagedView
from .sequence import Seq


class BatchForward:
    def __init__(self, model: Transformer, pool: BlockPool, native: bool = True):
        self.model, self.pool, self.native = model, pool, native
        self.device = model.embed.weight.device
        self.native_reason: str | None = None if native else "not asked for"  # why the torch forward runs
        self.fast: FastStep | None = None  # built at the first busy period that can use it
        self.use_fast = False  # for the current busy period

    def refresh(self) -> None:
        """Decide the path for a new busy period: the native step, or (native_reason says why) torch's."""
        if self.native:
            self.native_reason, self.fast = native_check(self.model, self.fast)
        self.use_fast = self.native and self.native_reason is None

    def logits_of(self, seqs: list[Seq], tokens: torch.Tensor, positions: torch.Tensor, final: bool):
        """tokens, positions (B, T) of `seqs` -> logits (B, V) at each row's last token (final), or None."""
        view = PagedView(self.pool, [s.blocks for s in seqs], self.device)
        T = tokens.shape[1]
        if self.use_fast:  # prefill too: 1.4-6x faster than torch's path on the bundled model (bench/prefill.py)
            if T == 1:
                return self.fast(tokens, positions, self.pool.k, self.pool.v, block_table=view.table)[:, -1]
            h = self.fast(tokens, positions, self.pool.k, self.pool.v, hidden=True, block_table=view.table)
            return self.model.logits(h[:, -1:].to(self.model.lm_head.weight.dtype))[:, 0] if final else None
        last = torch.full((len(seqs),), T - 1, device=self.device)
        out = self.model(tokens, positions, view, logits_at=last if final else None, return_hidden=not final)
        return out[:, 0] if final else None

    def __call__(self, batch: list[tuple[Seq, int]]) -> torch.Tensor | None:
        """Compute each (seq, n): its next n tokens. Returns logits (N, V) of the sequences whose
        computed tokens reached their end, in batch order, or None if none did."""
        dev, rows = self.device, []
        decodes = [s for s, n in batch if n == 1]
        if decodes:
            tokens = torch.tensor([[s.ids[s.num_computed]] for s in decodes], device=dev)
            positions = torch.tensor([[s.num_computed] for s in decodes], device=dev)
            out = self.logits_of(decodes, tokens, positions, True)
            for s in decodes:
                s.num_computed += 1
            if len(decodes) == len(batch) and all(s.num_computed == len(s.ids) for s in decodes):
                return out  # the usual decode step: every row, in batch order, no copy
            # a 1-token prefill chunk rides with the decodes; only rows at their end are sampled
            rows += [(s, o) for s, o in zip(decodes, out, strict=True) if s.num_computed == len(s.ids)]
        for s, n in batch:
            if n == 1:
                continue
            start = s.num_computed
            tokens = torch.tensor([s.ids[start:start + n]], device=dev)
            positions = torch.arange(start, start + n, device=dev)[None]
            s.num_computed += n
            final = s.num_computed == len(s.ids)
            out = self.logits_of([s], tokens, positions, final)
            if final:
                rows.append((s, out[0]))
        order = {s.id: i for i, (s, _) in enumerate(batch)}
        rows.sort(key=lambda r: order[r[0].id])
        return torch.stack([r for _, r in rows]) if rows else None
