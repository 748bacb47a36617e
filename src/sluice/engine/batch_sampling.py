"""How the scheduler (scheduler.py) turns one step's logits into tokens: the head (what the logits
cover) and the draw (which rows sample together).

A head answers three things about logits (N, V): a sampler for a new sequence, the greedy argmax of
rows, and logprobs. FullHead's logits cover the whole vocabulary; under tensor parallelism
parallel/head.ParallelHead answers the same from each rank's vocabulary shard.
"""

from __future__ import annotations

import torch

from .fused_head import FusedHead
from .guide import masked
from .logprobs import token_logprobs
from .plan import Row, StepPlan
from .prompt_logprobs import record
from .sampling import NONFINITE, Sampler, SamplingParams, argmax_rows
from .sequence import Seq
from .spec_probs import RoundProbs
from .verify import verify


class FullHead:
    """The samplers, argmax and logprobs of a step whose logits cover the whole vocabulary."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device

    def sampler(self, params: SamplingParams) -> Sampler:
        return Sampler([params], self.vocab_size, self.device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        tokens, broken = argmax_rows(logits.float())  # as Sampler does
        return tokens.masked_fill(broken, NONFINITE)

    logprobs = staticmethod(token_logprobs)


class BatchDraw:
    """(N,) next tokens for the sequences at their end. Plain greedy rows (no penalty: nothing of their
    own to keep) take one argmax together; every other row its own Sampler (its stream, its penalty
    state), so a request draws exactly what it would alone.

    Rows that sample are joined into one sampler (one sort for every filtered row), kept while the rows
    stay the same: joining costs ~0.2 ms a step at 8 rows, and the batch changes only when a sequence
    joins or leaves. The kept one holds the rows' penalty state, copied back after each call."""

    def __init__(self, head):
        self.head = head
        self._joined: tuple[list[int], Sampler] | None = None  # (sequence ids, the joined sampler)

    def forget(self) -> None:
        """Drop the kept joined sampler: the rows' penalty state changed outside it (a speculative round)."""
        self._joined = None

    def __call__(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor:
        kept, self._joined = self._joined, None  # only a joined draw keeps it; other paths drop it
        if all(s.sampler.plain_greedy for s in seqs):
            return self.head.argmax(logits)
        if len(seqs) == 1:
            return seqs[0].sampler(logits)
        key = [s.id for s in seqs]
        joined = kept[1] if kept and kept[0] == key else type(seqs[0].sampler).joined([s.sampler for s in seqs])
        tokens = joined(logits)
        joined.write_back()
        self._joined = (key, joined)
        return tokens


class StepDraw:
    """The draw stage of a step (plan.py): each final row's run of new tokens and their logprobs.

    Rows without guesses draw one token: through BatchDraw from logits, or through the fused LM head
    (fused_head.py) from hidden states when the plan says fused; rows with guesses keep a prefix of
    them (verify.py). A constrained row's logits are masked first (guide.py), on every path; logprobs
    are of the raw logits at each emitted token's position; the prompt logprobs of the rows that computed
    some (prompt_logprobs.py) are recorded here too."""

    def __init__(self, model, head, decode_one):
        self.model, self.head, self.decode_one = model, head, decode_one
        self.batch = BatchDraw(head)
        self.start = getattr(head, "start", 0)  # the first vocabulary id of the logits' columns
        self.fused_calls = self.fused_filtered = self.fused_fallback = 0  # what "auto" decides on
        self.round_probs = RoundProbs()  # a speculative round's target probabilities, its params kept

    @property
    def fallback_rate(self) -> float:
        return self.fused_fallback / self.fused_filtered if self.fused_filtered else 0.0

    def __call__(self, plan: StepPlan, out: dict) -> tuple[dict[Row, list[int]], dict[Row, list]]:
        record(getattr(out, "prompt", {}), self.head, self.decode_one)
        runs: dict[Row, list[int]] = {}
        plain, guessing = [], []
        for r in plan.finals:
            (guessing if r.guesses else plain).append(r)
        if guessing or plan.fused:
            self.batch.forget()
        if plain:
            seqs = [r.seq for r in plain]
            batch = getattr(out, "batch", None)  # forward's stacked one-token rows (batch_forward.StepOut)
            x = batch[1] if batch is not None and batch[0] == plain else torch.stack([out[r] for r in plain])
            if not plan.fused:  # the scheduler never fuses a constrained row
                x = masked(x, [s.guide and s.guide.allowed() for s in seqs], self.start)
            tokens = (self._fused(seqs, x) if plan.fused else self.batch(seqs, x)).tolist()  # the step's host sync
            runs.update((r, [t]) for r, t in zip(plain, tokens, strict=True))
        if guessing:
            logits = [out[r] if r.seq.guide is None else
                      masked(out[r], list(r.seq.guide.allowed_along(r.guesses)), self.start) for r in guessing]
            runs.update(zip(guessing, verify(guessing, logits, self.round_probs), strict=True))
            for r in guessing:  # what plain sampling would have recorded, token by token
                r.seq.sampler.add_generated(0, [t for t in runs[r] if t != NONFINITE])
        return runs, self._logprobs(plan, out, runs)

    def _fused(self, seqs: list[Seq], hidden: torch.Tensor) -> torch.Tensor:
        samplers = [s.sampler for s in seqs]
        sampler = samplers[0] if len(samplers) == 1 else Sampler.joined(samplers)
        head = FusedHead(sampler)
        w = self.model.lm_head.weight  # in engine/mixed.py's mode hidden is fp32 and w bf16: as the bf16 head
        out = head(hidden.to(w.dtype), w, self.model.final_softcap)
        if len(samplers) > 1:
            sampler.write_back()
        for s, fell in zip(seqs, out.fallback.tolist(), strict=True):
            s.fused_steps += 1
            s.fused_fallbacks += fell
        self.fused_calls += head.calls
        self.fused_filtered += head.rows_filtered
        self.fused_fallback += head.rows_fallback
        return out.tokens

    def _logprobs(self, plan: StepPlan, out: dict, runs: dict) -> dict[Row, list]:
        """{row: TokenLogprob per token of its run} for the rows whose params ask for logprobs: the rows
        that drew one token together, in one call (one host sync), a speculating row's run on its own."""
        found, rows, tokens = {}, [], []
        for r in plan.finals:
            if r.seq.params.logprobs is None:
                continue
            run = [t for t in runs[r] if t != NONFINITE]
            if not run:
                continue
            if r.guesses:
                found[r] = self.head.logprobs(out[r][: len(run)], torch.tensor(run), [r.seq.params.logprobs] * len(run),
                                              self.decode_one)
            else:
                rows.append(r)
                tokens += run
        if rows:
            lps = self.head.logprobs(torch.stack([out[r] for r in rows]), torch.tensor(tokens),
                                     [r.seq.params.logprobs for r in rows], self.decode_one)
            found.update((r, [lp]) for r, lp in zip(rows, lps, strict=True))
        return found
