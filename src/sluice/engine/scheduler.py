"""Continuous batching: requests join and leave the running batch at every step.

One `step()`:
1. applies aborts (a request's blocks go back to the pool now);
2. schedules, oldest request first: a decoding sequence takes 1 token, a prefilling one a chunk of
   its prompt within the step's token budget (max_num_batched_tokens), so a long prompt is prefilled
   over several steps while the others keep decoding; then waiting requests are admitted while the
   batch has room (max_num_seqs), the budget lasts and the pool has blocks. A new request first
   takes its prompt's blocks from the prefix cache (paged_cache.py): a shared system prompt is
   computed once;
3. runs the model (batch_forward.py): every 1-token row in one forward, each prefill chunk in its own;
4. samples a token for every sequence whose computed tokens reached its end (batch_sampling.py), each
   with its own Sampler (its own random stream and penalty state), so a request draws exactly what it
   would alone;
5. keys the blocks that filled up, and frees the blocks of sequences that finished.

Under tensor parallelism (LLM(tensor_parallel=N)) every rank runs this same scheduler on its part of
the model: the logits of step 4 are the rank's vocabulary shard, and the `head` (parallel/head.py)
samples them with collectives. Every rank must then get the same add()s and abort()s in the same
order (parallel/lockstep.py); the decisions above depend on nothing else, so they agree.

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
from .batch_sampling import BatchDraw, FullHead
from .paged_cache import BlockPool
from .requests import Request
from .sampling import NONFINITE, SamplingParams
from .sequence import Seq, Update
from .streaming import TextStream


_serials = itertools.count()


class Scheduler:
    def __init__(self, model: Transformer, pool: BlockPool, decode: Callable[[list[int]], str],
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 256, native: bool = True,
                 nonfinite_origin: Callable[[list[int]], str] | None = None, head=None):
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
        self.draw = BatchDraw(self.head)
        self.forward = BatchForward(model, pool, native)  # the model work of a step (native step or torch)
        self.nonfinite_origin = nonfinite_origin  # ids -> where a NaN starts (the observatory's, from the server)
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []  # in admission order
        self._incoming: collections.deque[Seq] = collections.deque()
        self._aborts: set[int] = set()
        self._lock = threading.Lock()
        self.preemptions = 0
        self._preempted_now = False
        self.before_forward: Callable[[], None] | None = None  # called as each step's model work starts
        self.steps = 0

    # ------------------------------------------------------------------ requests in, out
    def add(self, request: Request) -> Seq:
        """Queue a generation, checked at the door (requests.Request: its params resolved, its prompt
        fit to the context and to this pool alone), so nothing here can refuse it."""
        params, prompt_ids = request.params, request.prompt_token_ids
        sampler = self.head.sampler(params)
        sampler.add_context(0, prompt_ids)
        seq = Seq(next(_serials), len(prompt_ids), list(prompt_ids), params, sampler,
                  TextStream(self.decode, params.stop), set(request.stop_ids), label=request.label)
        with self._lock:
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
        batch = self._schedule()
        if not batch:
            return updates
        self.steps += 1
        if self.before_forward is not None:
            self.before_forward()
        logits = self.forward(batch)  # (N, V) for the sequences that reached their end, in batch order
        done = [s for s, n in batch if s.num_computed == len(s.ids)]
        self._key_full_blocks([s for s, _ in batch])
        if done:
            updates += self._sample(done, logits)
        return updates

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
        seq.preemptions += 1
        self.preemptions += 1
        self._preempted_now = True
        self.waiting.appendleft(seq)

    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Give seq blocks for its first `tokens` slots, preempting the newest others if need be;
        False if seq itself had to go (it was the newest)."""
        need = self.blocks_for(tokens) - len(seq.blocks)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.blocks += [self.pool.take() for _ in range(need)]
        return True

    def _schedule(self) -> list[tuple[Seq, int]]:
        budget, batch = self.max_num_batched_tokens, []
        self._preempted_now = False
        for seq in list(self.running):  # oldest first; victims come from the newest, not yet scheduled
            if seq not in self.running:
                continue  # preempted for an older one in this loop
            left = len(seq.ids) - seq.num_computed
            n = 1 if left == 1 else min(left, budget)  # a decode always goes; a chunk within the budget
            if n == 0 or not self._grow(seq, seq.num_computed + n):
                continue
            batch.append((seq, n))
            budget -= n
        # No admissions in a step that preempted: the blocks just freed went to an older sequence.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not self._preempted_now:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break  # the oldest waits for blocks; the younger wait behind it (first come, first served)
            self.waiting.popleft()
            self.running.append(seq)
            n = min(len(seq.ids) - seq.num_computed, budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def _admit(self, seq: Seq, budget: int) -> bool:
        """Take the prompt's cached blocks and the blocks for its first chunk, or nothing."""
        bs, pool = self.pool.block_size, self.pool
        hits, serial = [], 0
        # At least one token is left to compute: its logits give the first new token.
        cacheable = (len(seq.ids) - 1) // bs
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
        return True

    def _key_full_blocks(self, seqs: list[Seq]) -> None:
        bs = self.pool.block_size
        for seq in seqs:
            for j in range(len(seq.serials), seq.num_computed // bs):
                prev = seq.serials[-1] if seq.serials else 0
                seq.serials.append(self.pool.register(seq.blocks[j], self.pool.key(prev, seq.ids[j * bs:(j + 1) * bs])))

    # ------------------------------------------------------------------ sampling
    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> list[Update]:
        tokens = self.draw(seqs, logits).tolist()  # the step's one host sync
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        lps = self._logprobs(want, [seqs[i] for i in want], logits[want], [tokens[i] for i in want]) if want else {}
        now, updates = time.perf_counter(), []
        for i, (seq, tok) in enumerate(zip(seqs, tokens, strict=True)):
            if tok == NONFINITE:
                where = (self.nonfinite_origin(seq.ids) if self.nonfinite_origin else
                         "NaN or inf in the weights or the config? `sluice inspect` shows the layer where it starts")
                msg = (f"the model produced non-finite logits (NaN or inf) at step {len(seq.token_ids)} of "
                       f"{seq.label}; {where}")
                updates.append(self._finish(seq, "error", msg))
                continue
            seq.first_token_at = seq.first_token_at or now
            seq.ids.append(tok)
            lp = lps.get(i)
            if lp is not None:
                seq.logprobs.append(lp)
            if tok in seq.stop_ids:
                delta, reason = seq.stream.finish(), "stop"
            else:
                delta = seq.stream.push(tok)
                reason = "stop" if seq.stream.stopped else None
                if reason is None and len(seq.token_ids) >= seq.params.max_tokens:
                    delta, reason = delta + seq.stream.finish(), "length"
            seq.text += delta
            update = Update(seq, delta, [tok], [lp] if lp is not None else None, reason is not None)
            if reason is not None:
                self._end(seq, reason)
            seq.pending.append(update)
            updates.append(update)
        return updates

    def _logprobs(self, index: list[int], seqs: list[Seq], logits: torch.Tensor, tokens: list[int]) -> dict:
        """{index in the step's list: TokenLogprob} for the sequences that asked for logprobs."""
        out = self.head.logprobs(logits, torch.tensor(tokens), [s.params.logprobs for s in seqs],
                                 lambda t: self.decode([t]))
        return dict(zip(index, out, strict=True))
