"""Counter-based random draws for every sampler in sluice: a row's uniform for token t at its s-th draw
is a pure function of (the row's key, s, t), not the next value of a generator.

Why: the exponential race (sampling.py) needs one Exp(1) noise value per token it races, and with top_k
on only the k candidates race. A torch.Generator (mt19937) cannot skip ahead, so every sampled row drew
the whole vocabulary's uniforms at every step to use ~40 of them: 60 us a row at 8,192 tokens, ~1 ms at
Qwen's 151,936. Here a row's draw makes just the values it uses, and any piece of the vocabulary (a
fused head's chunk, a tensor-parallel rank's shard) gets the same values the whole row would: noise is
indexed by token id.

The definition (splitmix64, whose output function is a strong 64-bit mixer):
    key  = mix(seed)                                    (a random 64-bit key when the seed is None)
    base = mix((key ^ domain) + (s + 1) * GOLDEN)        per row and draw; domain separates the uses
    u(t) = (mix(base + (t + 1) * GOLDEN) >> 40) / 2^24   in [0, 1), exact in fp32
select.cpp computes u natively; `_uniforms_numpy` is the reference and the fallback without a compiler,
bit for bit the same (integers only). A row advances s by one per draw (`RowStream.advance`).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .select import kernel as select_kernel

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
RACE, ACCEPT = 0, 0x5BD1E9955BD1E995  # domains: the race's noise, speculative acceptance's uniforms
_TINY = torch.finfo(torch.float32).tiny


def _mix(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class RowStream:
    """One row's random draws: its key (from the seed) and how many draws it has made."""

    __slots__ = ("key", "draws")

    def __init__(self, seed: int | None):
        self.key = _mix(seed & M64) if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.draws = 0

    def base(self, domain: int = RACE) -> int:
        """The current draw's base (as int64 bits, for a tensor)."""
        b = _mix(((self.key ^ domain) + (self.draws + 1) * GOLDEN) & M64)
        return b - (1 << 64) if b >> 63 else b

    def advance(self) -> None:
        self.draws += 1


def _bases(streams: list[RowStream], domain: int) -> torch.Tensor:
    return torch.tensor([s.base(domain) for s in streams], dtype=torch.int64)


def _uniforms_numpy(bases: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The definition in numpy's wrapping uint64 arithmetic: (B,) bases, (B, L) ids -> (B, L) fp32."""
    with np.errstate(over="ignore"):
        z = bases.numpy().astype(np.uint64)[:, None] + (ids.numpy().astype(np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return torch.from_numpy((z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24))


def uniforms_at(streams: list[RowStream], ids: torch.Tensor, domain: int = RACE, native: bool = True) -> torch.Tensor:
    """(B, L) uniforms of row b's tokens ids[b] at its current draw (ids int64 on the CPU)."""
    bases, ids = _bases(streams, domain), ids.to(torch.int64).cpu()
    kern = select_kernel() if native else None
    return kern.counter_uniforms(bases, ids) if kern is not None else _uniforms_numpy(bases, ids)


def uniforms_range(streams: list[RowStream], start: int, n: int, domain: int = RACE, native: bool = True) -> torch.Tensor:
    """(B, n) uniforms of the tokens start..start + n - 1 of every row at its current draw."""
    bases = _bases(streams, domain)
    kern = select_kernel() if native else None
    if kern is not None:
        return kern.counter_uniform_rows(bases, start, n)
    return _uniforms_numpy(bases, torch.arange(start, start + n).expand(len(streams), n))


def exp_noise(u: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws E = -log max(u, tiny) from uniforms u (a new tensor): E > 0 and at most 87.3."""
    return u.clamp_min(_TINY).log_().neg_()


def log_exp_noise(u: torch.Tensor) -> torch.Tensor:
    """log E of exp_noise(u), elementwise: the race's noise term (argmax of logit - log E)."""
    return exp_noise(u).log_()
