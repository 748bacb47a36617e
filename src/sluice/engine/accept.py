"""Speculative decoding's acceptance rule, and its race over a distribution, each as one native call
(native/accept.cpp), deciding exactly what the torch rule (speculative.accept, speculative.draw) decides:
the guesses kept, the residual at the first rejection, the race. Where the kernel cannot prove torch's
float keys pick the same token (two within its bound), or a row holds a NaN, it changes nothing and the
torch rule runs: the kernel is an optimisation, never a second definition of a draw (SLUICE_NO_KERNELS
gives the same tokens)."""

from __future__ import annotations

import torch

from .native import NATIVE_DIR, NativeExtension
from .sample import LANES

_EXT = NativeExtension(NATIVE_DIR / "accept.cpp", "speculative acceptance kernel")
STATS = {"calls": 0, "fallback": 0}  # native calls, and those handed to the torch rule
_EMPTY = torch.empty(0)


def kernel():
    """The compiled extension, or None (why_unavailable() says why)."""
    return _EXT.module()


def why_unavailable() -> str | None:
    return _EXT.why_unavailable()


def draw(probs: torch.Tensor, rows: list[int], streams: list) -> torch.Tensor | None:
    """speculative.draw's tokens, the sampled rows' streams advanced; or None, having changed nothing."""
    kern = kernel() if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2 else None
    if kern is None:
        return None
    STATS["calls"] += 1
    sampled = torch.zeros(probs.shape[0], dtype=torch.bool)
    sampled[rows] = True
    tokens, deferred = kern.draw(probs.contiguous(), sampled, [s.key for s in streams], [s.draws for s in streams])
    if deferred:
        STATS["fallback"] += 1
        return None
    for i in rows:
        streams[i].advance()
    return tokens


def accept(p: torch.Tensor | None, q: torch.Tensor | None, draft: torch.Tensor, lengths: list[int], rows: list[int],
           streams: list, logits: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """speculative.accept's (n, final), with the sampled rows' streams advanced as it advances them (the
    acceptance draw, then the final token's); or None, having changed nothing, where the torch rule must run.
    logits = (x (B, K+1, V) fp32, temperature (B,) with 0 on greedy rows, top_p (B,)) in place of p (None),
    for rows of temperature and top_p alone without penalties: each p a position is nucleus_probs' row,
    filtered where the rule first reads it."""
    src = p if logits is None else logits[0]
    kern = kernel() if src.device.type == "cpu" and src.dtype == torch.float32 else None
    if kern is None or (q is not None and q.dtype != torch.float32) or (logits is not None and not LANES):
        return None
    STATS["calls"] += 1
    sampled = torch.zeros(src.shape[0], dtype=torch.bool)
    sampled[rows] = True
    args = (_EMPTY if q is None else q.contiguous(), draft.contiguous(), torch.tensor(lengths, dtype=torch.int64),
            sampled, [s.key for s in streams], [s.draws for s in streams])
    if logits is None:
        n, final, deferred = kern.accept(p.contiguous(), *args)
    else:
        n, final, deferred = kern.accept_logits(_EMPTY, *args, logits[0].contiguous(), *logits[1:], LANES)
    if deferred:
        STATS["fallback"] += 1
        return None
    for i in rows:
        streams[i].advance()
        streams[i].advance()
    return n, final


def nucleus_probs(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """RoundProbs' probabilities (N, V) of fp32 logits x (N, V) for rows of temperature (0: greedy, a one-hot
    argmax) and top_p alone, no penalties; or None (a non-finite logit, no kernel): RoundProbs' torch path."""
    kern = kernel() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and LANES else None
    if kern is None:
        return None
    probs, deferred = kern.nucleus_probs(x.contiguous(), temperature, top_p, LANES)
    return None if deferred else probs



def propose(x: torch.Tensor, temperature: torch.Tensor, rows: list[int], streams: list
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A draft guess in one native call: (q, tokens), q = nucleus_probs(x, temperature, top_p off) and tokens
    = speculative.draw(q, rows, streams) with the listed rows' streams advanced; or None, having changed
    nothing (the caller makes the two calls)."""
    kern = kernel() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and LANES else None
    if kern is None:
        return None
    sampled = torch.zeros(x.shape[0], dtype=torch.bool)
    sampled[rows] = True
    q, tokens, deferred = kern.propose(x.contiguous(), temperature, sampled, [s.key for s in streams],
                                       [s.draws for s in streams], LANES)
    if deferred:
        return None
    for i in rows:
        streams[i].advance()
    return q, tokens


def top_p_rows() -> tuple[int, int, int]:
    """(rows whose top_p cut was proven without a sort, rows sorted, rows the acceptance rule took with a cut
    proven to within a few tokens) by this process's kernel, for tests."""
    kern = kernel()
    return (0, 0, 0) if kern is None else kern.top_p_rows()
