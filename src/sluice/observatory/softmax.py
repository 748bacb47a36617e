"""The softmax toll booth: when does exp() at the LM head overflow, and what prevents it?

softmax(z)_i = exp(z_i) / sum_j exp(z_j). In a floating-point format whose largest finite value is
`max`, exp(z) is inf as soon as z > log(max): about 88.7 in fp32 and bf16 (same exponent range) but
only 11.09 in fp16. Three ways to compute it, each done here *in* the dtype under test:

- naive:  exp(z) / sum exp(z). Breaks (inf/inf = NaN) as soon as one logit passes the threshold,
          and also when every logit is very negative (all exp() underflow to 0: 0/0 = NaN).
- safe:   subtract the row max first, so every exp() is in (0, 1]. Three passes over the vocab
          (max, exp-sum, normalise): what torch.softmax does.
- online: max and sum in ONE pass over vocab chunks, rescaling the running sum by exp(m_old - m_new)
          whenever the max grows (Milakov & Gimelshein 2018; the trick inside flash attention and
          fused LM-head kernels). Normalising is the second pass.

Safe and online never overflow in exp(), but their denominator is still a sum of up to V terms in
(0, 1]: for a flat distribution over V > 65504 tokens it exceeds fp16's max and becomes inf, so every
probability rounds to 0. That is a real limit of fp16 softmax over modern vocabularies, and the table
reports it instead of hiding it. (On CPU, torch sums fp16/bf16 with an fp32 accumulator and rounds the
result once, so the sums here are *more* accurate than a kernel accumulating in fp16, never less.)

Casting the logits to the dtype is part of the cost: a bf16 logit near 20 is only known to +-0.06, so
bf16 probabilities are off by a few percent before any exp() runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ObservatoryError

METHODS = ("naive", "safe", "online")


def overflow_threshold(dtype: torch.dtype) -> float:
    """The largest z whose exp(z) is still finite in `dtype` (up to rounding): log(finfo.max)."""
    return math.log(torch.finfo(dtype).max)


@dataclass
class SoftmaxOut:
    """One softmax computed in one dtype, with what went wrong, per row (N rows)."""

    probs: torch.Tensor  # (N, V) in the dtype under test
    log_z: torch.Tensor  # (N,) fp64: the log of the normaliser the method computed (m + log s)
    exp_inf: torch.Tensor  # (N,) int64: exp() results that overflowed to inf
    denom_inf: torch.Tensor  # (N,) bool: the denominator overflowed (or is NaN)
    denom_zero: torch.Tensor  # (N,) bool: the denominator underflowed to 0


def _finish(e: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, exp_inf) -> SoftmaxOut:
    """Normalise e (N, V) by s (N,) in e's dtype and package the diagnostics."""
    probs = e / s[:, None]
    log_z = s.double().log() + (m.double() if m is not None else 0.0)
    return SoftmaxOut(probs, log_z, exp_inf, ~torch.isfinite(s), s == 0)


def naive_softmax(z: torch.Tensor, dtype: torch.dtype) -> SoftmaxOut:
    """exp(z) / sum exp(z) in `dtype`, no max subtraction: the textbook formula."""
    z = z.to(dtype)  # (N, V)
    e = torch.exp(z)
    return _finish(e, e.sum(-1), None, torch.isinf(e).sum(-1))


def safe_softmax(z: torch.Tensor, dtype: torch.dtype) -> SoftmaxOut:
    """Three passes in `dtype`: m = max z; s = sum exp(z - m); p = exp(z - m) / s."""
    z = z.to(dtype)  # (N, V)
    m = z.amax(-1)  # (N,) pass 1
    e = torch.exp(z - m[:, None])  # every term in (0, 1]: cannot overflow
    return _finish(e, e.sum(-1), m, torch.isinf(e).sum(-1))  # pass 2 (sum), pass 3 (divide)


def online_softmax(z: torch.Tensor, dtype: torch.dtype, chunk: int = 4096) -> SoftmaxOut:
    """One pass over the vocab in chunks of `chunk`, keeping a running max m and running sum s of
    exp(z - m); when a chunk raises the max, the old sum is rescaled by exp(m_old - m_new) <= 1."""
    z = z.to(dtype)  # (N, V)
    N = z.shape[0]
    m = torch.full((N,), -math.inf, dtype=dtype, device=z.device)
    s = torch.zeros(N, dtype=dtype, device=z.device)
    exp_inf = torch.zeros(N, dtype=torch.int64, device=z.device)
    for start in range(0, z.shape[1], chunk):
        zc = z[:, start:start + chunk]  # (N, c)
        m_new = torch.maximum(m, zc.amax(-1))
        e = torch.exp(zc - m_new[:, None])
        # exp(-inf) = 0 on the first chunk, so s starts as the first chunk's sum
        s = s * torch.exp(m - m_new) + e.sum(-1)
        exp_inf += torch.isinf(e).sum(-1)
        m = m_new
    e = torch.exp(z - m[:, None])  # the normalising pass: the only other read of the vocab
    return _finish(e, s, m, exp_inf + torch.isinf(e).sum(-1))


def _compute(method: str, z: torch.Tensor, dtype: torch.dtype) -> SoftmaxOut:
    return {"naive": naive_softmax, "safe": safe_softmax, "online": online_softmax}[method](z, dtype)


def _row_stats(out: SoftmaxOut, p_ref: torch.Tensor, logz_ref: torch.Tensor) -> dict:
    """Per-row (n,) diagnostics of one method against the fp64 reference."""
    p = out.probs.double()  # (n, V)
    bad = ~torch.isfinite(p)
    broken = bad.any(-1) | out.denom_inf | out.denom_zero | ~torch.isfinite(p.sum(-1))
    # amax propagates NaN and inf: a broken row shows up as NaN/inf error, never as a small number
    return {"overflow": out.exp_inf, "nan": torch.isnan(p).sum(-1), "broken": broken,
            "denom_overflow": out.denom_inf, "denom_underflow": out.denom_zero,
            "abs_err": (p - p_ref).abs().amax(-1), "logz_err": (out.log_z - logz_ref).abs()}


def _max(x: torch.Tensor) -> float:
    """max of a 1-D float tensor as a Python float; NaN if any entry is NaN, NaN if empty."""
    return float(x.max()) if x.numel() else math.nan


def softmax_safety(logits: torch.Tensor,
                   dtypes=(torch.float32, torch.float16, torch.bfloat16),
                   rows_per_block: int | None = None) -> list[dict]:
    """How each softmax method fares in each dtype on real logits (N, V) (rows = positions).

    The reference is a safe softmax in fp64 of the logits as given. One dict per (method, dtype):
      method, dtype, rows (N), vocab (V), logit_max (of the input), threshold (of the dtype),
      overflow         exp() results that were inf, summed over rows
      nan              NaN probabilities, summed over rows
      denom_overflow   rows whose denominator overflowed (their probabilities are 0 or NaN)
      denom_underflow  rows whose denominator underflowed to 0 (every exp() underflowed)
      rows_broken      rows with a non-finite probability or a non-finite / zero denominator
      max_abs_err      max |p - p_ref| over all entries: NaN or inf if any output is, so a broken
                       row is never hidden (a row of zeros from an overflowed denominator scores
                       its own max probability)
      max_abs_err_ok   the same over the rows that are not broken (NaN if none are)
      max_logz_err     max |log Z - log Z_ref| where Z is the normaliser the method computed
    All values are plain Python numbers (JSON-serialisable); inf and NaN are reported as floats.
    Rows are processed in blocks so only a few (block, V) fp64 tensors exist at once.
    """
    if logits.ndim != 2 or not logits.is_floating_point() or logits.numel() == 0:
        raise ObservatoryError(f"softmax_safety needs a non-empty float (N, V) tensor of logits, "
                               f"got shape {tuple(logits.shape)} {logits.dtype}")
    N, V = logits.shape
    if rows_per_block is None:
        # ~32 MiB per (block, V) fp64 tensor: each block holds several (the reference, each method's
        # probabilities and its error), so at a 150k vocabulary bigger blocks cost GBs, not speed
        rows_per_block = max(1, (4 << 20) // max(V, 1))
    stats = {(m, d): [] for m in METHODS for d in dtypes}
    for start in range(0, N, rows_per_block):
        z = logits[start:start + rows_per_block]  # (n, V)
        z64 = z.double()
        logz_ref = torch.logsumexp(z64, -1)  # (n,)
        p_ref = torch.exp(z64 - logz_ref[:, None])  # (n, V) fp64 safe softmax
        for (method, dtype), acc in stats.items():
            acc.append(_row_stats(_compute(method, z, dtype), p_ref, logz_ref))

    table = []
    for (method, dtype), blocks in stats.items():
        s = {k: torch.cat([b[k] for b in blocks]) for k in blocks[0]}  # (N,) each
        table.append({
            "method": method, "dtype": str(dtype).removeprefix("torch."), "rows": N, "vocab": V,
            "logit_max": float(logits.max()), "threshold": overflow_threshold(dtype),
            "overflow": int(s["overflow"].sum()), "nan": int(s["nan"].sum()),
            "denom_overflow": int(s["denom_overflow"].sum()),
            "denom_underflow": int(s["denom_underflow"].sum()),
            "rows_broken": int(s["broken"].sum()),
            "max_abs_err": _max(s["abs_err"]), "max_abs_err_ok": _max(s["abs_err"][~s["broken"]]),
            "max_logz_err": _max(s["logz_err"]),
        })
    return table
