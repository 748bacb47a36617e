"""The sampler's tensor math in torch (sampling.py's docstring gives the rules): the path every draw
takes where the native kernel (sample.py) does not, the reference the kernel must equal, and what
filtered_probs, the fused head and the tensor-parallel shards build on."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .noise import RowStream, log_exp_noise, uniforms_at, uniforms_range
from .sampling_params import SamplingParams
from .select import sort_descending, top_candidates


def row_values(p: SamplingParams, vocab_size: int) -> tuple:
    """One row's params as plain numbers, in the order of COLUMNS."""
    greedy = p.temperature == 0
    top_k = vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size)
    # Greedy rows never use the filtered logits; temperature 1 just keeps the division finite.
    return (1.0 if greedy else p.temperature, greedy, top_k, p.top_p, p.min_p, p.repetition_penalty,
            p.presence_penalty, p.frequency_penalty)


COLUMNS = (
    ("temperature", torch.float32),
    ("greedy", torch.bool),
    ("top_k", torch.int64),
    ("top_p", torch.float32),
    ("min_p", torch.float32),
    ("penalty", torch.float32),
    ("presence", torch.float32),
    ("frequency", torch.float32),
)


def row_tensors(params: list[SamplingParams], vocab_size: int, device) -> dict[str, torch.Tensor]:
    columns = list(zip(*(row_values(p, vocab_size) for p in params), strict=True)) or [()] * len(COLUMNS)
    return {name: torch.tensor(col, dtype=dt, device=device) for (name, dt), col in zip(COLUMNS, columns, strict=True)}


def penalize_seen(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    # CTRL / HF rule: divide positive logits and multiply negative ones, so a penalty > 1 always
    # makes a seen token less likely whatever the sign of its logit.
    p = penalty[:, None]
    return torch.where(seen, torch.where(x < 0, x * p, x / p), x)


def penalize_counts(x: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                     frequency: torch.Tensor) -> torch.Tensor:
    # A row with both penalties 0 subtracts exact zeros, so it is left bit-identical.
    c = counts.to(x.dtype)
    return x - presence[:, None] * (c > 0) - frequency[:, None] * c


def uses_counts(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0


def _descending(x: torch.Tensor, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The first L columns of x's stable descending sort (values, vocabulary ids), (B, L): every
    token a filter can keep lies among them. L = V unless every sampled row has top_k on, when
    the k largest suffice: top_k keeps exactly the tokens >= the k-th value (ties included), and
    top_p / min_p only cut that set further. Sorting 8,192 fp32 logits took 0.6 ms a row on the
    2-core CPU, topk(40) 0.03 ms; the sampler cost more than the bundled model's step."""
    V = x.shape[1]
    k = rows["top_k"].masked_fill(rows["greedy"], 1)  # greedy rows never use the filtered logits
    kmax = int(k.max())  # a host read of B numbers: the rows' params, not a result
    if 4 * kmax > V:  # top_k off somewhere (k = V), or too large to pay off
        return sort_descending(x)
    values, ids, after = top_candidates(x, kmax)  # select.py: 0.1 ms less than topk at 4 rows
    # A tie with a row's k-th value that continues past the kmax taken (possible only when
    # k = kmax) would keep a token outside them: more than kmax values are >= the k-th exactly
    # when the (kmax + 1)-th largest is. Then the full sort decides.
    kth = values.gather(1, k[:, None] - 1)
    if bool((after[:, None] >= kth).any()):
        return sort_descending(x)
    return values, ids


def _scaled(x: torch.Tensor, rows: dict) -> torch.Tensor:
    # Subtracting the max first keeps tiny temperatures from overflowing to +inf (and NaN).
    return (x - x.amax(-1, keepdim=True)) / rows["temperature"][:, None]


def filter_logits(x: torch.Tensor, rows: dict, use_top_k: bool, use_top_p: bool, use_min_p: bool) -> torch.Tensor:
    """(B, V) fp32 penalised logits -> temperature-scaled logits with filtered tokens at -inf."""
    x = _scaled(x, rows)
    if not (use_top_k or use_top_p or use_min_p):
        return x
    _, order, keep = _candidates(x, rows, use_top_k, use_top_p, use_min_p)
    return _unkept_to_minus_inf(x, order, keep)


def _unkept_to_minus_inf(x: torch.Tensor, order: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x (B, V) with -inf where the candidates' keep mask (B, L) in sort order `order` says no."""
    mask = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, keep)  # back to vocabulary order
    return x.masked_fill(~mask, -math.inf)


def _candidates(x: torch.Tensor, rows: dict, use_top_k: bool, use_top_p: bool,
                use_min_p: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filters on scaled logits x (B, V): (values, vocabulary ids, kept), each (B, L), the first L
    columns of x's stable descending sort. Every token outside them is filtered out."""
    # One sort serves all three filters: each keeps a prefix of the descending order.
    sorted_x, order = _descending(x, rows) if use_top_k else sort_descending(x)  # (B, L)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if use_top_k:
        k = rows["top_k"].clamp(max=sorted_x.shape[1])  # only greedy rows can exceed a prefix's L
        kth = sorted_x.gather(1, k[:, None] - 1)  # (B, 1); off rows have k = V
        keep &= sorted_x >= kth
    if use_top_p or use_min_p:
        # keep is all True unless top_k cut: then the mask would copy the row for nothing
        probs = (sorted_x.masked_fill(~keep, -math.inf) if use_top_k else sorted_x).softmax(-1)
        if use_top_p:
            top_p = rows["top_p"][:, None]
            mass_before = F.pad(probs.cumsum(-1)[:, :-1], (1, 0))  # mass of the higher-ranked tokens
            # top_p == 1 is "off" explicitly: rounding could otherwise drop a far-tail token.
            keep &= (mass_before < top_p) | (top_p >= 1)
        if use_min_p:
            keep &= probs >= rows["min_p"][:, None] * probs[:, :1]
    keep[:, 0] = True
    return sorted_x, order, keep


def race(x: torch.Tensor, rows: dict, flags: tuple[bool, bool, bool], streams: list[RowStream]) -> torch.Tensor:
    """(B,) the exponential race's winners: argmax of filtered(x) - log E, from the penalised logits x
    (B, V) and the rows' streams (noise.py) at their current draws. When the filters leave a prefix of
    the sort (every row has top_k), only its L candidates race, with their own noise: the same keys and
    the same winner as the whole row's race, the lowest id among equal keys as a full-row argmax picks
    it; 0.2 ms less a step at 8 rows, half of them sampled, than scattering the keep mask back."""
    scaled = _scaled(x, rows)
    V = x.shape[1]
    if not any(flags):
        return (scaled - log_exp_noise(uniforms_range(streams, 0, V))).argmax(-1)
    values, ids, keep = _candidates(scaled, rows, *flags)
    if values.shape[1] == V:
        return (_unkept_to_minus_inf(scaled, ids, keep) - log_exp_noise(uniforms_range(streams, 0, V))).argmax(-1)
    key = values.masked_fill(~keep, -math.inf) - log_exp_noise(uniforms_at(streams, ids))
    first = torch.where(key == key.amax(-1, keepdim=True), ids, V)
    return first.amin(-1)


def filter_flags(params: list[SamplingParams]) -> tuple[bool, bool, bool]:
    # Branching on the static params list (not on tensor values) skips the sort when unused.
    sampled = [p for p in params if p.temperature > 0]
    return (
        any(p.top_k > 0 for p in sampled),
        any(p.top_p < 1 for p in sampled),
        any(p.min_p > 0 for p in sampled),
    )


def filtered_probs(
    logits: torch.Tensor, params: SamplingParams | list[SamplingParams], seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None, tail_cuts: bool = True,
) -> torch.Tensor:
    """The exact distribution the sampler draws from: (V,) or (B, V) logits -> fp32 probs.

    params is one SamplingParams for every row or a list with one per row. seen is an optional
    bool mask of the same shape (tokens the repetition penalty applies to); counts an optional
    tensor of the same shape, how often each token was generated (for the presence / frequency
    penalties). Greedy rows get a one-hot on the argmax. tail_cuts=False leaves top_p and min_p out
    (speculative decoding's draft proposes from that: see proposers.py).
    """
    single = logits.dim() == 1
    x = logits.float().reshape(-1, logits.shape[-1])
    B, V = x.shape
    plist = [params] * B if isinstance(params, SamplingParams) else list(params)
    plist = [p.with_defaults(None) for p in plist]
    rows = row_tensors(plist, V, x.device)
    if seen is not None:
        x = penalize_seen(x, seen.reshape(B, V), rows["penalty"])
    if counts is not None:
        x = penalize_counts(x, counts.reshape(B, V), rows["presence"], rows["frequency"])
    use_top_k, use_top_p, use_min_p = filter_flags(plist)
    probs = filter_logits(x, rows, use_top_k, use_top_p and tail_cuts, use_min_p and tail_cuts).softmax(-1)
    if any(p.temperature == 0 for p in plist):  # from the params, not the tensor: no host read
        one_hot = F.one_hot(x.argmax(-1), V).to(probs.dtype)
        probs = torch.where(rows["greedy"][:, None], one_hot, probs)
    return probs[0] if single else probs
