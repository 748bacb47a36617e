"""A batched sampler with no host syncs (its validated SamplingParams are in sampling_params.py).

Logits are processed in fp32 in the order HF's generate and vLLM use:

    repetition penalty -> presence / frequency penalties -> temperature -> top_k -> top_p -> min_p -> sample

Each filter sees the distribution the previous one left (top_p renormalises over the top_k
survivors). The top-1 token always survives, so no filter can leave a row empty.
Conventions where the reference libraries differ or are vague:

- top_k: 0 and -1 both mean off. Tokens tied with the k-th largest logit are all kept (HF's rule),
  so a row may keep more than k tokens.
- top_p: keep the smallest prefix of the tokens sorted by probability whose mass reaches top_p.
  Equal probabilities are ordered by token id (stable sort), which decides ties at the cut.
- min_p: keep tokens with p >= min_p * p_max. The ratio does not change under renormalisation,
  so it does not matter whether min_p sees probabilities before or after top_p renormalised them.
- presence / frequency penalties (OpenAI's): logit[t] -= presence * (count[t] > 0) + frequency * count[t],
  where count[t] is how often t was *generated* so far (the prompt does not count, unlike the
  repetition penalty's mask). Subtracted after the repetition penalty, as vLLM does.
- temperature 0 is greedy: argmax of the penalised logits, no filters, no randomness.

Sampling is the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability
p_i, with no cumulative sums, no torch.multinomial and nothing read back to the host. It is done
in log space, argmax(logit_i - log E_i), so tiny probabilities do not underflow. The Exp(1) draws
come from engine/noise.py: counter-based, E_i a function of the row's seed, its draw count and the
token id i, so a row makes noise only for the tokens that race (the top-k candidates when top_k is
on), and every sampler in sluice (this one, the joined one, the fused head, the tensor-parallel
shards, speculative decoding's) gives a token the same noise at the same draw.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# SamplingParams lives in sampling_params.py; it is imported from here across sluice, so re-exported.
from .noise import RowStream, log_exp_noise, uniforms_at, uniforms_range
from .sampling_params import DEFAULT_MAX_TOKENS, SamplingParams  # noqa: F401  (re-exported)
from .select import argmax_rows, nonfinite_rows, top_candidates, value_then_id  # noqa: F401  (re-exported)

# The token a sampler returns for a row whose logits hold a NaN or an inf: no token can be drawn
# from them, and finding out here costs no host sync; the caller sees it when it reads the ids.
NONFINITE = -1


# ---------------------------------------------------------------- tensor math, shared by both users

def _row_values(p: SamplingParams, vocab_size: int) -> tuple:
    """One row's params as plain numbers, in the order of _COLUMNS."""
    greedy = p.temperature == 0
    top_k = vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size)
    # Greedy rows never use the filtered logits; temperature 1 just keeps the division finite.
    return (1.0 if greedy else p.temperature, greedy, top_k, p.top_p, p.min_p, p.repetition_penalty,
            p.presence_penalty, p.frequency_penalty)


_COLUMNS = (
    ("temperature", torch.float32),
    ("greedy", torch.bool),
    ("top_k", torch.int64),
    ("top_p", torch.float32),
    ("min_p", torch.float32),
    ("penalty", torch.float32),
    ("presence", torch.float32),
    ("frequency", torch.float32),
)


def _row_tensors(params: list[SamplingParams], vocab_size: int, device) -> dict[str, torch.Tensor]:
    columns = list(zip(*(_row_values(p, vocab_size) for p in params), strict=True)) or [()] * len(_COLUMNS)
    return {name: torch.tensor(col, dtype=dt, device=device) for (name, dt), col in zip(_COLUMNS, columns, strict=True)}


def penalize_seen(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    # CTRL / HF rule: divide positive logits and multiply negative ones, so a penalty > 1 always
    # makes a seen token less likely whatever the sign of its logit.
    p = penalty[:, None]
    return torch.where(seen, torch.where(x < 0, x * p, x / p), x)


def _penalize_counts(x: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                     frequency: torch.Tensor) -> torch.Tensor:
    # A row with both penalties 0 subtracts exact zeros, so it is left bit-identical.
    c = counts.to(x.dtype)
    return x - presence[:, None] * (c > 0) - frequency[:, None] * c


def _uses_counts(p: SamplingParams) -> bool:
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
        return x.sort(dim=-1, descending=True, stable=True)
    values, ids, after = top_candidates(x, kmax)  # select.py: 0.1 ms less than topk at 4 rows
    # A tie with a row's k-th value that continues past the kmax taken (possible only when
    # k = kmax) would keep a token outside them: more than kmax values are >= the k-th exactly
    # when the (kmax + 1)-th largest is. Then the full sort decides.
    kth = values.gather(1, k[:, None] - 1)
    if bool((after[:, None] >= kth).any()):
        return x.sort(dim=-1, descending=True, stable=True)
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
    sorted_x, order = _descending(x, rows) if use_top_k else x.sort(dim=-1, descending=True, stable=True)  # (B, L)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if use_top_k:
        k = rows["top_k"].clamp(max=sorted_x.shape[1])  # only greedy rows can exceed a prefix's L
        kth = sorted_x.gather(1, k[:, None] - 1)  # (B, 1); off rows have k = V
        keep &= sorted_x >= kth
    if use_top_p or use_min_p:
        probs = sorted_x.masked_fill(~keep, -math.inf).softmax(-1)
        if use_top_p:
            top_p = rows["top_p"][:, None]
            mass_before = F.pad(probs.cumsum(-1)[:, :-1], (1, 0))  # mass of the higher-ranked tokens
            # top_p == 1 is "off" explicitly: rounding could otherwise drop a far-tail token.
            keep &= (mass_before < top_p) | (top_p >= 1)
        if use_min_p:
            keep &= probs >= rows["min_p"][:, None] * probs[:, :1]
    keep[:, 0] = True
    return sorted_x, order, keep


def _race(x: torch.Tensor, rows: dict, flags: tuple[bool, bool, bool], streams: list[RowStream]) -> torch.Tensor:
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


def _flags(params: list[SamplingParams]) -> tuple[bool, bool, bool]:
    # Branching on the static params list (not on tensor values) skips the sort when unused.
    sampled = [p for p in params if p.temperature > 0]
    return (
        any(p.top_k > 0 for p in sampled),
        any(p.top_p < 1 for p in sampled),
        any(p.min_p > 0 for p in sampled),
    )


def filtered_probs(
    logits: torch.Tensor, params: SamplingParams | list[SamplingParams], seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact distribution the sampler draws from: (V,) or (B, V) logits -> fp32 probs.

    params is one SamplingParams for every row or a list with one per row. seen is an optional
    bool mask of the same shape (tokens the repetition penalty applies to); counts an optional
    tensor of the same shape, how often each token was generated (for the presence / frequency
    penalties). Greedy rows get a one-hot on the argmax.
    """
    single = logits.dim() == 1
    x = logits.float().reshape(-1, logits.shape[-1])
    B, V = x.shape
    plist = [params] * B if isinstance(params, SamplingParams) else list(params)
    plist = [p.with_defaults(None) for p in plist]
    rows = _row_tensors(plist, V, x.device)
    if seen is not None:
        x = penalize_seen(x, seen.reshape(B, V), rows["penalty"])
    if counts is not None:
        x = _penalize_counts(x, counts.reshape(B, V), rows["presence"], rows["frequency"])
    probs = filter_logits(x, rows, *_flags(plist)).softmax(-1)
    one_hot = F.one_hot(x.argmax(-1), V).to(probs.dtype)
    probs = torch.where(rows["greedy"][:, None], one_hot, probs)
    return probs[0] if single else probs


class Sampler:
    """Samples one token per batch row per call, with per-row params and per-row RNG.

    Each row owns a RowStream (noise.py) keyed by its params.seed, so a row's tokens depend only on
    its own seed and logits, not on which other rows share the batch. __call__ launches device work
    only: no .item(), no host syncs, fixed shapes.
    """

    def __init__(self, params: list[SamplingParams], vocab_size: int, device="cpu", columns: int | None = None):
        """columns: the logits' width when it is not the vocabulary's (a tensor-parallel rank's shard,
        parallel/sampling.py); the seen mask and counts cover those columns."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.params = [p.with_defaults(None) for p in params]
        for p in self.params:
            p.validate(vocab_size)
        B = len(self.params)
        self.rows = _row_tensors(self.params, vocab_size, self.device)
        self.seen = torch.zeros(B, columns or vocab_size, dtype=torch.bool, device=self.device)  # (B, V)
        # (B, V) fp32 generated-token counts, made only once some row has a presence / frequency
        # penalty: a batch without them pays nothing (4 bytes a vocabulary entry a row otherwise).
        self.counts: torch.Tensor | None = None
        self._ones = torch.ones(B, 1, device=self.device)  # what one step adds to the counts
        self._streams = [RowStream(p.seed) for p in self.params]
        self._refresh_flags()

    def _refresh_flags(self) -> None:
        self._sampled_rows = [i for i, p in enumerate(self.params) if p.temperature > 0]
        self._any_greedy = len(self._sampled_rows) < len(self.params)
        # A batch with greedy rows filters and draws for its sampled rows only (their params here):
        # every filter is per row, so a row's token does not depend on which others are there.
        self._sampled_index = torch.tensor(self._sampled_rows, dtype=torch.int64, device=self.device)
        self._sampled_params = ({k: v[self._sampled_index] for k, v in self.rows.items()}
                                if self._any_greedy and self._sampled_rows else self.rows)
        self._use_penalty = any(p.repetition_penalty != 1 for p in self.params)
        self._use_counts = any(_uses_counts(p) for p in self.params)
        if self._use_counts and self.counts is None:
            # Rows that ran before had no such penalty, so their missing history matters to nobody.
            self.counts = torch.zeros(self.seen.shape, device=self.device)
        self._filters = _flags(self.params)

    @property
    def streams(self) -> list[RowStream]:
        """The rows' random streams, the objects themselves: a draw made elsewhere (speculative
        decoding's, the fused head's) advances them as this sampler's own draws do."""
        return self._streams

    @property
    def filters(self) -> tuple[bool, bool, bool]:
        """Whether some sampled row uses top_k, top_p, min_p."""
        return self._filters

    @property
    def uses_penalty(self) -> bool:
        """Whether some row has a repetition penalty (then `seen` is kept up to date)."""
        return self._use_penalty

    @property
    def plain_greedy(self) -> bool:
        """Whether every row is greedy with no penalty: then the argmax of the raw logits is all this
        sampler does (no generator or penalty state of its own to advance)."""
        return not self._sampled_rows and not self._use_penalty and not self._use_counts

    @classmethod
    def joined(cls, samplers: list[Sampler]) -> Sampler:
        """One sampler over the rows of `samplers` (the continuous-batching scheduler keeps one per
        sequence), so a step filters and draws for all of them at once. It holds their streams
        themselves and copies of their penalty state; write_back() returns that state after a call.
        A row draws exactly what its own sampler would: every operation is per row."""
        self = cls.__new__(cls)
        first = samplers[0]
        self.vocab_size, self.device = first.vocab_size, first.device
        self.params = [p for s in samplers for p in s.params]
        self.rows = {k: torch.cat([s.rows[k] for s in samplers]) for k in first.rows}
        self.seen = torch.cat([s.seen for s in samplers])
        counted = any(s.counts is not None for s in samplers)
        self.counts = torch.cat([s.counts if s.counts is not None else torch.zeros_like(s.seen, dtype=torch.float32)
                                 for s in samplers]) if counted else None
        self._ones = torch.ones(len(self.params), 1, device=self.device)
        self._streams = [r for s in samplers for r in s._streams]  # the same objects: draws advance theirs
        self._parts = samplers
        self._refresh_flags()
        return self

    def write_back(self) -> None:
        """After a call on a joined() sampler: each part's seen mask and counts as the call left them."""
        r = 0
        for s in self._parts:
            n = len(s.params)
            if self._use_penalty:
                s.seen.copy_(self.seen[r:r + n])
            if self.counts is not None:
                if s.counts is None:
                    s.counts = torch.zeros(s.seen.shape, device=s.device)
                s.counts.copy_(self.counts[r:r + n])
            r += n

    def set_row(self, row: int, params: SamplingParams, context=()) -> None:
        """Give a batch slot to a new request: new params, fresh stream, fresh penalty state.

        The other rows keep their streams, unaffected (continuous batching).
        """
        p = params.with_defaults(None)
        p.validate(self.vocab_size)
        self.params[row] = p
        for (name, _), value in zip(_COLUMNS, _row_values(p, self.vocab_size), strict=True):
            self.rows[name][row] = value
        self._streams[row] = RowStream(p.seed)
        self.seen[row] = False
        if self.counts is not None:
            self.counts[row] = 0
        self.add_context(row, context)
        self._refresh_flags()

    def add_context(self, row: int, token_ids) -> None:
        """Mark prompt tokens as seen, for the repetition penalty. Call before decoding."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device).reshape(-1)
        self.seen[row, ids] = True

    def add_generated(self, row: int, token_ids) -> None:
        """Record tokens that were generated without passing through __call__ (a speculative round's
        accepted guesses): marked seen and, where counts are kept, counted."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device).reshape(-1)
        self.seen[row, ids] = True
        if self.counts is not None:
            self.counts[row].index_add_(0, ids, torch.ones(ids.shape, device=self.device))

    def penalize(self, x: torch.Tensor, rows=None, start: int = 0) -> torch.Tensor:
        """Every penalty the rows use, on fp32 logits x (n, c): the rows `rows` (all if None) and the
        vocabulary columns start..start+c (a chunk, as engine/fused_head.py computes them)."""
        pick = slice(None) if rows is None else rows
        cols = slice(start, start + x.shape[1])
        if self._use_penalty:
            x = penalize_seen(x, self.seen[pick, cols], self.rows["penalty"][pick])
        if self._use_counts:
            x = _penalize_counts(x, self.counts[pick, cols], self.rows["presence"][pick], self.rows["frequency"][pick])
        return x

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of any float dtype -> (B,) int64 next tokens, NONFINITE for a row whose
        logits are not all finite."""
        assert logits.shape == self.seen.shape, f"logits {tuple(logits.shape)} != {tuple(self.seen.shape)}"
        x = logits.float()
        # One scan (select.py) gives each row's argmax and its NaN / inf check; with a penalty on, the
        # check stays on the raw logits (a penalty could push a huge finite logit to inf).
        tokens, broken = argmax_rows(x)  # (B,) each
        if self._use_penalty or self._use_counts:
            x = self.penalize(x)
            tokens = argmax_rows(x)[0] if self._any_greedy else None
        if self._sampled_rows:
            some = self._any_greedy  # then only the sampled rows are filtered, noised and raced
            xs = x.index_select(0, self._sampled_index) if some else x  # a row copy: 4x faster than x[idx]
            streams = [self._streams[i] for i in self._sampled_rows]
            drawn = _race(xs, self._sampled_params, self._filters, streams)
            for r in streams:
                r.advance()
            tokens = tokens.index_copy(0, self._sampled_index, drawn) if some else drawn
        if self._use_penalty:
            self.seen.scatter_(1, tokens[:, None], True)
        if self._use_counts:
            self.counts.scatter_add_(1, tokens[:, None], self._ones)
        return tokens.masked_fill(broken, NONFINITE)
