"""A fixed-batch model runner over a static KV cache: one batched prefill, then decode steps. Generation
no longer runs here (every request runs on the continuous-batching scheduler, batch_forward.py); it
stays as a measuring harness with fixed shapes: `sluice profile --path torch` times Runner.step,
bench/ and the norm-share benchmark run it, and tests compare the native step's static-cache layout
against it.

The decode step has fixed shapes for a given batch: tokens (B, 1), positions (B, 1), a cache of
(B, S) slots. Rows that have finished keep stepping (their output is ignored) so shapes never
change mid-batch; with compile=True the step is traced once per (B, S) by torch.compile.
With hidden=True prefill and step return the final-normed hidden states (B, C) instead of the
logits, for the fused LM head + sampler (fused_head.py), which applies the head itself.

Prefill's activations grow with rows x tokens x slots (the attention mask and scores are (T, S)
per row and head), so a big batch or a long prompt is run in several forwards over slices of rows
and, for one long row, of positions: each writes its keys into the shared cache, which is all a
later slice needs to see them. Small requests take a single forward, as before.
"""

from __future__ import annotations

import torch

from ..model.layers import Transformer
from .fast_step import FastStep, native_check
from .kv_cache import KVCache
from .mixed import activation_dtype, compile_forward

SLOT_BUCKET = 64  # cache sizes are rounded up to this, so nearby request sizes share a compiled step
PREFILL_BYTES = 1 << 30  # activations one prefill forward may hold; more rows/tokens go in another forward


def prefill_tokens_per_forward(cfg, num_slots: int, itemsize: int) -> int:
    """How many (row, position) tokens one prefill forward may take within PREFILL_BYTES: per token
    a bool mask row and fp32 attention scores over the slots (the worst case of SDPA with a mask),
    plus the MLP's and the attention's activations in the model dtype."""
    per_token = num_slots * (2 + 4 * cfg.num_heads) + itemsize * (
        3 * cfg.intermediate_size + 8 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    return max(1, PREFILL_BYTES // per_token)


class Runner:
    """native=True lets decode steps and verify chunks go to fast_step.FastStep (step.cpp: the whole
    forward in one native call) when the model can take it; checked at each prefill, since a hook
    attached to the model in between (the observatory's) needs the torch modules to run."""

    def __init__(self, model: Transformer, compile: bool = False, native: bool = False):
        self.model = model
        self.cache: KVCache | None = None
        self.pos: torch.Tensor | None = None  # (B,) next position to write, per row
        self.native = native and not compile
        self.native_reason: str | None = None if self.native else "not asked for"  # why the torch step runs
        self._fast: FastStep | None = None  # built on the first request that can use it
        self._use_fast = False  # for the current request
        wrap = ((lambda f: compile_forward(f, dynamic=False, fullgraph=True))
                if compile else (lambda f: f))
        self._step, self._step_hidden = wrap(self._decode), wrap(self._decode_hidden)  # compiled on first use

    @staticmethod
    def slots_for(needed: int) -> int:
        return -(-needed // SLOT_BUCKET) * SLOT_BUCKET

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], num_slots: int, hidden: bool = False) -> torch.Tensor:
        """Run all prompts (right-padded) into a new cache; return each row's last logits (B, V)
        (or, with hidden=True, last final-normed hidden states (B, C))."""
        cfg = self.model.config
        dtype, dev = activation_dtype(self.model), self.model.embed.weight.device
        B, T = len(prompts), max(len(p) for p in prompts)
        self.cache = KVCache(cfg, B, num_slots, dtype, dev)
        self._use_fast = self._native_ok()
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        budget = prefill_tokens_per_forward(cfg, num_slots, dtype.itemsize)
        rows_per = max(1, budget // T)  # whole prompts per forward; one row's positions split if need be
        span = T if rows_per > 1 else min(T, budget)
        outs = []  # (rows, V|C) per slice of rows
        for b0 in range(0, B, rows_per):
            b1 = min(B, b0 + rows_per)
            part = prompts[b0:b1]
            Tp = max(len(p) for p in part)
            ids = torch.zeros(b1 - b0, Tp, dtype=torch.long)
            for b, p in enumerate(part):
                ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
            ids = ids.to(dev)  # one copy
            cache = KVCache.wrap(self.cache.k[:, b0:b1], self.cache.v[:, b0:b1])  # views: writes land in self.cache
            for t0 in range(0, Tp, span):
                t1 = min(Tp, t0 + span)
                # padding sits at positions no real token sees
                positions = torch.arange(t0, t1, device=dev).expand(b1 - b0, t1 - t0)
                # The last forward of a slice holds each of its rows' last token (several rows: the only
                # forward; one row: its positions end there); earlier ones only fill the cache.
                final = t1 == Tp
                o = self.model(ids[:, t0:t1], positions, cache, logits_at=lengths[b0:b1] - 1 - t0 if final else None,
                               return_hidden=hidden or not final)
            outs.append(o[:, 0])
        self.pos = lengths.clone()
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        """tokens (B,) just sampled -> logits (B, V) for the next ones (hidden states (B, C) if hidden)."""
        pos = self.pos.clamp(max=self.cache.num_slots - 1)  # finished rows idle at the last slot
        if self._use_fast:
            out = self._fast(tokens[:, None], pos[:, None], self.cache.k, self.cache.v, hidden)[:, 0]
            self.pos += 1
            return out
        out = (self._step_hidden if hidden else self._step)(tokens[:, None], pos[:, None], self.cache.k, self.cache.v)
        self.pos += 1
        return out

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T): each row's next T tokens, run at positions pos .. pos+T-1 -> logits (B, T, V).

        For speculative decoding (speculative.py): one forward checks a row's proposed tokens. Their keys
        and values are written into the cache but pos is left alone: the caller keeps as many as it
        accepted (advance). Entries past the kept ones are stale but harmless: a query at position p sees
        slots <= p only, and the forward that next reaches a slot writes it before any query reads it.
        Positions past the cache (or the model's position table) are clamped onto its last slot, which
        only rows past their max_tokens reach: what they compute there is never emitted."""
        T = tokens.shape[1]
        last = min(self.cache.num_slots, self.model.config.max_position_embeddings) - 1
        positions = (self.pos[:, None] + torch.arange(T, device=self.pos.device)).clamp(max=last)  # (B, T)
        return self._forward_chunk(tokens, positions)

    def _forward_chunk(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions (B, T) -> logits (B, T, V), writing the cache. The one place verify() runs
        the model."""
        if self._use_fast:
            return self._fast(tokens, positions, self.cache.k, self.cache.v)
        return self.model(tokens, positions, self.cache)

    def _native_ok(self) -> bool:
        """Whether this request's steps can take the native step; builds it the first time."""
        if self.native:
            self.native_reason, self._fast = native_check(self.model, self._fast)
        return self.native and self.native_reason is None

    @torch.inference_mode()
    def advance(self, n) -> None:
        """Move each row's next position by n (an int or a (B,) tensor; negative rolls back)."""
        self.pos += n

    @torch.inference_mode()
    def seek(self, pos: torch.Tensor) -> None:
        """Set each row's next position (B,): a draft model rolls back to where the target stands."""
        self.pos = pos.clone()

    def _decode(self, tokens, positions, k, v) -> torch.Tensor:
        # The cache comes in as arguments, not via self, so a compiled step is reused across batches.
        return self.model(tokens, positions, KVCache.wrap(k, v))[:, 0]  # (B, V)

    def _decode_hidden(self, tokens, positions, k, v) -> torch.Tensor:
        return self.model(tokens, positions, KVCache.wrap(k, v), return_hidden=True)[:, 0]  # (B, C)

    def release(self) -> None:
        self._use_fast = False
        self.cache = None
        self.pos = None
