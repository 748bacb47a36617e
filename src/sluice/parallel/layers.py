"""The two modules tensor parallelism swaps into sluice's own Transformer; everything else in the
model is the plain single-process code, run on a rank's narrower config (parallel/sharding.py).

They subclass nn.Linear / nn.Embedding so the parameter names (and so the state dict, the loader
and the observatory's hooks) stay those of the model they replace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import group


class RowParallelLinear(nn.Linear):
    """o and down: this rank holds the input columns of its heads (or intermediate channels), so its
    product is a partial sum of the full output; one all-reduce completes it. The bias is whole on
    every rank and added once, after the reduce (adding it per rank would count it N times)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (B, T, C): this rank's share of the sum
        group.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The embedding table's rows start..start+V/N. Each rank looks up the ids it holds and writes
    zeros for the others; the all-reduce then sums exactly one nonzero row per token (x + 0 is exact,
    so the result equals the single-process lookup bit for bit). Tied models share this weight with
    the vocabulary-parallel LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, **kwargs):
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)  # (B, T)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # (B, T, C)
        x = x.masked_fill(~mine[..., None], 0)
        return group.all_reduce(x)
