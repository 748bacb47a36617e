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


def accept(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, lengths: list[int], rows: list[int],
           streams: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """speculative.accept's (n, final), with the sampled rows' streams advanced as it advances them (the
    acceptance draw, then the final token's); or None, having changed nothing, where the torch rule must run."""
    kern = kernel() if p.device.type == "cpu" and p.dtype == torch.float32 else None
    if kern is None or (q is not None and q.dtype != torch.float32):
        return None
    STATS["calls"] += 1
    sampled = torch.zeros(p.shape[0], dtype=torch.bool)
    sampled[rows] = True
    n, final, deferred = kern.accept(p.contiguous(), _EMPTY if q is None else q.contiguous(), draft.contiguous(),
                                     torch.tensor(lengths, dtype=torch.int64), sampled, [s.key for s in streams],
                                     [s.draws for s in streams])
    if deferred:
        STATS["fallback"] += 1
        return None
    for i in rows:
        streams[i].advance()
        streams[i].advance()
    return n, final


def accept_rows(logits: list[torch.Tensor], q: list[torch.Tensor] | None, guesses: list[list[int]],
                sampled: list[bool], temperature: list[float], top_p: list[float], streams: list
                ) -> tuple[list[int], list[int]] | None:
    """accept()'s decisions from the target's logits, on a round's rows as lists (verify()'s own form: no
    padded (B, K+1, V) stack, no index tensors): row b's logits (len_b + 1, V) fp32, its guesses, its
    draft's q rows (q None: a point mass on each guess), whether it samples, its temperature (0: greedy)
    and top_p. Each p a position is RoundProbs' row (nucleus_probs'), filtered where the rule first reads
    it: a round that rejects its first guess filters one position. Returns (n, final) as lists, the sampled
    rows' streams advanced as accept() advances them; or None, having changed nothing (no kernel, or rows
    off the CPU: the caller's torch rule)."""
    cpu = all(x.device.type == "cpu" for x in logits) and (q is None or all(x.device.type == "cpu" for x in q))
    kern = kernel() if LANES and cpu else None
    if kern is None:
        return None
    STATS["calls"] += 1
    n, final, deferred = kern.accept_rows(logits, [] if q is None else q, guesses, sampled, temperature, top_p,
                                          [s.key for s in streams], [s.draws for s in streams], LANES)
    if deferred:
        STATS["fallback"] += 1
        return None
    for s, on in zip(streams, sampled, strict=True):
        if on:
            s.advance()
            s.advance()
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
