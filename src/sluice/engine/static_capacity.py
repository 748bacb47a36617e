"""What the static one-request path (static_path.py) can take: the door's capacity checks for it
(requests.Capacity). It goes when that path does."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RequestError
from .kv_cache import KVCache, check_budget, default_budget
from .mixed import activation_dtype
from .runner import Runner
from .sampling_params import SamplingParams


@dataclass
class StaticCapacity:
    """One fixed batch from prefill to the last token, its KV cache (and the draft's) within the
    budget, checked when the batch starts (the default budget is read then: what is free changes)."""
    model: object
    draft_model: object | None
    kv_cache_memory: int | None  # None: the default, half of the memory available now

    def __post_init__(self):
        self.budget = self.kv_cache_memory or default_budget(self.model.embed.weight.device)

    def refuse(self, index: int, p: SamplingParams) -> None:
        if p.logprobs is not None or p.presence_penalty or p.frequency_penalty:
            raise RequestError(
                f"prompt {index} asks for logprobs or presence/frequency penalties, which only the continuous-"
                "batching engine implements; this LLM runs the static path (speculative decoding, "
                "compile=True, fused_head=True or batching=False)")

    def before(self, params: list[SamplingParams]) -> None:
        self._check(len(params), 1 + min(p.max_tokens for p in params))

    def after(self, requests: list) -> None:
        self._check(len(requests), max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests))

    def _check(self, rows: int, needed: int) -> None:
        slots = Runner.slots_for(needed)
        check_budget(self.model.config, rows, slots, activation_dtype(self.model), self._minus_draft(rows, slots),
                     self.kv_cache_memory is not None)

    def _minus_draft(self, rows: int, slots: int) -> int | None:
        """The memory budget left for the target's batch state once the draft's KV cache is counted."""
        if self.budget is None or self.draft_model is None:
            return self.budget
        draft = self.draft_model
        return max(self.budget - KVCache.nbytes_for(draft.config, rows, slots, activation_dtype(draft)), 0)
