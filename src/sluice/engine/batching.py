"""BatchEngine: the continuous-batching scheduler with its KV pool, driven by whoever asks for output.

An `LLM` has one, and drives it through its public add_request(), step() and abort(). There is no
background thread: whoever needs output (a generate() call, the next() of a stream() generator, the
server's worker, on any thread) runs steps until its sequences have some, one step at a time under a
lock, and every sequence in the batch advances with them. So two streams interleaved on one LLM
both progress, and a stream closed early aborts its sequence, whose blocks go back at once.

The pool is sized once, when the engine is built: the KV budget (LLM(kv_cache_memory=) or half of
the memory available then, kv_cache.default_budget) minus the sampling buffers of max_num_seqs
rows, and never more than max_num_seqs sequences of the full context would use. Its memory is
committed as blocks are written (paged_cache._lazy_zeros).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
import time
from typing import Callable

from ..errors import RequestError
from ..model.layers import Transformer
from .kv_cache import STEP_BYTES_PER_LOGIT, fmt_bytes, kv_cache_dtype
from .mixed import activation_dtype
from .outputs import RequestOutput, Stats
from .paged_cache import DEFAULT_BLOCK_SIZE, BlockPool
from .proposers import DraftProposer, PromptLookup
from .requests import Request
from .scheduler import Scheduler
from .sequence import Seq, Update
from .verify import Speculation

DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_MAX_BATCHED_TOKENS = 256  # per step: a long prompt's chunk; decodes wait at most one such chunk


def pool_blocks(model: Transformer, max_model_len: int, max_num_seqs: int, block_size: int,
                budget: int | None, given: bool, draft: Transformer | None = None, kv_dtype: str = "auto") -> int:
    """How many blocks the pool gets (see the module docstring); refuses a budget below one block.
    With a draft model each block id also names a block of the draft's pool (proposers.DraftProposer)."""
    cfg = model.config
    per_block = sum(BlockPool.block_bytes(m.config, block_size, kv_cache_dtype(kv_dtype, activation_dtype(m)))
                    for m in (model, draft) if m)
    useful = max_num_seqs * -(-max_model_len // block_size)
    if budget is None:
        return useful
    room = budget - max_num_seqs * cfg.vocab_size * STEP_BYTES_PER_LOGIT
    if room < per_block:
        where = "kv_cache_memory= / --kv-cache-memory" if given else "the default, half of the memory available now"
        raise RequestError(f"one KV block of {block_size} tokens ({fmt_bytes(per_block)}) plus the sampling buffers of "
                           f"{max_num_seqs} sequences ({fmt_bytes(budget - room)}) is over the budget of {fmt_bytes(budget)} "
                           f"({where}); raise it, or lower max_num_seqs / --max-num-seqs")
    return min(useful, room // per_block)


class BatchEngine:
    def __init__(self, model: Transformer, decode, max_model_len: int, budget: int | None,
                 budget_given: bool, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS, block_size: int = DEFAULT_BLOCK_SIZE,
                 native: bool = True, nonfinite_origin=None, head=None, compile: bool = False,
                 fused_head: bool | str = False, speculative: str = "off", draft: Transformer | None = None,
                 num_speculative_tokens: int | str = 0, plans=None, guides=None, kv_dtype: str = "auto"):
        """speculative: "off", "draft" (draft: the draft model) or "prompt-lookup" (verify.py).
        guides: guide.Guides, for constrained requests (None refuses them). kv_dtype: kv_cache.KV_CACHE_DTYPES,
        the pools' (the target's and the draft's)."""
        blocks = pool_blocks(model, max_model_len, max_num_seqs, block_size, budget, budget_given, draft, kv_dtype)
        self.pool = BlockPool(model.config, blocks, block_size, kv_cache_dtype(kv_dtype, activation_dtype(model)),
                              model.embed.weight.device)
        speculation = None
        if speculative == "draft":
            draft_pool = BlockPool(draft.config, blocks, block_size, kv_cache_dtype(kv_dtype, activation_dtype(draft)),
                                   draft.embed.weight.device)
            self.pool.also_clear(draft_pool)  # (its blocks go by the target pool's ids)
            speculation = Speculation("draft", DraftProposer(draft, draft_pool, native), num_speculative_tokens)
        elif speculative == "prompt-lookup":
            speculation = Speculation("prompt-lookup", PromptLookup(), num_speculative_tokens)
        self.scheduler = Scheduler(model, self.pool, decode, max_num_seqs, max_num_batched_tokens, native,
                                   nonfinite_origin, head, compile, fused_head, speculation, plans, guides)
        self._lock = threading.Lock()

    def add(self, request: Request) -> Seq:
        return self.scheduler.add(request)

    def step(self, before: Callable[[], None] | None = None) -> list[Update]:
        """One scheduler step. before(): called once the requests added and aborted since the last
        step are taken in, as the step starts (a tensor-parallel rank 0 sends the step's calls then)."""
        with self._lock:
            updates = self.scheduler.apply_aborts()
            if before is not None:
                before()
            return updates + self.scheduler.step()

    def abort(self, seqs: list[Seq]) -> list[Update]:
        """End seqs. Their blocks are freed now when nobody is stepping, and the final updates of what
        ended are returned; else (another thread's step, or a generator finalised inside one) the next
        step frees them and returns those updates."""
        if not seqs:
            return []
        for s in seqs:
            self.scheduler.abort(s)
        if self._lock.acquire(blocking=False):
            try:
                return self.scheduler.apply_aborts()
            finally:
                self._lock.release()
        return []

    def snapshot(self) -> EngineState:
        sched = self.scheduler
        return EngineState(sched.steps, frozenset(s.id for s in list(sched.running)), len(sched.waiting),
                        self.pool.stats(), sched.preemptions)


@dataclass(frozen=True)
class EngineState:
    """The engine's state between steps: what a server reports, and what tensor-parallel ranks in
    step agree on (steps, how many run, how many wait) once a step's adds and aborts are taken in."""
    steps: int
    running: frozenset[int]  # the ids of the sequences in the batch (Seq.id)
    waiting: int
    kv: object  # paged_cache.PoolStats
    preemptions: int


def collect(outputs: list[RequestOutput], seqs: list[Seq], t0: float, speculative: str = "off") -> Stats:
    """Copy finished (or aborted) sequences into their outputs; return the request's Stats (prefill:
    from t0 to the last sequence's first token; decode: from there to now)."""
    end = time.perf_counter()
    firsts = [s.first_token_at for s in seqs if s.first_token_at is not None]
    first = max(firsts) if firsts else end
    stats = Stats(prompt_tokens=sum(s.prompt_len for s in seqs), rows=len(seqs),
                  generated_tokens=sum(len(s.token_ids) for s in seqs),
                  prefill_seconds=first - t0, decode_seconds=end - first)
    stats.fused_head_steps = max(s.fused_steps for s in seqs)
    fused = sum(s.fused_steps for s in seqs)
    stats.fallback_rate = sum(s.fused_fallbacks for s in seqs) / fused if fused else 0.0
    specs = [s.spec for s in seqs if s.spec is not None]
    if specs:
        stats.speculative = speculative
        stats.proposed, stats.accepted = sum(p.proposed for p in specs), sum(p.accepted for p in specs)
        stats.row_forwards = sum(p.rounds for p in specs)
        stats.target_forwards = max(p.rounds for p in specs)
    for out, s in zip(outputs, seqs, strict=True):
        out.token_ids, out.text = list(s.token_ids), s.text
        out.finish_reason = s.finish_reason if s.finish_reason != "abort" else None
        out.logprobs = list(s.logprobs) if s.params.logprobs is not None else None
        out.prompt_logprobs = list(s.prompt_logprobs) if s.prompt_logprobs is not None else None
    return stats
