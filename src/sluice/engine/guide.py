"""Constrained decoding in the engine: each constrained sequence's grammar state (a Guide) and the
mask it puts on the logits before every draw (constraints.py says what a constraint is).

Where the mask goes: the draw stage (batch_sampling.StepDraw) masks a step's logits before any
sampler sees them: the one-token rows (greedy argmax, the joined sampler, the native sampler kernel)
and a speculating row's every position, its grammar advanced along the guesses before it (verify).
The fused LM head never takes a constrained row (it never holds a row's logits). The output stage
advances each Guide by the tokens a row keeps, and ends the row when its grammar can only end.

A disallowed token's logit becomes MASKED, not -inf: the engine reads an inf in the logits as a
broken model (NONFINITE, select.py, in the native kernels too). MASKED draws exactly as -inf would:
after any temperature in the request range (>= 1e-8) and penalty it stays below every finite logit
a model gives by far more than the race's largest noise gap, and exp() of it is exactly 0 in fp32, so
it never wins argmax or the race and never holds probability mass (top_p, min_p, the acceptance rule).

Stop tokens (eos, stop_token_ids) are allowed exactly when the grammar is complete (accepting); a row
whose grammar can take nothing more ends with "stop" at once, without a step that could only draw eos.
Logprobs stay those of the raw logits (what the model thought, not the mask).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..errors import ConstraintError
from .constraints import Constraint, llguidance

MASKED = -1e30


class Guides:
    """An engine's constrained decoding: the vocabulary as llguidance reads it (tokenizer.json's byte-level
    tokens, special tokens marked so no grammar ever matches them), built at the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=()):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._vocab = None
        self._lock = threading.Lock()

    def vocabulary(self):
        with self._lock:
            if self._vocab is None:
                llg = llguidance()
                # n_vocab covers the model's rows too (an embedding padded past the tokenizer's ids: never allowed)
                n = max(self.vocab_size, self.tokenizer.vocab_size)
                self._vocab = llg.LLTokenizer(self.tokenizer.to_json(), n_vocab=n, eos_token=self.eos_ids or None)
            return self._vocab

    def new(self, constraint: Constraint, stop_ids) -> Guide:
        """A fresh grammar state for a sequence whose stop tokens are stop_ids."""
        matcher = llguidance().LLMatcher(self.vocabulary(), constraint.llg_grammar(), log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"invalid {constraint.kind.replace('_', ' ')} for this tokenizer: {matcher.get_error()}")
        return Guide(matcher, stop_ids, self.vocab_size)


class Guide:
    """One sequence's place in its grammar (an llguidance LLMatcher over the generated tokens)."""

    def __init__(self, matcher, stop_ids, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.int64)

    @property
    def done(self) -> bool:
        """Nothing but a stop token can follow: the sequence ends here."""
        return self.matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens that may come next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():  # a grammar past llguidance's limits: advance() fails, the row ends (output_stage)
            return torch.ones(self.vocab_size, dtype=torch.bool)
        ok = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool))
        if len(self.stop_ids):
            ok[self.stop_ids] = self.matcher.is_accepting()
        return ok

    def allowed_along(self, guesses: list[int]) -> torch.Tensor:
        """(len(guesses) + 1, V) bool: what may come after each prefix of guesses (none, the first, ...).
        Positions past the first illegal guess are never read (the acceptance rule rejects it, as its
        probability is 0), so they repeat the last legal position's mask. The grammar is left as it was."""
        rows, consumed = [self.allowed()], 0
        for g in guesses:
            if consumed == len(rows) - 1 and rows[-1][g] and int(g) not in self.stop_ids.tolist() \
                    and self.matcher.consume_token(int(g)):
                consumed += 1
                rows.append(self.allowed())
            else:
                rows.append(rows[-1])
        if consumed:
            self.matcher.rollback(consumed)
        return torch.stack(rows)

    def advance(self, token: int) -> bool:
        """Take a drawn token; False if llguidance refuses it: its limits reached (a grammar too complex,
        e.g. (a{1000}){1000}, gives up as it grows its lexer), or else the mask let it through (a bug)."""
        return self.matcher.consume_token(int(token))

    @property
    def error(self) -> str:
        """Why llguidance refused (its first line), once it has."""
        return (self.matcher.get_error().splitlines() or [""])[0]


def masked(x: torch.Tensor, allowed: list[torch.Tensor | None], start: int = 0) -> torch.Tensor:
    """fp32 logits x (N, W) of vocabulary ids start..start+W (a tensor-parallel rank's shard) with each
    row i's disallowed tokens set to MASKED (allowed[i] (V,) or (W-rows, V), None: the row is free);
    x itself unchanged (its raw values give the logprobs). x as is when no row is constrained."""
    rows = [i for i, a in enumerate(allowed) if a is not None]
    if not rows:
        return x
    out = x.float().clone()
    for i in rows:
        ok = allowed[i][..., start:start + x.shape[-1]].to(x.device)
        out[i] = out[i].masked_fill(~ok, MASKED)
    return out
