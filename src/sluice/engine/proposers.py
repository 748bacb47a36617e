"""What guesses the next tokens for speculative decoding (speculative.py): a draft model, or prompt lookup.

A proposer's propose(spec, k, active) returns (tokens (B, k) int64, q (B, k, V) or None, lengths): row b
guesses tokens[b, :lengths[b]], drawn from q (the draft's filtered distributions) or, with q None, picked
without a distribution (a point mass). Rows not in `active` have finished: what they get is ignored.
"""

from __future__ import annotations

import numpy as np
import torch

from .runner import Runner
from .sampling import filtered_probs, nonfinite_rows
from .speculative import draw


class DraftProposer:
    """A smaller model with the target's vocabulary, with its own Runner and KV cache.

    Kept in step with the target: at the start of a round the draft rolls back to the target's position
    minus one and feeds the row's last two tokens (positions p-1 and p), so whatever the previous round
    kept, the draft's cache below p+1 holds exactly the accepted tokens. (After a round whose k guesses
    were all kept, the draft never saw its own last guess; after a rejection, the slot it wrote for the
    rejected guess is rewritten. Feeding two tokens every round covers both cases with one shape.)"""

    def __init__(self, runner: Runner):
        self.runner = runner

    def prefill(self, prompts: list[list[int]], num_slots: int) -> None:
        self.runner.prefill(prompts, num_slots)

    @torch.inference_mode()
    def propose(self, spec, k: int, active: list[int]):
        r = self.runner
        B, dev = len(spec.history), r.pos.device
        r.seek(spec.runner.pos - 1)
        # Every history holds a prompt token and the first generated one, so two tokens exist.
        pair = torch.tensor([h[-2:] for h in spec.history], device=dev).clamp_min(0)  # (B, 2)
        logits = r.verify(pair)[:, 1]  # (B, V)
        r.advance(2)
        greedy = spec.greedy
        seen = spec.sampler.seen.clone() if spec.penalty else None  # grows with each guess, as the context does
        rows = [i for i in spec.sampled_rows if i in active]
        tokens = torch.zeros(B, k, dtype=torch.long, device=dev)
        q = None if greedy else torch.empty(B, k, logits.shape[-1], device=dev)
        finite = torch.ones(B, k, dtype=torch.bool, device=dev)
        for i in range(k):
            if i:
                logits = r.step(tokens[:, i - 1])
            finite[:, i] = ~nonfinite_rows(logits)
            if greedy:
                tokens[:, i] = logits.argmax(-1)
                continue
            probs = filtered_probs(logits, spec.params, seen)  # the target's processing, on the draft's logits
            tokens[:, i] = draw(probs, rows, spec.streams)
            q[:, i] = probs
            if seen is not None:
                seen.scatter_(1, tokens[:, i : i + 1], True)
        # A draft gone non-finite guesses nothing from there on (its q would not be a distribution).
        lengths = finite.long().cumprod(-1).sum(-1).tolist()
        return tokens, q, lengths

    def release(self) -> None:
        self.runner.release()


class PromptLookup:
    """Guesses by n-gram match, with no second model: find the longest suffix of the text so far (max_ngram
    tokens, down to min_ngram) that occurred before in the prompt or the generated text, and guess the k
    tokens that followed it. Pays where the output repeats its input (editing code, quoting, extraction)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def prefill(self, prompts, num_slots) -> None:
        pass

    def propose(self, spec, k: int, active: list[int]):
        B = len(spec.history)
        tokens = torch.zeros(B, k, dtype=torch.long)
        lengths = [0] * B
        for b in active:
            found = lookup(spec.history[b], k, self.max_ngram, self.min_ngram)
            tokens[b, : len(found)] = torch.tensor(found, dtype=torch.long)
            lengths[b] = len(found)
        return tokens.to(spec.runner.pos.device), None, lengths

    def release(self) -> None:
        pass


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
