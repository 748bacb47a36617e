"""engine/sampling.filter_logits (temperature, top_k, top_p, min_p) on one rank's vocabulary columns.

The single-process filter sorts the whole row by value (ties by id: a stable sort) and keeps a
prefix of that order: top_k keeps the values >= the k-th largest, top_p the shortest prefix whose
mass reaches top_p, min_p the values whose probability is >= min_p * p_max. So the kept set is the
first L tokens in (value descending, id ascending) order, and a rank needs only L's last token
(v*, id*) to mask its columns: keep x > v*, or x == v* with id <= id*. Finding it:

- the max (for the temperature's shift) and the k-th largest value: each rank's max / top k, merged;
- Z, the softmax's sum over the top_k survivors: each rank's partial sum (float64), added in rank order;
- the cut of top_p / min_p: every rank sends its m best (value, id) pairs in key order; merged, they
  are certainly the global best up to the smallest "last sent" key of any rank. If the cut is not
  inside that certain prefix yet, m doubles (all ranks in lockstep: the decision is made from the
  same gathered numbers everywhere). A peaked distribution settles at the first round.

The single process computes Z and the masses in fp32; they are computed here in float64. Where a
row's cut lies so close to a rounding decision that fp32 could go either way (a prefix mass within
mass_tol(V) of top_p, a probability ratio within RATIO_TOL of min_p), that row's logits are gathered
and the single-process filter itself decides, so the kept set is the single process's own. So is a
row whose cut lies deeper than a quarter of the shard (a flat distribution under top_p): one gather
then costs less than more doubling rounds. On a peaked row neither happens; on a flat row of a large
vocabulary (every prefix mass within the tolerance of top_p) the gather is the common case.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..engine.sampling import SamplingParams, filter_logits, value_then_id
from . import group

# min_p compares p_i / p_max = exp(v_i): the fp32 exp's and three products' rounding, ~4e-7 at most.
RATIO_TOL = 2e-6
FIRST_M = 64  # pairs each rank sends in the first round of the top_p / min_p search


def mass_tol(vocab_size: int) -> float:
    """How far the single process's fp32 prefix masses (softmax, then a cumsum) may stray from the
    float64 ones here. Measured on random rows: 1.8e-7 at V=512, 1.4e-6 at 32k, 1.2e-5 at 152k
    (the softmax's fp32 sum); this allows about 7x that."""
    return 1e-5 + 2e-7 * math.sqrt(vocab_size)


def filter_shard(x: torch.Tensor, params: list[SamplingParams], rows: dict, flags: tuple, start: int) -> torch.Tensor:
    """(B, V/N) fp32 penalised logits of ids start.. -> the temperature-scaled logits of these columns
    with filtered tokens at -inf, exactly the columns of sampling.filter_logits over the whole row."""
    use_top_k, use_top_p, use_min_p = flags
    M = group.all_reduce(x.amax(-1), op=dist.ReduceOp.MAX)  # exact: a max does not round
    y = (x - M[:, None]) / rows["temperature"][:, None]
    if use_top_k:
        y = y.masked_fill(y < _kth_largest(y, params), -math.inf)
    if not (use_top_p or use_min_p):
        return y
    cut = [p.temperature > 0 and (p.top_p < 1 or p.min_p > 0) for p in params]
    if not any(cut):
        return y
    bounds, unsure = _nucleus(y, params, cut, start)
    gid = torch.arange(start, start + y.shape[1], device=y.device)
    for r, (v, i) in bounds.items():
        keep = (y[r] > v) | ((y[r] == v) & (gid <= i))
        y[r] = y[r].masked_fill(~keep, -math.inf)
    if unsure:  # every rank has the same list: the gather below runs everywhere
        full = torch.cat(list(group.all_gather(x[unsure])), -1)  # (n, V): these rows only
        sub = {k: v[unsure] for k, v in rows.items()}
        y[unsure] = filter_logits(full, sub, use_top_k, use_top_p, use_min_p)[:, start:start + y.shape[1]]
    return y


def _kth_largest(y: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(B, V/N) -> (B, 1) the k-th largest value over the full vocabulary per row (-inf where top_k
    is off or the row is greedy): every rank's k largest hold the global k largest."""
    ks = [p.top_k if p.temperature > 0 and p.top_k > 0 else 0 for p in params]
    k = min(max(ks), y.shape[-1] * dist.get_world_size())
    if k == 0:
        return y.new_full((y.shape[0], 1), -math.inf)
    mine = y.topk(min(k, y.shape[-1]), -1).values  # (B, k')
    every = group.all_gather(mine).permute(1, 0, 2).reshape(y.shape[0], -1)  # (B, N*k')
    ranked = every.sort(-1, descending=True).values
    idx = torch.tensor([min(max(kk, 1), ranked.shape[1]) - 1 for kk in ks], device=y.device)
    kth = ranked.gather(1, idx[:, None])
    off = torch.tensor([kk == 0 for kk in ks], device=y.device)
    return kth.masked_fill(off[:, None], -math.inf)


def _nucleus(y: torch.Tensor, params: list[SamplingParams], cut: list[bool], start: int):
    """The last kept (value, id) of each row in `cut` whose top_p / min_p cut is clear, and the rows
    too close to a rounding decision to settle here (sorted list)."""
    B, w = y.shape
    z = group.all_gather(y.double().exp().sum(-1)).sum(0)  # (B,): the same additions on every rank
    vals, order = y.sort(dim=-1, descending=True, stable=True)  # this rank's columns in key order
    ids = (order + start).double()
    todo, bounds, unsure, m = [r for r in range(B) if cut[r]], {}, [], min(FIRST_M, w)
    while todo:
        sent = group.all_gather(torch.stack((vals[:, :m].double(), ids[:, :m]), -1))  # (N, B, m, 2)
        left = []
        for r in todo:
            found = _cut_row(sent[:, r], m >= w, params[r], z[r].item(), mass_tol(w * dist.get_world_size()))
            if found is None:
                left.append(r)
            elif found == "unsure":
                unsure.append(r)
            else:
                bounds[r] = found
        todo = left
        if m >= w:
            assert not todo  # with every pair sent, each row is decided
            break
        m = min(2 * m, w)
        if todo and 4 * m > w:  # deep cuts: gathering those rows whole is cheaper than more rounds
            unsure += todo
            break
    return bounds, sorted(unsure)


def _cut_row(sent: torch.Tensor, complete: bool, p: SamplingParams, z: float, tol: float):
    """sent (N, m, 2): each rank's best m (value, id) of one row. -> (v*, id*) of the last kept token,
    "unsure" (too close to call in fp32), or None (the cut lies past what is certain yet)."""
    v, ids = sent[..., 0].reshape(-1), sent[..., 1].reshape(-1)
    order = value_then_id(v, ids)
    v, ids = v[order], ids[order]
    n = v.numel()
    if not complete:  # certain up to the smallest last-sent key of any rank
        lasts = sent[:, -1]  # (N, 2)
        first = min(range(lasts.shape[0]), key=lambda r: (-lasts[r, 0].item(), lasts[r, 1].item()))
        n = int(((v == lasts[first, 0]) & (ids == lasts[first, 1])).nonzero()[0, 0]) + 1
        if v[n - 1] == -math.inf:
            complete = True  # the certain part reaches the top_k-filtered tail: every survivor is in it
    v, ids = v[:n], ids[:n]
    finite = int(v.isfinite().sum())
    e = v[:finite].exp()  # exp(v_0) = 1: v is the shifted logit, its max is 0
    keep = finite
    if p.top_p < 1:
        before = torch.cat((e.new_zeros(1), e.cumsum(0)[:-1])) / z  # mass of the higher-ranked tokens
        over = (before >= p.top_p + tol).nonzero()
        if not complete and not len(over):
            return None
        if ((before[1:] - p.top_p).abs() <= tol).any():
            return "unsure"
        keep = min(keep, max(int((before >= p.top_p).nonzero()[0, 0]) if (before >= p.top_p).any() else finite, 1))
    if p.min_p > 0:
        below = (e < p.min_p * (1 - RATIO_TOL)).nonzero()
        if not complete and not len(below):
            return None
        if ((e[1:] - p.min_p).abs() <= RATIO_TOL * p.min_p).any():
            return "unsure"
        keep = min(keep, max(int((e < p.min_p).nonzero()[0, 0]) if (e < p.min_p).any() else finite, 1))
    return v[keep - 1].item(), ids[keep - 1].item()
