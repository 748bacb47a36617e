"""Exact per-row selections the sampler runs at every step: each row's argmax with its NaN / inf check,
and each row's top-k candidates in a stable descending sort's order. select.cpp scans each row once
(a few microseconds where ATen's argmax and topk took 70-130 and 95 us for a batch of 8,192-token
rows), and whole rows in a stable descending sort (top_p with top_k off). The torch versions below are
the reference and the fallback without a compiler. Nothing is computed from the logits, only chosen,
so both give the same values and ids, bit for bit (the one freedom, which of several tokens tied at
top_candidates' k-th place it takes, is its docstring's)."""

from __future__ import annotations

import torch

from .native import NATIVE_DIR, NativeExtension

_EXT = NativeExtension(NATIVE_DIR / "select.cpp", "sampling selection kernel")


def kernel():
    """The compiled extension, or None (why_unavailable() says why): select.cpp's selections and
    noise.py's counter-based uniforms."""
    return _EXT.module()


def _kernel(x: torch.Tensor):
    return kernel() if x.device.type == "cpu" and x.dtype == torch.float32 else None


def value_then_id(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Indices ordering (value, id) pairs along the last dim by value descending, then id ascending:
    the order a stable descending sort of the whole row gives any subset of it (the filters' and
    argmax's tie rule). Used wherever a subset is merged: top-k candidates, vocabulary shards."""
    by_id = ids.argsort(dim=-1, stable=True)
    return by_id.gather(-1, values.gather(-1, by_id).argsort(dim=-1, descending=True, stable=True))


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """Which rows (along the last dim) of x hold a NaN or an inf: x.amax / x.amin carry a NaN, and an
    inf shows in one of them. Two reductions cost a fifth of isfinite().all() on (8, 8,192)."""
    return ~(x.amax(-1).isfinite() & x.amin(-1).isfinite())


def argmax_rows(x: torch.Tensor, native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, V) -> (each row's first argmax (B,) int64, whether the row holds a NaN or an inf (B,)).
    A non-finite row's argmax is unspecified (callers replace it)."""
    k = _kernel(x) if native else None
    if k is not None:
        return k.argmax_rows(x)
    return x.argmax(-1), nonfinite_rows(x)


def top_candidates(x: torch.Tensor, k: int, native: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (B, V), 0 < k < V -> (values, ids) (B, k): each row's first k entries of a stable descending
    sort, and (B,) the (k + 1)-th largest value of each row. Where that value ties with the k-th, the
    torch version takes k of the tied tokens in no set order (topk), the kernel the lowest ids; callers
    that need the exact set there see the tie in `next` and sort the row. Finite rows only: a NaN
    ranks differently in the two (rows with one are flagged by argmax_rows and never drawn from)."""
    kern = _kernel(x) if native else None
    if kern is not None:
        return kern.top_candidates(x, k)
    top, top_ids = x.topk(k + 1, dim=-1)  # the k + 1 largest, descending; ties in no set order
    order = value_then_id(top[:, :k], top_ids[:, :k])
    return top.gather(1, order), top_ids.gather(1, order), top[:, k]


def sort_descending(x: torch.Tensor, native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, V) -> (values, ids) (B, V): x.sort(dim=-1, descending=True, stable=True), the same bits from
    the kernel (a radix sort: 20-40 us a row of 8,192 where ATen's stable sort took ~400)."""
    kern = _kernel(x) if native else None
    if kern is not None and x.dim() == 2:
        return kern.sort_descending(x)
    return x.sort(dim=-1, descending=True, stable=True)


def why_unavailable() -> str | None:
    return _EXT.why_unavailable()
