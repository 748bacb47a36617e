"""What guesses the next tokens for speculative decoding (verify.py): a draft model, or prompt lookup.

A proposer's propose(rows) fills each decoding row's `guesses` (at most row.cap of them) and `q` (the
draft's filtered distribution of each guess; None for a guess picked without one, a point mass).
prefill(rows) sees the step's prompt chunks; refresh() starts a busy period.
"""

from __future__ import annotations

import numpy as np
import torch

from ..model.layers import Transformer
from . import accept as accept_kernel
from .batch_forward import BatchForward
from .fast_step import FastStep
from .paged_cache import BlockPool
from .plan import Row
from .sample import LANES
from .sampling import argmax_rows, nonfinite_rows
from .spec_probs import RoundProbs
from .speculative import draw
from .verify import grow, has_penalty_state, penalty_state


class DraftProposer:
    """A smaller model with the target's vocabulary, over its own KV pool with the target pool's block
    ids: a sequence's block j holds the target's and the draft's keys and values of the same tokens,
    so the scheduler's blocks, preemption and prefix cache serve both.

    The draft prefills each prompt chunk with the target. At a round it reads the tokens the target
    accepted since the draft last ran, from max(what it holds, the last two tokens): always at least
    two, so after a round that kept every guess (the draft never read its last guess) and after one
    that rejected (the draft's slot for the rejected guess is rewritten) the rows share one shape.
    Every draft slot below SpecState.draft_valid holds an accepted token's keys and values, which is
    what the scheduler keys a full block by."""

    def __init__(self, model: Transformer, pool: BlockPool, native: bool = True):
        self.model, self.pool = model, pool
        self.forward = BatchForward(model, pool, native)
        self.probs = RoundProbs()  # the draft's q, its rows' params kept across guesses and rounds

    def refresh(self) -> None:
        self.forward.refresh()

    def prefill(self, rows: list[Row]) -> None:
        for r in rows:
            self.forward.feed([r], [r.tokens], [r.start], None)
            r.seq.spec.draft_valid = r.start + len(r.tokens)

    @torch.inference_mode()
    def propose(self, rows: list[Row]) -> None:
        if not rows:
            return
        starts = [min(r.seq.spec.draft_valid, len(r.seq.ids) - 2) for r in rows]
        if self._native_round(rows, starts):
            return
        logits = [None] * len(rows)
        pairs = [i for i, (r, s) in enumerate(zip(rows, starts, strict=True)) if len(r.seq.ids) - s == 2]
        if pairs:  # the usual round: every row reads two tokens
            out = self.forward.feed([rows[i] for i in pairs], [rows[i].seq.ids[-2:] for i in pairs],
                                    [starts[i] for i in pairs], "last")
            for j, i in enumerate(pairs):
                logits[i] = out[j]
        for i, (r, s) in enumerate(zip(rows, starts, strict=True)):
            if logits[i] is None:  # more to catch up on (a draft state that fell behind): alone
                logits[i] = self.forward.feed([r], [r.seq.ids[s:]], [s], "last")[0]
        self._guess(rows, torch.stack(logits))

    def _native_round(self, rows: list[Row], starts: list[int]) -> bool:
        """The usual round (every row reads its last two tokens), every forward and guess of it in one native
        call (step.cpp's guess: the loop of _guess, the same forwards and draws, so the same guesses), where the
        draft runs on the native step and every row is plain greedy or takes the native filter (no penalties,
        no top_k or min_p); True when it made the guesses. False changed nothing that _guess does not make
        again with the same values (the draft's cache slots for these positions)."""
        fast = self.forward.fast if self.forward.use_fast else None
        if not isinstance(fast, FastStep) or not LANES or any(len(r.seq.ids) - s != 2 for r, s in zip(rows, starts)):
            return False
        samplers = [r.seq.sampler for r in rows]
        greedy = all(s.plain_greedy for s in samplers)
        if greedy:
            temperature = [0.0] * len(rows)
        else:
            if has_penalty_state(samplers):  # the penalties' state: _guess filters those rows
                return False
            columns = self.probs.native_columns(samplers, self.model.config.vocab_size, self.forward.device)
            if columns is None:
                return False
            temperature = columns[0].tolist()  # 0 on a greedy row
        sampled = [s.params[0].temperature > 0 for s in samplers]  # (none in a plain greedy batch)
        streams = [s.streams[0] for s in samplers]
        caps = [r.cap for r in rows]
        guesses, q, deferred = fast.guess([t for r in rows for t in r.seq.ids[-2:]], starts, self.pool.k, self.pool.v,
                                          [r.seq.blocks for r in rows], caps, temperature, sampled,
                                          [s.key for s in streams], [s.draws for s in streams], not greedy, LANES)
        if deferred:
            return False
        for i, r in enumerate(rows):
            if sampled[i]:
                streams[i].draws += caps[i]  # a draw per guess, as _guess advances them
            r.guesses = guesses[i]
            r.q = None if greedy else q[i, :caps[i]]
            r.seq.spec.draft_valid = len(r.seq.ids) + caps[i] - 1  # the draft read every guess but the last
        return True

    def _guess(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Draw each row's guesses from the draft, one forward per guess after the first. A sampled row
        proposes from the draft's distribution under the row's penalties, temperature and top_k, but not
        its top_p or min_p: the acceptance rule gives the target's law whatever the proposal, and those
        two cuts need the whole row sorted at every guess (the round cost more than its forwards on the
        bundled model), for a few points of acceptance (the tail they cut is small). The guesses
        stay in a tensor that feeds the next forward; the host reads them once, at the end (greedy
        rows: a row whose draft went non-finite is cut there then; sampled rows stop drawing at once,
        so their random streams advance only for the guesses they make)."""
        samplers = [r.seq.sampler for r in rows]
        greedy = all(s.plain_greedy for s in samplers)
        params = [s.params[0] for s in samplers]
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        streams = [s.streams[0] for s in samplers]
        seen, counts = penalty_state(rows)  # grows with each guess, as the context does
        B, K, V = len(rows), max(r.cap for r in rows), logits.shape[-1]
        tokens = torch.zeros(B, K, dtype=torch.long, device=logits.device)
        finite = torch.zeros(B, K, dtype=torch.bool, device=logits.device)
        q = None if greedy else logits.new_zeros(B, K, V, dtype=torch.float32)
        alive = list(range(B))
        for j in range(K):
            if j:
                alive = [i for i in alive if rows[i].cap > j]
                if not alive:
                    break
                prev = tokens[:, j - 1:j] if len(alive) == B else tokens[alive, j - 1:j]
                out = self.forward.feed([rows[i] for i in alive], prev,
                                        [len(rows[i].seq.ids) - 1 + j for i in alive], "last")
                if len(alive) == B:
                    logits = out
                else:
                    logits[alive] = out
            if greedy:
                tokens[:, j], broken = argmax_rows(logits.float())
            else:
                racing = [i for i in sampled if i in alive]
                columns = None if seen is not None or counts is not None else self.probs.native_columns(
                    samplers, V, logits.device)
                fused = None if columns is None else accept_kernel.propose(logits.float(), columns[0], racing, streams)
                if fused is None:
                    broken = nonfinite_rows(logits)
                    probs = self.probs(logits, samplers, 1, seen, counts, tail_cuts=False)
                    tokens[:, j] = draw(probs, racing, streams)
                else:  # one native call, which takes finite logits only
                    broken = torch.zeros(B, dtype=torch.bool, device=logits.device)
                    probs, tokens[:, j] = fused
                seen, counts = grow(seen, counts, tokens[:, j])
                q[:, j] = probs
                # a draft gone non-finite guesses nothing more (its q is no distribution)
                alive = [i for i, bad in zip(alive, broken[alive].tolist(), strict=True) if not bad]
            finite[:, j] = ~broken
        kept = (finite.long().cumprod(-1).sum(-1)).tolist()
        host = tokens.tolist()
        for i, r in enumerate(rows):
            n = min(kept[i], r.cap)
            r.guesses = host[i][:n]
            r.q = None if greedy else q[i, :n]
            # The draft read every guess but the last: its slots hold the row's tokens up to there.
            r.seq.spec.draft_valid = len(r.seq.ids) + max(n - 1, 0)


class PromptLookup:
    """Guesses by n-gram match, with no second model: find the longest suffix of the text so far (max_ngram
    tokens, down to min_ngram) that occurred before in the prompt or the generated text, and guess the k
    tokens that followed it. Pays where the output repeats its input (editing code, quoting, extraction)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def refresh(self) -> None:
        pass

    def prefill(self, rows: list[Row]) -> None:
        pass

    def propose(self, rows: list[Row]) -> None:
        for r in rows:
            r.guesses, r.q = lookup(r.seq.ids, r.cap, self.max_ngram, self.min_ngram), None


def lookup(history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix of history."""
    h = np.asarray(history)
    L = len(h)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        # Windows start at 0 .. L-1-n: each is followed by at least one token, and the suffix itself is not one.
        starts = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(h[: L - 1], n) == h[L - n :]).all(1))
        if starts.size:
            # The latest match with k tokens after it (recent text is the likeliest to repeat), else the latest.
            full = starts[starts + n + k <= L]
            i = int(full[-1] if full.size else starts[-1])
            return h[i + n : i + n + k].tolist()
    return []
