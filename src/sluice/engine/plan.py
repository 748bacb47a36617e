"""A scheduler step as plain data: `schedule()` makes a StepPlan, and every later stage reads it.

    schedule() -> StepPlan -> propose (speculative guesses) -> forward(plan) -> draw(plan, out)
               -> update(plan, runs) -> output stage (detokenize, stops, logprobs)

A Row is one sequence's part of the step: the tokens the model reads at positions start.. and
whether the step ends at the sequence's last known token (`final`: then its logits are drawn from).
A decoding row of a speculating engine also carries guesses: it reads its last token followed by
them, and the draw keeps a prefix of them (speculative.py). Nothing in a plan is changed after the
stage that fills it, so tensor parallelism can hand the same plan to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from .sequence import Seq


@dataclass(eq=False)
class Row:
    seq: Seq
    start: int  # position of tokens[0]
    tokens: list[int]  # what the model reads this step (a prompt chunk, or the last token)
    final: bool  # tokens end at the sequence's last known token: its next token is drawn this step
    cap: int = 0  # the most guesses this row may take (its blocks cover them); 0: no speculation
    guesses: list[int] = field(default_factory=list)  # the proposer's, read after tokens
    q: torch.Tensor | None = None  # (len(guesses), V) the draft's distributions; None: a point mass

    @property
    def fed(self) -> list[int]:
        """Every token the target reads this step: the row's tokens, then its guesses."""
        return self.tokens + self.guesses if self.guesses else self.tokens


@dataclass
class StepPlan:
    rows: list[Row]
    fused: bool = False  # decoding rows without guesses go through the fused LM head

    @cached_property  # the rows and their tokens are fixed once scheduled (only guesses come later)
    def prefills(self) -> list[Row]:
        """Rows that read prompt tokens and are not drawn from yet."""
        return [r for r in self.rows if not r.final]

    @cached_property
    def finals(self) -> list[Row]:
        return [r for r in self.rows if r.final]
