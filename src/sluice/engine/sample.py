"""The batch sampler's step as one native call (native/sample.cpp), drawing exactly the tokens the torch
path (filtering.py) draws: penalties, max and NaN / inf check, temperature, top_k, top_p, min_p, the
counter-based noise and the race, for every row at once, with the penalty state updated in place.

The kernel takes a decision only where it can prove torch's float arithmetic takes the same one (its
comments say how; top_p with top_k off brackets torch's softmax sum or else reproduces it bit for bit, both of
which need the lane count of torch's own vectorised kernels, LANES); where it cannot, or the step is unusual (a NaN or inf row), it
changes nothing and the caller runs the torch path. So the kernel is an optimisation, never a second
definition of a draw: turning it off (SLUICE_NO_KERNELS, no compiler) gives the same tokens.
"""

from __future__ import annotations

import torch

from .native import NATIVE_DIR, NativeExtension

_EXT = NativeExtension(NATIVE_DIR / "sample.cpp", "batch sampling kernel")
_PARAMS = ("temperature", "top_p", "min_p", "penalty", "presence", "frequency")  # the kernel's row layout
# The fp32 lanes of ATen's vectorised kernels in this process (its softmax sums in that many lanes); 0 where
# the kernel cannot know them, and then defers top_p with top_k off.
LANES = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)
STATS = {"calls": 0, "fallback": 0}  # native calls, and those handed to the torch path (bench/sampler.py)


def kernel():
    """The compiled extension, or None (why_unavailable() says why)."""
    return _EXT.module()


def why_unavailable() -> str | None:
    return _EXT.why_unavailable()


def pack(rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampler's row params (sampling.row_tensors) as the kernel reads them: (B, 6) fp32 in _PARAMS'
    order (the same fp32 values torch uses) and (B,) int64 top_k, 0 for a greedy row."""
    return (torch.stack([rows[name].float().cpu() for name in _PARAMS], 1).contiguous(),
            rows["top_k"].cpu().masked_fill(rows["greedy"].cpu(), 0).contiguous())


_NONE_BOOL, _NONE_FLOAT = torch.empty(0, dtype=torch.bool), torch.empty(0)


def draw(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], seen: torch.Tensor | None,
         counts: torch.Tensor | None, streams: list) -> torch.Tensor | None:
    """(B,) tokens for fp32 logits x (B, V), with seen / counts (those the sampler keeps, else None)
    marked; or None, having changed nothing, when the torch path must draw (no kernel here, another
    device, or a step the kernel could not decide). The caller advances the sampled rows' streams."""
    kern = kernel() if x.device.type == "cpu" else None
    if kern is None:
        return None
    STATS["calls"] += 1
    tokens, deferred = kern.draw(x.contiguous(), packed[0], packed[1],
                                 _NONE_BOOL if seen is None else seen, _NONE_FLOAT if counts is None else counts,
                                 [s.key for s in streams], [s.draws for s in streams], LANES)
    if deferred:
        STATS["fallback"] += 1
        return None
    return tokens
