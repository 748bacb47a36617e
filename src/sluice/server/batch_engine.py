"""BatchServingEngine: the ServingEngine interface over the LLM's continuous-batching scheduler.

One worker thread owns the scheduler (engine/scheduler.py): it takes submitted requests in, turns
each into its n sequences (one per choice; equal prompts share their prefix blocks), runs one
scheduler step, and routes each sequence's update to its request's handle as events. Requests join
and leave the batch at every step, so a long prompt does not hold the others up for more than one
chunk of its prefill.

Abort (a client gone, the drain deadline): a request still in the inbox fails at once; a running one
has its sequences aborted, and the scheduler frees their blocks at the start of its next step.

A request whose logits go non-finite ends with finish_reason "error", and the message names where the
NaN or inf started: its tokens are run once more through the model with the observatory's probes
(observatory/probes.py first_nonfinite). The other requests and the server carry on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..engine.requests import token_ids
from ..errors import SluiceError
from .engine import Aborted, Delta, Done, Failed, Finished, RequestHandle, HeldEvents, Started
from .llm_engine import LLMEngine
from .metrics import Snapshot

log = logging.getLogger("sluice.server")


def nonfinite_origin(model, ids: list[int]) -> str:
    """Where a NaN or inf first appears when `ids` run through `model` (a plain forward with probes)."""
    from ..observatory.attach import observe
    try:
        with torch.inference_mode(), observe(model, capacity=(1, len(ids))) as obs:
            model(torch.tensor([ids], device=model.embed.weight.device))
            first = obs.first_nonfinite()
    except Exception as e:  # noqa: BLE001 -- the diagnosis must not turn one failed request into a crash
        return f"locating its origin failed ({type(e).__name__}: {e})"
    if first is None:
        return "a rerun of the sequence without the cache gave finite values everywhere (a transient fault?)"
    where = f"layer {first['layer']}" if first["layer"] is not None else "outside the blocks"
    return (f"it starts in {first['module']} ({where}) at prompt position {first['position']} "
            f"(the observatory's first non-finite value)")


@dataclass
class _Live:
    handle: RequestHandle
    seqs: list
    prompt_tokens: int
    open: set = field(default_factory=set)  # indices of choices still generating


class BatchServingEngine(LLMEngine):
    """Same interface and construction as LLMEngine; the LLM must not be on its static path."""

    def __init__(self, *args, **kwargs):
        self._live: dict[int, _Live] = {}
        self._owner: dict[int, tuple[_Live, int]] = {}  # sequence id -> its request and choice index
        self._batch = None
        super().__init__(*args, **kwargs)

    def _loaded(self) -> None:
        llm = self._llm
        if llm.static_path:
            raise SluiceError("BatchServingEngine needs an LLM on the continuous-batching path "
                              "(speculative decoding runs on LLMEngine)")
        self._batch = llm.batch_engine()  # sizes the KV pool now: a budget too small fails the load
        self._batch.scheduler.nonfinite_origin = lambda ids: nonfinite_origin(llm.model, ids)

    # ------------------------------------------------------------------ the interface
    def _queued(self) -> int:
        started = {s.id for s in self._batch.scheduler.running} if self._batch else set()
        queued = sum(1 for e in list(self._live.values()) if not any(s.id in started or s.first_token_at
                                                                     for s in e.seqs))
        return len(self._waiting) + queued

    def abort_all(self, reason: Exception) -> None:
        with self._cond:
            handles = [*self._waiting, *(e.handle for e in self._live.values())]
        for h in handles:
            self.abort(h, reason)

    def abort(self, handle: RequestHandle, reason: Exception | None = None) -> None:
        super().abort(handle, reason)  # a waiting one fails now; a live one is seen by the worker
        with self._cond:
            self._cond.notify()

    def stats(self) -> Snapshot:
        with self._cond:
            waiting = self._queued()
            running = len(self._live) - (waiting - len(self._waiting))
            pool = self._batch.pool.stats() if self._batch else None
            preemptions = self._batch.scheduler.preemptions if self._batch else 0
        return self.metrics.snapshot(ready=self.ready, draining=self._draining, running=running, waiting=waiting,
                                     max_queue=self.max_queue, kv=pool, preemptions=preemptions)

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            for e in self._live.values():
                e.handle.abort(e.handle.abort_reason or Aborted("the server closed"))
        super().close(timeout)

    # ------------------------------------------------------------------ the worker
    idle_wait_s: float | None = None  # an idle worker wakes this often to call _idle() (None: only when told)

    def _work(self) -> None:
        if not self._load():
            return
        held = HeldEvents()  # this thread's events, delivered before each forward and when work runs out
        self._batch.scheduler.before_forward = held.deliver
        with held.holding():
            try:
                self._rounds(held)
            finally:
                held.deliver()

    def _rounds(self, held: HeldEvents) -> None:
        while True:
            if not self._batch.scheduler.has_work:
                held.deliver()  # no forward comes to deliver them
            with self._cond:
                if not self._waiting and not self._live and not self._closed:
                    self._cond.wait(self.idle_wait_s)
                if self._closed:
                    break
                new = list(self._waiting)
                self._waiting.clear()
            if not new and not self._live:
                if not self._idle():
                    return
                continue
            for handle in new:
                self._admit(handle)
            for e in list(self._live.values()):
                if e.handle.aborted:
                    for s in e.seqs:
                        if not s.finished:
                            self._abort_seq(s)
            try:
                updates = self._step()
            except Exception as e:  # noqa: BLE001 -- handled (and logged) by _step_failed
                if not self._step_failed(e):
                    return
                continue
            for u in updates:
                self._route(u)
        self._wind_down()

    # What a tensor-parallel rank 0 (server/tp_engine.py) extends: each call that changes the
    # scheduler's state, the step, the idle wake-up, a failed step and the end.
    def _add(self, ids: list[int], params):
        return self._batch.add(ids, params)

    def _abort_seq(self, seq) -> None:
        self._batch.scheduler.abort(seq)

    def _step(self) -> list:
        return self._batch.step()

    def _idle(self) -> bool:
        """Nothing to do (woken by a timeout or an abort); False ends the worker."""
        return True

    def _step_failed(self, error: Exception) -> bool:
        """A step raised: fail the requests in flight and carry on (a bug in one step must not kill the
        server); False ends the worker."""
        log.exception("internal error in a scheduler step", exc_info=error)
        self._fail_all(error)
        return True

    def _wind_down(self) -> None:
        """Closed: end what is left."""
        sched = self._batch.scheduler
        for e in list(self._live.values()):
            for s in e.seqs:
                sched.abort(s)
        for u in sched.apply_aborts():
            self._route(u)

    def _admit(self, handle: RequestHandle) -> None:
        if handle.aborted:
            self.metrics.record("aborted")
            handle.emit(Failed(handle.abort_reason or Aborted("aborted while waiting")))
            return
        llm = self._llm
        try:
            ids = self._prompt_ids(handle.request)
            if not isinstance(handle.request.prompt, str) and handle.request.messages is None:
                ids = token_ids(0, ids, llm.config.vocab_size, llm.max_model_len)  # ids given: check them
            params = self._resolve(handle.request, len(ids))
            for p in params:
                p.validate(llm.config.vocab_size)
                self._batch.scheduler.check_fits(len(ids), p.max_tokens)
        except SluiceError as e:
            self.metrics.record("invalid")
            handle.emit(Failed(e))
            return
        seqs = [self._add(ids, p) for p in params]
        entry = self._live[handle.number] = _Live(handle, seqs, len(ids), set(range(len(seqs))))
        self._owner.update((s.id, (entry, i)) for i, s in enumerate(seqs))
        handle.emit(Started(len(ids)))

    def _route(self, u) -> None:
        seq = u.seq
        if seq.id not in self._owner:
            return
        entry, index = self._owner[seq.id] if not u.finished else self._owner.pop(seq.id)
        handle = entry.handle
        if u.text or u.logprobs:
            handle.emit(Delta(index, u.text, u.logprobs))
        if not u.finished:
            return
        entry.open.discard(index)
        tokens = len(seq.token_ids)
        ttft = seq.first_token_at - handle.arrival if seq.first_token_at and index == 0 else None
        tpot = (seq.finished_at - seq.first_token_at) / (tokens - 1) if tokens > 1 and seq.first_token_at else None
        reason = "aborted" if seq.finish_reason == "abort" else seq.finish_reason
        self.metrics.record(reason, entry.prompt_tokens, tokens, ttft, tpot)
        if seq.finish_reason != "abort":
            if seq.finish_reason == "error":
                log.warning("request %d, choice %d: %s", handle.number, index, seq.error)
            handle.emit(Finished(index, seq.finish_reason, tokens, seq.error))
        if not entry.open:
            del self._live[handle.number]
            handle.emit(Failed(handle.abort_reason) if handle.abort_reason else Done())

    def _fail_all(self, error: Exception) -> None:
        sched = self._batch.scheduler
        for e in list(self._live.values()):
            for s in e.seqs:
                sched.abort(s)
            e.handle.abort(error)
        for u in sched.apply_aborts():
            self._route(u)
