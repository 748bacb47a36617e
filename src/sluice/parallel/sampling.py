"""Softmax statistics and sampling over a vocabulary-parallel LM head, without gathering the logits.

Each rank holds the logits of vocabulary ids start..start+V/N. Only a few numbers per row cross
ranks:
- log Z: each rank's max m_r and sum s_r = sum exp(x - m_r); merged by the log-sum-exp rule,
  log Z = M + log sum_r s_r exp(m_r - M) with M = max_r m_r.
- greedy: each rank's (max, global id of its first max); the merged winner is the largest value,
  ties to the lowest id, which is exactly torch.argmax over the full row.
- penalties: elementwise on a token's own logit, so each rank applies them to its columns, with the
  seen mask and counts of its columns (the token history is the same on every rank).
- filters: top_k, top_p and min_p each keep a prefix of the row sorted by (value, then id), so what
  survives is decided by a few merged numbers (filters.py).
- sampling: the exponential race of engine/sampling.py, argmax(x / T - log E). Every rank draws the
  noise E over the FULL vocabulary from a generator seeded as the single-process Sampler seeds it,
  and keeps the columns of its own ids, so each id gets the very number a single process gives it;
  the race is then merged like greedy. Drawing V numbers per row per step on each rank costs what a
  single process pays (a counter-based generator could draw only the shard; it would change the
  single-process streams, so it is not done here). A request without a seed gets a different
  random seed on each rank: the columns' noise is then independent across ranks, which is still an
  exact exponential race (only not reproducible, as without a seed in one process).
With the same logits, the tokens are therefore those of the single-process Sampler.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.noise import log_exp_noise, uniforms_range
from ..engine.sampling import NONFINITE, Sampler, SamplingParams, nonfinite_rows
from . import group
from .filters import filter_shard


def log_z(local: torch.Tensor) -> torch.Tensor:
    """(B, V/N) logits shard -> (B,) fp32 log of the softmax's normaliser over the full vocabulary.
    A shard (or a whole row) of -inf contributes nothing (a row of -inf gives -inf, as logsumexp)."""
    x = local.float()
    m = x.amax(-1)  # (B,)
    # exp(x - m) with m = -inf would be exp(NaN): shift such a shard by 0 instead, its sum is then 0.
    s = (x - torch.where(m.isfinite(), m, 0)[:, None]).exp().sum(-1)
    both = group.all_gather(torch.stack((m, s), -1))  # (N, B, 2)
    ms, ss = both[..., 0], both[..., 1]
    M = ms.amax(0)  # (B,)
    M = torch.where(M.isfinite(), M, 0)  # every shard -inf: the sum below is 0 and log 0 = -inf
    return M + (ss * (ms - M).exp()).sum(0).log()


def _merge_argmax(value: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each rank's best (value, global id) per row -> the global argmax id per row (ties: lowest id).
    Ids travel as float64, exact for any vocabulary below 2**53."""
    both = group.all_gather(torch.stack((value.double(), ids.double()), -1))  # (N, B, 2)
    vals, gids = both[..., 0], both[..., 1]
    best = vals.amax(0)  # (B,)
    # Among the ranks holding the best value, the smallest id (rank order = id order).
    cand = torch.where(vals == best, gids, torch.full_like(gids, float("inf")))
    return cand.amin(0).long()


def greedy(local: torch.Tensor, start: int) -> torch.Tensor:
    """(B, V/N) logits shard whose first column is id `start` -> (B,) argmax ids over the full vocabulary."""
    x = local.float()
    value, idx = x.max(-1)  # first max on ties, as torch.argmax
    return _merge_argmax(value, idx + start)


def any_rank(flags: torch.Tensor) -> torch.Tensor:
    """(B,) bool -> (B,) bool: true where it is true on some rank."""
    return group.all_reduce(flags.float(), op=dist.ReduceOp.MAX).bool()


class ParallelSampler(Sampler):
    """engine/sampling.Sampler over this rank's vocabulary columns start..stop: the same params,
    filters, penalties and per-row streams, drawing exactly the tokens the single-process Sampler
    draws from the same logits and seeds. Its seen mask and counts cover its own columns only; token
    ids going in and out are global. joined(), write_back() and set_row() are Sampler's own."""

    def __init__(self, params: list[SamplingParams], vocab_size: int, start: int, stop: int, device="cpu"):
        super().__init__(params, vocab_size, device, columns=stop - start)  # vocab_size: the whole vocabulary's
        self.start, self.stop = start, stop

    @classmethod
    def joined(cls, samplers: list[Sampler]) -> ParallelSampler:
        self = super().joined(samplers)
        self.start, self.stop = samplers[0].start, samplers[0].stop
        return self

    def _local(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device).reshape(-1) - self.start
        return ids[(ids >= 0) & (ids < self.stop - self.start)]

    def add_context(self, row: int, token_ids) -> None:
        self.seen[row, self._local(token_ids)] = True

    def add_generated(self, row: int, token_ids) -> None:
        ids = self._local(token_ids)
        self.seen[row, ids] = True
        if self.counts is not None:
            self.counts[row].index_add_(0, ids, torch.ones(ids.shape, device=self.device))

    def _record(self, tokens: torch.Tensor) -> None:
        """Mark the drawn tokens that fall in this rank's columns (no host sync)."""
        local = tokens - self.start
        mine = ((local >= 0) & (local < self.seen.shape[1]))[:, None]  # (B, 1)
        idx = local.clamp(0, self.seen.shape[1] - 1)[:, None]
        if self._use_penalty:
            self.seen.scatter_(1, idx, self.seen.gather(1, idx) | mine)
        if self._use_counts:
            self.counts.scatter_add_(1, idx, mine.float())

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V/N) logits shard -> (B,) int64 ids over the full vocabulary, the same on every rank;
        NONFINITE for rows whose logits (on any rank) are not all finite."""
        assert logits.shape == self.seen.shape, f"logits {tuple(logits.shape)} != {tuple(self.seen.shape)}"
        x = logits.float()
        broken = any_rank(nonfinite_rows(x))
        x = self.penalize(x)
        tokens = None
        if self._sampled_rows:
            filtered = filter_shard(x, self.params, self.rows, self._filters, self.start)
            # The sampled rows' noise for this rank's tokens only: the values the whole row's would hold
            # there (noise.py indexes it by token id); log E = 0 for greedy rows, whose pick is `greedy`.
            log_e = torch.zeros_like(filtered)
            streams = [self._streams[i] for i in self._sampled_rows]
            log_e[self._sampled_rows] = log_exp_noise(uniforms_range(streams, self.start, self.stop - self.start))
            for r in streams:
                r.advance()
            value, idx = (filtered - log_e).max(-1)
            tokens = _merge_argmax(value, idx + self.start)
        if self._any_greedy:
            top = greedy(x, self.start)
            tokens = top if tokens is None else torch.where(self.rows["greedy"], top, tokens)
        self._record(tokens)
        return tokens.masked_fill(broken, NONFINITE)
