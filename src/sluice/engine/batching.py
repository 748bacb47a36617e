"""BatchEngine: the continuous-batching scheduler with its KV pool, driven by whoever asks for output.

An `LLM` has one. There is no background thread: whoever needs output (a generate() call, the next()
of a stream() generator, on any thread) runs scheduler steps until its sequences have some, under a
lock, and every sequence in the batch advances with them. So two streams interleaved on one LLM
both progress, and a stream closed early aborts its sequence, whose blocks go back at once.

The pool is sized once, when the engine is built: the KV budget (LLM(kv_cache_memory=) or half of
the memory available then, kv_cache.default_budget) minus the sampling buffers of max_num_seqs
rows, and never more than max_num_seqs sequences of the full context would use. Its memory is
committed as blocks are written (paged_cache._lazy_zeros).
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

from ..errors import RequestError
from ..model.layers import Transformer
from .kv_cache import STEP_BYTES_PER_LOGIT, fmt_bytes
from .mixed import activation_dtype
from .outputs import RequestOutput, Stats
from .paged_cache import DEFAULT_BLOCK_SIZE, BlockPool
from .proposers import DraftProposer, PromptLookup
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Seq, Update
from .verify import Speculation

DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_MAX_BATCHED_TOKENS = 256  # per step: a long prompt's chunk; decodes wait at most one such chunk


def pool_blocks(model: Transformer, max_model_len: int, max_num_seqs: int, block_size: int,
                budget: int | None, given: bool, draft: Transformer | None = None) -> int:
    """How many blocks the pool gets (see the module docstring); refuses a budget below one block.
    With a draft model each block id also names a block of the draft's pool (proposers.DraftProposer)."""
    cfg = model.config
    per_block = sum(BlockPool.block_bytes(m.config, block_size, activation_dtype(m)) for m in (model, draft) if m)
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
    def __init__(self, model: Transformer, decode, eos_ids, max_model_len: int, budget: int | None,
                 budget_given: bool, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS, block_size: int = DEFAULT_BLOCK_SIZE,
                 native: bool = True, nonfinite_origin=None, head=None, compile: bool = False,
                 fused_head: bool | str = False, speculative: str = "off", draft: Transformer | None = None,
                 num_speculative_tokens: int | str = 0):
        """speculative: "off", "draft" (draft: the draft model) or "prompt-lookup" (verify.py)."""
        blocks = pool_blocks(model, max_model_len, max_num_seqs, block_size, budget, budget_given, draft)
        self.pool = BlockPool(model.config, blocks, block_size, activation_dtype(model), model.embed.weight.device)
        speculation = None
        if speculative == "draft":
            draft_pool = BlockPool(draft.config, blocks, block_size, activation_dtype(draft), draft.embed.weight.device)
            speculation = Speculation("draft", DraftProposer(draft, draft_pool, native), num_speculative_tokens)
        elif speculative == "prompt-lookup":
            speculation = Speculation("prompt-lookup", PromptLookup(), num_speculative_tokens)
        self.scheduler = Scheduler(model, self.pool, decode, max_num_seqs, max_num_batched_tokens, native,
                                   nonfinite_origin, head, compile, fused_head, speculation)
        self.eos_ids = eos_ids  # the LLM's own set, read at each add(): a caller may change it
        self._lock = threading.Lock()

    def add(self, prompt_ids: list[int], params: SamplingParams, label: str | None = None) -> Seq:
        return self.scheduler.add(prompt_ids, params, self.eos_ids, label)

    def step(self) -> list[Update]:
        with self._lock:
            return self.scheduler.step()

    def run(self, seqs: list[Seq]) -> None:
        """Step until every one of `seqs` has finished (others in the batch advance too). If this is
        interrupted (an exception, KeyboardInterrupt), the unfinished ones are aborted."""
        try:
            while not all(s.finished for s in seqs):
                self.step()
        finally:
            self.abort([s for s in seqs if not s.finished])

    def updates(self, seq: Seq) -> Iterator[Update]:
        """seq's updates as they come, stepping when it has none waiting; closing the iterator early
        aborts seq."""
        try:
            while True:
                while seq.pending:
                    update = seq.pending.popleft()
                    yield update
                    if update.finished:
                        return
                self.step()
        finally:
            if not seq.finished:
                self.abort([seq])

    def abort(self, seqs: list[Seq]) -> None:
        if not seqs:
            return
        for s in seqs:
            self.scheduler.abort(s)
        # Free the blocks now when nobody is stepping; else (another thread's step, or a generator
        # finalised inside one) the next step frees them.
        if self._lock.acquire(blocking=False):
            try:
                self.scheduler.apply_aborts()
            finally:
                self._lock.release()


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
    return stats
