"""The modules tensor parallelism swaps into sluice's own Transformer; everything else in the
model is the plain single-process code, run on a rank's narrower config (parallel/sharding.py).

They subclass nn.Linear / nn.Embedding / RMSNorm so the parameter names (and so the state dict, the loader
and the observatory's hooks) stay those of the model they replace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model.layers import RMSNorm
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


class FullWidthRMSNorm(RMSNorm):
    """OLMo 2's q/k norm over the whole projection (all heads' channels together), when each rank
    holds only its heads' channels. The mean of squares needs every channel: each rank sums the
    squares of its own (fp32), one all-reduce of those (B, T, 1) sums gives the full sum, and each
    rank then normalises its channels with its slice of the gain (`weight`, sliced like q's or k's
    rows). `full_dim` is the global width (H*D or K*D) the mean divides by. Only the statistic
    differs from RMSNorm (mean_square); eps and the family's gain order are RMSNorm's own.

    With fewer KV heads than ranks, the ranks sharing a KV head hold the same k channels; only the
    first of them (`counted`) contributes its sum, so each channel is counted once, exactly. The
    parameter keeps RMSNorm's name, and the arithmetic after the sum is RMSNorm's (eps, fp32
    statistics, the family's gain order), so the result equals one process's up to the order of
    the fp32 sum."""

    def __init__(self, dim: int, eps: float, full_dim: int, counted: bool = True, **kwargs):
        super().__init__(dim, eps, **kwargs)
        self.full_dim, self.counted = full_dim, counted

    def mean_square(self, x32: torch.Tensor) -> torch.Tensor:
        squares = x32.pow(2).sum(-1, keepdim=True)  # (B, T, 1): this rank's channels only
        if not self.counted:
            squares = torch.zeros_like(squares)  # a replica: the first rank of its group counts them
        return group.all_reduce(squares) / self.full_dim

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, full_dim={self.full_dim}, counted={self.counted}"
