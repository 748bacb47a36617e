"""Softmax statistics and sampling over a vocabulary-parallel LM head, without gathering the logits.

Each rank holds the logits of vocabulary ids start..start+V/N. Only a few numbers per row cross
ranks:
- log Z: each rank's max m_r and sum s_r = sum exp(x - m_r); merged by the log-sum-exp rule,
  log Z = M + log sum_r s_r exp(m_r - M) with M = max_r m_r.
- greedy: each rank's (max, global id of its first max); the merged winner is the largest value,
  ties to the lowest id, which is exactly torch.argmax over the full row.
- sampling: the exponential race of engine/sampling.py, argmax(x / T - log E). Every rank draws the
  noise E over the FULL vocabulary from a generator seeded as the single-process Sampler seeds it,
  and keeps the columns of its own ids, so each id gets the very number a single process gives it;
  the race is then merged like greedy. Drawing V numbers per row per step on each rank costs what a
  single process pays (a counter-based generator could draw only the shard; it would change the
  single-process streams, so it is not done here).
With the same logits, the tokens are therefore identical to the single-process Sampler's.
"""

from __future__ import annotations

import torch

from ..engine.sampling import NONFINITE, SamplingParams, _generator
from ..errors import RequestError
from . import group


def log_z(local: torch.Tensor) -> torch.Tensor:
    """(B, V/N) logits shard -> (B,) fp32 log of the softmax's normaliser over the full vocabulary."""
    x = local.float()
    m = x.amax(-1)  # (B,)
    s = (x - m[:, None]).exp().sum(-1)
    both = group.all_gather(torch.stack((m, s), -1))  # (N, B, 2)
    ms, ss = both[..., 0], both[..., 1]
    M = ms.amax(0)  # (B,)
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


class ParallelSampler:
    """engine/sampling.Sampler for a vocabulary-parallel head: greedy, temperature and top_k rows,
    drawing exactly the tokens the single-process Sampler draws from the same logits and seeds.
    Top-p, min-p and the penalties need the sorted or counted full vocabulary; they are refused."""

    def __init__(self, params: list[SamplingParams], vocab_size: int, start: int, stop: int, device="cpu"):
        self.params = [p.with_defaults(None) for p in params]
        for p in self.params:
            p.validate(vocab_size)
            for name, off in (("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
                if getattr(p, name) != off:
                    raise RequestError(f"{name}={getattr(p, name)!r} is not implemented with tensor "
                                       "parallelism yet (greedy, temperature and top_k are)")
        self.vocab_size, self.start, self.stop = vocab_size, start, stop
        self.device = torch.device(device)
        B = len(self.params)
        self.greedy_rows = torch.tensor([p.temperature == 0 for p in self.params], device=self.device)
        self.temperature = torch.tensor([p.temperature or 1.0 for p in self.params], device=self.device)
        self.top_k = [0 if p.top_k <= 0 else min(p.top_k, vocab_size) for p in self.params]
        self._sampled = [i for i, p in enumerate(self.params) if p.temperature > 0]
        self._generators = [_generator(p.seed, self.device) for p in self.params]
        self._noise = torch.ones(B, vocab_size, device=self.device) if self._sampled else None

    def _kth_largest(self, x: torch.Tensor) -> torch.Tensor:
        """(B, V/N) scaled logits -> (B, 1) the k-th largest value over the full vocabulary per row
        (-inf where top_k is off): every rank's k largest hold the global k largest."""
        k = max(self.top_k)
        mine = x.topk(min(k, x.shape[-1]), -1).values  # (B, k')
        every = group.all_gather(mine).permute(1, 0, 2).reshape(x.shape[0], -1)  # (B, N*k')
        ranked = every.sort(-1, descending=True).values
        ks = torch.tensor([max(kk, 1) for kk in self.top_k], device=x.device)
        kth = ranked.gather(1, ks[:, None] - 1)
        off = torch.tensor([kk == 0 for kk in self.top_k], device=x.device)
        return kth.masked_fill(off[:, None], float("-inf"))

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        """(B, V/N) logits shard -> (B,) int64 ids over the full vocabulary, the same on every rank;
        NONFINITE for rows whose logits (on any rank) are not all finite."""
        x = local.float()
        broken = (~x.isfinite().all(-1)).float()  # (B,)
        group.all_reduce(broken, op=torch.distributed.ReduceOp.MAX)
        tokens = greedy(x, self.start)
        if self._sampled:
            # Sampler._filter's scaling, with the max taken over every shard.
            M = group.all_reduce(x.amax(-1), op=torch.distributed.ReduceOp.MAX)
            scaled = (x - M[:, None]) / self.temperature[:, None]
            if any(self.top_k[i] for i in self._sampled):
                scaled = scaled.masked_fill(scaled < self._kth_largest(scaled), float("-inf"))
            for i in self._sampled:
                self._noise[i].exponential_(generator=self._generators[i])
            self._noise.clamp_min_(torch.finfo(torch.float32).tiny)
            raced = scaled - self._noise[:, self.start:self.stop].log()
            value, idx = raced.max(-1)
            drawn = _merge_argmax(value, idx + self.start)
            tokens = torch.where(self.greedy_rows, tokens, drawn)
        return tokens.masked_fill(broken.bool(), NONFINITE)
