"""What the continuous-batching scheduler does with a step's logits, on a vocabulary-parallel head.

engine/scheduler.py asks its `head` for three things: a sampler per sequence, the greedy argmax of
a batch, and the logprobs of the rows that want them. The single-process answers are in
batch_sampling.FullHead; here each rank sees (B, V/N) logits of ids start..stop and the answers are the
same numbers, computed with a few small collectives (every rank calls them in the same order,
because every rank schedules the same sequences):

- logprobs: log Z by log_z (each rank's max and sum, merged); the chosen token's logit from the
  rank that holds it (one all-reduce of B numbers); the top n by merging each rank's n best
  (value, id) pairs, ties to the lower id as engine/logprobs._top_ids breaks them; the entropy
  from each rank's share, summed in the same all-reduce as the chosen token's logprob.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..engine.logprobs import TokenLogprob, TopLogprob, token_text
from ..engine.sampling import NONFINITE, SamplingParams, nonfinite_rows, value_then_id
from . import group
from .sampling import ParallelSampler, any_rank, greedy, log_z


class ParallelHead:
    def __init__(self, vocab_size: int, start: int, stop: int, device):
        self.vocab_size, self.start, self.stop, self.device = vocab_size, start, stop, device

    def sampler(self, params: SamplingParams) -> ParallelSampler:
        return ParallelSampler([params], self.vocab_size, self.start, self.stop, self.device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V/N) -> (B,) global argmax ids, NONFINITE where any rank's logits are not all finite."""
        broken = any_rank(nonfinite_rows(logits))
        return greedy(logits, self.start).masked_fill(broken, NONFINITE)

    def logprobs(self, logits: torch.Tensor, chosen: torch.Tensor, top_n: list[int],
                 decode_one: Callable[[int], str]) -> list[TokenLogprob]:
        """engine/logprobs.token_logprobs over the shards: one TokenLogprob per row."""
        x = logits.float()
        B, w = x.shape
        lp = x - log_z(x)[:, None]  # (B, V/N) this rank's columns of log_softmax
        local = chosen.reshape(B).long().to(x.device) - self.start
        mine = (local >= 0) & (local < w)
        picked = lp.gather(1, local.clamp(0, w - 1)[:, None])[:, 0]
        # one all-reduce: the chosen token's logprob (only its rank adds a value) and each rank's share
        # of the entropy -sum p log p over its columns
        summed = group.all_reduce(torch.stack((torch.where(mine, picked, 0.0), torch.special.entr(lp.exp()).sum(-1))))
        chosen_lp, entropies = summed.tolist()
        n = max(top_n)
        tops = [[] for _ in range(B)]
        if n > 0:
            vals, order = lp.sort(dim=-1, descending=True, stable=True)
            k = min(n, w)
            sent = group.all_gather(torch.stack((vals[:, :k].double(), (order[:, :k] + self.start).double()), -1))
            for b in range(B):
                v, ids = sent[:, b, :, 0].reshape(-1), sent[:, b, :, 1].reshape(-1)
                best = value_then_id(v, ids)[:top_n[b]]
                tops[b] = [(int(i), float(val)) for i, val in zip(ids[best].tolist(), v[best].tolist(), strict=True)]
        out = []
        for b, tok in enumerate(chosen.tolist()):
            top = []
            for i, val in tops[b]:
                text, raw = token_text(decode_one, i)
                top.append(TopLogprob(i, text, val, raw))
            text, raw = token_text(decode_one, tok)
            out.append(TokenLogprob(tok, text, chosen_lp[b], raw, top, entropies[b]))
        return out
