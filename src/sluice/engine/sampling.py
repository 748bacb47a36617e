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

The tensor math is filtering.py's (the torch path, and the reference); a step runs as one native call
(sample.py) wherever that kernel can prove it draws the same tokens, and through filtering.py elsewhere.
"""

from __future__ import annotations

import torch

from . import sample
# filter_logits, filtered_probs and penalize_seen are imported from here across sluice, so re-exported.
from .filtering import (COLUMNS, filter_flags, filter_logits, filtered_probs, penalize_counts,  # noqa: F401
                        penalize_seen, race, row_tensors, row_values, uses_counts)
from .noise import RowStream
# SamplingParams lives in sampling_params.py; it is imported from here across sluice, so re-exported.
from .sampling_params import DEFAULT_MAX_TOKENS, SamplingParams  # noqa: F401  (re-exported)
from .select import argmax_rows, nonfinite_rows, top_candidates, value_then_id  # noqa: F401  (re-exported)

# The token a sampler returns for a row whose logits hold a NaN or an inf: no token can be drawn
# from them, and finding out here costs no host sync; the caller sees it when it reads the ids.
NONFINITE = -1


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
        self.rows = row_tensors(self.params, vocab_size, self.device)
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
        self._use_counts = any(uses_counts(p) for p in self.params)
        if self._use_counts and self.counts is None:
            # Rows that ran before had no such penalty, so their missing history matters to nobody.
            self.counts = torch.zeros(self.seen.shape, device=self.device)
        self._filters = filter_flags(self.params)
        self._packed = sample.pack(self.rows)

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
        themselves and their penalty state, whose tensors become views of its own (write_back()).
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
        self._parts, self._views, r = samplers, [], 0
        for s in samplers:  # each part's state becomes a view of ours, so a call updates theirs in place
            s.seen = self.seen[r:r + len(s.params)]
            s.counts = None if self.counts is None else self.counts[r:r + len(s.params)]
            self._views.append((s.seen, s.counts))
            r += len(s.params)
        self._refresh_flags()
        return self

    def write_back(self) -> None:
        """After a call on a joined() sampler: each part's seen mask and counts as the call left them.
        They are views of this sampler's already (8 rows' copies cost more than the rest of a step);
        only a part whose tensors were replaced since joined() gets a copy."""
        r = 0
        for s, (seen, counts) in zip(self._parts, self._views, strict=True):
            n = len(s.params)
            if s.seen is not seen and self._use_penalty:
                s.seen.copy_(self.seen[r:r + n])
            if s.counts is not counts and self.counts is not None:
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
        for (name, _), value in zip(COLUMNS, row_values(p, self.vocab_size), strict=True):
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
        accepted guesses): marked seen where a repetition penalty reads it (as __call__ keeps it) and, where
        counts are kept, counted."""
        if not self._use_penalty and self.counts is None:
            return
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device).reshape(-1)
        if self._use_penalty:
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
            x = penalize_counts(x, self.counts[pick, cols], self.rows["presence"][pick], self.rows["frequency"][pick])
        return x

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of any float dtype -> (B,) int64 next tokens, NONFINITE for a row whose
        logits are not all finite."""
        assert logits.shape == self.seen.shape, f"logits {tuple(logits.shape)} != {tuple(self.seen.shape)}"
        x = logits.float()
        tokens = sample.draw(x, self._packed, self.seen if self._use_penalty else None,
                             self.counts if self._use_counts else None, self._streams)
        if tokens is not None:  # the native draw: the tokens below, or None where it could not be sure
            for i in self._sampled_rows:
                self._streams[i].advance()
            return tokens
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
            drawn = race(xs, self._sampled_params, self._filters, streams)
            for r in streams:
                r.advance()
            tokens = tokens.index_copy(0, self._sampled_index, drawn) if some else drawn
        if self._use_penalty:
            self.seen.scatter_(1, tokens[:, None], True)
        if self._use_counts:
            self.counts.scatter_add_(1, tokens[:, None], self._ones)
        return tokens.masked_fill(broken, NONFINITE)
