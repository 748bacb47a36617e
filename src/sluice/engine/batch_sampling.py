"""How the scheduler (scheduler.py) turns one step's logits into tokens: the head (what the logits
cover) and the draw (which rows sample together).

A head answers three things about logits (N, V): a sampler for a new sequence, the greedy argmax of
rows, and logprobs. FullHead's logits cover the whole vocabulary; under tensor parallelism
parallel/head.ParallelHead answers the same from each rank's vocabulary shard.
"""

from __future__ import annotations

import torch

from .logprobs import token_logprobs
from .sampling import NONFINITE, Sampler, SamplingParams, argmax_rows
from .sequence import Seq


class FullHead:
    """The samplers, argmax and logprobs of a step whose logits cover the whole vocabulary."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device

    def sampler(self, params: SamplingParams) -> Sampler:
        return Sampler([params], self.vocab_size, self.device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        tokens, broken = argmax_rows(logits.float())  # as Sampler does
        return tokens.masked_fill(broken, NONFINITE)

    logprobs = staticmethod(token_logprobs)


class BatchDraw:
    """(N,) next tokens for the sequences at their end. Plain greedy rows (no penalty: nothing of their
    own to keep) take one argmax together; every other row its own Sampler (its stream, its penalty
    state), so a request draws exactly what it would alone.

    Rows that sample are joined into one sampler (one sort for every filtered row), kept while the rows
    stay the same: joining costs ~0.2 ms a step at 8 rows, and the batch changes only when a sequence
    joins or leaves. The kept one holds the rows' penalty state, copied back after each call."""

    def __init__(self, head):
        self.head = head
        self._joined: tuple[list[int], Sampler] | None = None  # (sequence ids, the joined sampler)

    def __call__(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor:
        kept, self._joined = self._joined, None  # only a joined draw keeps it; other paths drop it
        if all(s.sampler.plain_greedy for s in seqs):
            return self.head.argmax(logits)
        if len(seqs) == 1:
            return seqs[0].sampler(logits)
        key = [s.id for s in seqs]
        joined = kept[1] if kept and kept[0] == key else type(seqs[0].sampler).joined([s.sampler for s in seqs])
        tokens = joined(logits)
        joined.write_back()
        self._joined = (key, joined)
        return tokens
