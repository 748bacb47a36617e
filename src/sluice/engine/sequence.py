"""A sequence the scheduler (scheduler.py) runs, and what one step did to it."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .sampling import Sampler, SamplingParams
from .streaming import TextStream


@dataclass(eq=False)
class SpecState:
    """One sequence's speculative decoding (speculative.py): its guess count, and what its draft saw."""
    k: int  # guesses per round; adapted between rounds when adaptive
    adaptive: bool = False
    keep_rate: float | None = None  # "auto": running estimate of P(a guess is kept | it is checked)
    draft_valid: int = 0  # positions 0 .. draft_valid-1 hold the draft model's keys and values
    proposed: int = 0  # guesses made while the sequence was generating
    accepted: int = 0  # of those, kept
    rounds: int = 0  # target forwards this sequence took part in as a decoding row


@dataclass(eq=False)  # a sequence is itself: `in` and remove() compare identity, not every field
class Seq:
    """One generation: a prompt and one SamplingParams (a request with n choices is n of these)."""
    id: int
    prompt_len: int
    ids: list[int]  # prompt + generated so far
    params: SamplingParams
    sampler: Sampler
    stream: TextStream
    stop_ids: set[int]
    blocks: list[int] = field(default_factory=list)
    serials: list[int] = field(default_factory=list)  # prefix names of this sequence's keyed blocks
    num_computed: int = 0  # tokens whose keys and values are in `blocks`
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    label: str = "this request"  # how errors name it ("prompt 2")
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token, if asked for
    # params.prompt_logprobs: None for position 0, then a TokenLogprob per prompt token (prompt_logprobs.py)
    prompt_logprobs: list | None = None
    pending: collections.deque = field(default_factory=collections.deque)  # updates not yet read
    spec: SpecState | None = None  # when the engine speculates
    number: int = -1  # adds to its scheduler before it: the same on every tensor-parallel rank (parallel/plans.py)
    fused_steps: int = 0  # tokens drawn through the fused LM head
    fused_fallbacks: int = 0  # of those, drawn by its plain fallback (fused_head.py)
    guide: object | None = None  # guide.Guide, its grammar's state, when its params carry a constraint

    @property
    def max_len(self) -> int:
        """Prompt plus max_tokens: the most tokens this sequence can reach."""
        return self.prompt_len + self.params.max_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Update:
    """What one step did to one sequence: the text it released, the tokens and their logprobs; its first
    update also carries the prompt's logprobs, when its params asked (Seq.prompt_logprobs)."""
    seq: Seq
    text: str
    token_ids: list[int]
    logprobs: list | None
    finished: bool
    prompt_logprobs: list | None = None
