"""Continuous batching: requests join and leave the running batch at every step.

One `step()` is plain data flowing one way (plan.py): `schedule()` -> StepPlan -> propose ->
`forward(plan)` -> `draw(plan, out)` -> `update(plan, runs)` -> the output stage.
1. aborts are applied (a request's blocks go back to the pool now);
2. schedule, oldest request first: a decoding sequence takes 1 token (and, speculating, room for its
   guesses), a prefilling one a chunk of its prompt within the step's token budget
   (max_num_batched_tokens), so a long prompt is prefilled over several steps while the others keep
   decoding; then waiting requests are admitted while the batch has room (max_num_seqs), the budget
   lasts and the pool has blocks. A new request first takes its prompt's blocks from the prefix
   cache (paged_cache.py): a shared system prompt is computed once;
3. speculating (verify.py), the proposer guesses for each decoding row;
4. the model runs the plan (batch_forward.py: the native step or torch, compiled or not);
5. draw: a token for every sequence whose computed tokens reached its end (batch_sampling.py), each
   with its own Sampler (its own random stream and penalty state), so a request draws exactly what it
   would alone; a speculating row keeps a prefix of its guesses and draws one more;
6. update: what each sequence has computed, its rejected guesses' blocks back to the pool, the
   blocks that filled up keyed; then the output stage (output_stage.py) detokenizes and stops.

Under tensor parallelism (LLM(tensor_parallel=N)) every rank gets the same add()s and abort()s in
the same order (parallel/lockstep.py), but only rank 0 schedules: its plan (the rows, their block
tables) is broadcast, and the other ranks run steps 3-6 on it (parallel/plans.py) with no queues,
blocks or prefix cache of their own. The logits of step 4 are each rank's vocabulary shard, and the
`head` (parallel/head.py) samples them with collectives.

Preemption is by recompute: when a sequence needs a block and none is free, the most recently
admitted sequence gives all of its blocks back and returns to the front of the queue, keeping what it
generated and its sampler; when readmitted it prefills prompt + generated tokens again (much of it
from the prefix cache, if its blocks were not reused meanwhile) and continues. Swapping to host
memory would buy nothing on a CPU, where the pool already is host memory.

Thread use: add() and abort() may be called from any thread; step() from one thread at a time.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Callable

import torch

from ..errors import RequestError
from ..model.layers import Transformer
from .batch_forward import BatchForward
from .batch_sampling import FullHead, StepDraw
from .fused_head import AUTO_PROBATION, head_allows_fused, params_want_fused
from .output_stage import OutputStage
from .paged_cache import BlockPool
from .plan import Row, StepPlan
from .prompt_logprobs import pending
from .requests import Request
from .sequence import Seq, Update
from .streaming import TextStream


_serials = itertools.count()


class Scheduler:
    def __init__(self, model: Transformer, pool: BlockPool, decode: Callable[[list[int]], str],
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 256, native: bool = True,
                 nonfinite_origin: Callable[[list[int]], str] | None = None, head=None, compile: bool = False,
                 fused_head: bool | str = False, speculation=None, plans=None, guides=None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise RequestError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got "
                               f"{max_num_seqs} and {max_num_batched_tokens}")
        self.model, self.pool, self.decode = model, pool, decode
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.vocab_size = model.config.vocab_size
        self.device = model.embed.weight.device
        # What a step does with its logits (samplers, argmax, logprobs): the full vocabulary's here,
        # parallel/head.ParallelHead's when the model is one rank's part (logits (B, V/N)).
        self.head = head or FullHead(self.vocab_size, self.device)
        self.draw = StepDraw(model, self.head, lambda t: decode([t]))
        self.forward = BatchForward(model, pool, native, compile)  # the model work of a step
        self.fused_head = fused_head  # True, False or "auto" (fused_head.params_want_fused)
        self._fused_rows: tuple[list[Seq], bool] = ([], False)  # the last step's final rows, and their params' say
        self.speculation = speculation  # verify.Speculation, or None
        self.guides = guides  # guide.Guides: a constrained request's grammar state (None: refused)
        # Under tensor parallelism (parallel/plans.PlanChannel) rank 0 schedules and the others follow its plans.
        self.plans = plans
        self.follower = plans is not None and not plans.leads
        self.live: dict[int, Seq] = {}  # unfinished sequences by number
        self.added = 0
        self.output = OutputStage(self._end, nonfinite_origin)
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []  # in admission order
        self._incoming: collections.deque[Seq] = collections.deque()
        self._aborts: set[int] = set()
        self._lock = threading.Lock()
        self.preemptions = 0
        self._preempted_now = False
        self.before_forward: Callable[[], None] | None = None  # called as each step's model work starts
        self.steps = 0

    @property
    def nonfinite_origin(self):
        return self.output.nonfinite_origin

    @nonfinite_origin.setter
    def nonfinite_origin(self, f) -> None:
        self.output.nonfinite_origin = f

    # ------------------------------------------------------------------ requests in, out
    def add(self, request: Request) -> Seq:
        """Queue a generation, checked at the door (requests.Request: its params resolved, its prompt
        fit to the context and to this pool alone), so nothing here can refuse it."""
        params, prompt_ids = request.params, request.prompt_token_ids
        sampler = self.head.sampler(params)
        sampler.add_context(0, prompt_ids)
        seq = Seq(next(_serials), len(prompt_ids), list(prompt_ids), params, sampler,
                  TextStream(self.decode, params.stop), set(request.stop_ids), label=request.label)
        if self.speculation is not None:
            seq.spec = self.speculation.new_state()
        if params.constraint is not None:
            if self.guides is None:
                raise RequestError(f"{request.label}: this engine takes no constraint (built without a tokenizer)")
            seq.guide = self.guides.new(params.constraint, request.stop_ids)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has nothing before it to be predicted from
        with self._lock:
            seq.number, self.added = self.added, self.added + 1
            self.live[seq.number] = seq
            self._incoming.append(seq)
        return seq

    def check_fits(self, prompt_len: int, max_tokens: int, what: str = "") -> None:
        """Refuse a generation that could not fit the whole pool even alone (RequestError, with numbers)."""
        need = self.blocks_for(prompt_len + max_tokens)
        if need > self.pool.num_blocks:
            bs, nb = self.pool.block_size, self.pool.num_blocks
            raise RequestError(
                f"{what}a prompt of {prompt_len} tokens with max_tokens={max_tokens} needs {need} KV blocks of {bs} "
                f"tokens, and the whole pool has {nb} ({nb * bs} tokens); lower max_tokens or shorten the prompt, "
                "or raise the KV cache memory (kv_cache_memory= / --kv-cache-memory)")

    def abort(self, seq: Seq) -> None:
        """End `seq` at the start of the next step (its blocks are freed there)."""
        with self._lock:
            self._aborts.add(seq.id)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._incoming)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Update]:
        updates = self.apply_aborts()
        if not self.running and self.waiting:  # a busy period starts: hooks may have come or gone
            self.forward.refresh()
            if self.speculation is not None:
                self.speculation.proposer.refresh()
        plan = self._follow() if self.follower else self.schedule()
        if self.plans is not None and not self.follower:
            self.plans.share(plan, self.live)
        if not plan.rows:
            return updates
        self.steps += 1
        if self.before_forward is not None:
            self.before_forward()
        if self.speculation is not None:
            self.speculation.proposer.prefill([r for r in plan.rows if not r.cap])
            self.speculation.proposer.propose([r for r in plan.rows if r.cap])
        out = self.forward(plan)
        runs, logprobs = self.draw(plan, out)
        self.update(plan, runs)
        return updates + [self.output(r.seq, runs[r], logprobs.get(r)) for r in plan.finals]

    def apply_aborts(self) -> list[Update]:
        """Take in new requests and end the aborted ones now (step() does this first)."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            aborts, self._aborts = self._aborts, set()
        return [self._finish(s, "abort") for s in [*self.running, *self.waiting] if s.id in aborts]

    def _end(self, seq: Seq, reason: str, error: str | None = None) -> None:
        """Take seq out of the batch or the queue and give its blocks back."""
        seq.finish_reason, seq.error, seq.finished_at = reason, error, time.perf_counter()
        (self.running if seq in self.running else self.waiting).remove(seq)
        self.live.pop(seq.number, None)
        if not self.follower:  # a follower's blocks are rank 0's to manage
            self.pool.release_all(seq.blocks)
        seq.blocks, seq.serials = [], []

    def _finish(self, seq: Seq, reason: str, error: str | None = None) -> Update:
        """End seq without a token (an abort, non-finite logits): an empty, final update."""
        self._end(seq, reason, error)
        update = Update(seq, "", [], None, True)
        seq.pending.append(update)
        return update

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.release_all(seq.blocks)
        seq.blocks, seq.serials, seq.num_computed = [], [], 0
        if seq.spec is not None:
            seq.spec.draft_valid = 0
        seq.preemptions += 1
        self.preemptions += 1
        self._preempted_now = True
        self.waiting.appendleft(seq)

    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Give seq blocks for its first `tokens` slots, preempting the newest others if need be;
        False if seq itself had to go (it was the newest)."""
        need = self.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:  # most decode steps: the last block has room
            return True
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.blocks += [self.pool.take() for _ in range(need)]
        return True

    def schedule(self) -> StepPlan:
        budget, rows = self.max_num_batched_tokens, []
        self._preempted_now = False
        for seq in list(self.running):  # oldest first; victims come from the newest, not yet scheduled
            if seq not in self.running:
                continue  # preempted for an older one in this loop
            left = len(seq.ids) - seq.num_computed
            n = 1 if left == 1 else min(left, budget)  # a decode always goes; a chunk within the budget
            # A speculating decode takes room for its guesses: those past max_tokens are never needed.
            cap = min(seq.spec.k, seq.max_len - len(seq.ids) - 1, max(budget - 1, 0)) if seq.spec and left == 1 else 0
            if n == 0 or not self._grow(seq, seq.num_computed + n + cap):
                continue
            rows.append(self._row(seq, n, cap))
            budget -= n + cap
        # No admissions in a step that preempted: the blocks just freed went to an older sequence.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not self._preempted_now:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break  # the oldest waits for blocks; the younger wait behind it (first come, first served)
            self.waiting.popleft()
            self.running.append(seq)
            n = min(len(seq.ids) - seq.num_computed, budget)
            rows.append(self._row(seq, n, 0))
            budget -= n
        return StepPlan(rows, self._fused([r for r in rows if r.final]))

    def _follow(self) -> StepPlan:
        """A tensor-parallel follower's schedule(): rank 0's plan over this rank's sequences. A sequence
        joins the running list when a plan first names it (rank 0 admitted it); nothing else is decided here."""
        plan = self.plans.share(None, self.live)
        for r in plan.rows:
            if r.seq in self.waiting:
                self.waiting.remove(r.seq)
                self.running.append(r.seq)
        return plan

    @staticmethod
    def _row(seq: Seq, n: int, cap: int) -> Row:
        start = seq.num_computed
        return Row(seq, start, seq.ids[start:start + n], start + n == len(seq.ids), cap)

    def _fused(self, finals: list[Row]) -> bool:
        """Whether this step's plain rows draw through the fused LM head (fused_head.params_want_fused, head_allows_fused)."""
        if not finals or self.fused_head is False or not isinstance(self.head, FullHead):
            return False
        key = [r.seq for r in finals]
        if key != self._fused_rows[0]:  # what the rows' params say holds while the rows stay the same
            params = [s.params for s in key]
            # logprobs need the logits, and so does a constraint's mask; the fused head keeps no generated counts
            self._fused_rows = (key, not any(p.logprobs is not None or p.prompt_logprobs is not None
                                             or p.presence_penalty or p.frequency_penalty
                                             or p.constraint is not None for p in params)
                                and params_want_fused(self.fused_head, params))
        if not self._fused_rows[1]:
            return False
        if self.fused_head == "auto" and self.draw.fused_calls >= AUTO_PROBATION and self.draw.fallback_rate > 0.25:
            return False  # the candidates rarely prove this model's cuts (a flat model): plain from here
        return head_allows_fused(self.model)  # hooks may come and go between steps

    def _admit(self, seq: Seq, budget: int) -> bool:
        """Take the prompt's cached blocks and the blocks for its first chunk, or nothing."""
        bs, pool = self.pool.block_size, self.pool
        hits, serial = [], 0
        # At least one token is left to compute: its logits give the first new token. A prompt whose
        # logprobs are still missing needs every position's logits: computed, not taken from the cache.
        cacheable = 0 if pending(seq) else (len(seq.ids) - 1) // bs
        for j in range(cacheable):
            b = pool.lookup(pool.key(serial, seq.ids[j * bs:(j + 1) * bs]))
            if b is None:
                break
            hits.append(b)
            serial = pool.serial(b)
        computed = len(hits) * bs
        n = min(len(seq.ids) - computed, budget)
        need = self.blocks_for(computed + n) - len(hits)
        if need > pool.num_free:
            pool.release_all(hits)
            return False
        pool.queries += cacheable
        pool.hits += len(hits)
        seq.blocks = hits + [pool.take() for _ in range(need)]
        seq.serials = [pool.serial(b) for b in hits]
        seq.num_computed = computed
        if seq.spec is not None:  # a keyed block holds the draft's keys and values too (update())
            seq.spec.draft_valid = computed
        return True

    # ------------------------------------------------------------------ after the draw
    def update(self, plan: StepPlan, runs: dict[Row, list[int]]) -> None:
        """What each row computed: its tokens, and of a speculating row the guesses it kept. A rejected
        guess's keys and values are stale; the blocks that held only those go back to the pool (the
        slots left in a kept block are rewritten before any query reads them)."""
        if self.follower:  # rank 0 keeps the blocks and the prefix cache; the next plan says what to read
            for r in plan.rows:
                r.seq.num_computed = r.start + len(r.tokens)
            return
        for r in plan.rows:
            seq = r.seq
            kept = len(runs[r]) - 1 if r.guesses else 0
            seq.num_computed = r.start + len(r.tokens) + kept
            if seq.spec is not None and (r.cap or (r.final and len(r.tokens) == 1 and len(seq.ids) > seq.prompt_len)):
                seq.spec.rounds += 1  # a decoding row: with guesses, or a plain step near max_tokens
                seq.spec.proposed += len(r.guesses)
                seq.spec.accepted += kept
                # The draft holds accepted tokens only below what the target kept.
                seq.spec.draft_valid = min(seq.spec.draft_valid, seq.num_computed)
                if r.guesses:
                    self.speculation.adapt(seq.spec, kept, kept < len(r.guesses), seq.params.temperature > 0)
            keep = self.blocks_for(seq.num_computed + 1)
            if len(seq.blocks) > keep:
                self.pool.release_all(seq.blocks[keep:])
                del seq.blocks[keep:]
        self._key_full_blocks([r for r in plan.rows], runs)

    def _key_full_blocks(self, rows: list[Row], runs: dict[Row, list[int]]) -> None:
        bs = self.pool.block_size
        for r in rows:
            seq = r.seq
            # ids up to num_computed: the run's kept guesses are not in seq.ids until the output stage
            ids = seq.ids + runs[r][:-1] if r.guesses else seq.ids
            done = seq.num_computed if seq.spec is None else min(seq.num_computed, seq.spec.draft_valid)
            for j in range(len(seq.serials), done // bs):
                prev = seq.serials[-1] if seq.serials else 0
                seq.serials.append(self.pool.register(seq.blocks[j], self.pool.key(prev, ids[j * bs:(j + 1) * bs])))
