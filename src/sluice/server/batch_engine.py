"""BatchServingEngine: the ServingEngine interface over an LLM's continuous batching.

One object holds the LLM, a bounded queue of submitted requests and one worker thread. The worker
builds the LLM (so /health can say 503 while that takes), then loops: it takes the queued requests
in, checks each at the LLM's door (LLM.requests) and adds its n choices (one sequence each; equal
prompts share their prefix blocks), aborts what its clients left, runs one step, and routes each
sequence's update to its request's handle as events. Requests join and leave the batch at every
step, so a long prompt does not hold the others up for more than one chunk of its prefill.

Tensor parallelism plugs in as a composed object, not a subclass: on rank 0 of `sluice serve --tp N`
the worker drives a parallel.lockstep.Leader instead of the LLM itself (the same add_request, abort
and step, with each step's calls broadcast to the followers first). Then the idle worker sends
heartbeats, and a failed step is fatal: the ranks cannot be trusted to agree after it, so the
requests in flight end with GroupFailed, new ones and /health get 503, and on_fatal tells the CLI.

Jobs (Inbox.call: fn(llm), the live page's observed forward) run on the worker between two steps.

Abort (a client gone, the drain deadline): a request still in the queue fails at once; a running one
has its sequences aborted by the worker, which frees their blocks at once.

A request whose logits go non-finite ends with finish_reason "error", and the message names where the
NaN or inf started: its tokens are run once more through the model with the observatory's probes
(observatory/probes.py first_nonfinite). The other requests and the server carry on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from ..errors import SluiceError
from .echo import choice_prompts
from .engine import Aborted, Delta, Done, Draining, Failed, Finished, HeldEvents, RequestHandle, Started
from .fingerprint import Fingerprint
from .inbox import Inbox
from .nonfinite import nonfinite_origin
from .prompts import checked_requests

log = logging.getLogger("sluice.server")


class GroupFailed(Draining):
    """The tensor-parallel group broke: the server is going away (its clients get a 503)."""


@dataclass
class _Live:
    handle: RequestHandle
    seqs: list
    prompt_tokens: int
    open: set = field(default_factory=set)  # indices of choices still generating


class BatchServingEngine:
    def __init__(self, make_llm: Callable[[], object], model_name: str, max_queue: int = 64,
                 on_fatal: Callable[[Exception], None] | None = None,
                 lockstep: Callable[[object], object] | None = None, stream_interval: int = 1):
        """make_llm builds the LLM; it runs on the worker thread, which owns the LLM from then on.
        lockstep(llm): under tensor parallelism, what the worker drives instead of the LLM (a
        parallel.lockstep.Leader). on_fatal(error) is called (on that thread) when the engine cannot
        serve: the load failed (load_error), or it broke later (fatal_error: a tensor-parallel rank died).
        stream_interval: steps between deliveries of a stream's text (engine.HeldEvents)."""
        self.model_name, self.max_model_len = model_name, 0
        self.inbox = Inbox(max_queue, self._queued_beyond_inbox)
        self.metrics = self.inbox.metrics
        self._make_llm, self._make_lockstep, self._on_fatal = make_llm, lockstep, on_fatal
        self.stream_interval = stream_interval
        self._llm = self._engine = self._group = None  # the LLM; what the worker drives; the Leader, if any
        self._fingerprint: Fingerprint | None = None
        self._live: dict[int, _Live] = {}
        self._owner: dict[int, tuple[_Live, int]] = {}  # sequence id -> its request and choice index
        self.inbox.start_worker(self._work)

    # ------------------------------------------------------------------ the interface
    max_queue = property(lambda self: self.inbox.max_queue)
    ready = property(lambda self: self.inbox.ready)
    draining = property(lambda self: self.inbox.draining)
    load_error = property(lambda self: self.inbox.load_error)
    fatal_error = property(lambda self: self.inbox.fatal_error)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.inbox.wait_ready(timeout)

    @property
    def system_fingerprint(self) -> str | None:
        """fingerprint.py's, once the model has loaded."""
        return self._fingerprint() if self._fingerprint is not None else None

    def submit(self, request) -> RequestHandle:
        return self.inbox.submit(request)

    def call(self, fn):
        """Run fn(llm) on the worker thread between two steps (the live page's valves); an asyncio
        future of its result. Raises NotReady, Draining or QueueFull instead of queueing."""
        return self.inbox.call(fn)

    def begin_drain(self) -> None:
        self.inbox.begin_drain()

    def abort(self, handle: RequestHandle, reason: Exception | None = None) -> None:
        self.inbox.abort(handle, reason)  # a waiting one fails now; a live one is seen by the worker

    def abort_all(self, reason: Exception) -> None:
        with self.inbox.cond:
            handles = [*self.inbox.waiting, *(e.handle for e in self._live.values())]
        for h in handles:
            self.abort(h, reason)

    def _queued_beyond_inbox(self) -> int:
        """Requests taken in by the worker whose sequences have not started (what --max-queue bounds too)."""
        if self._llm is None:
            return 0
        running = self._llm.snapshot().running
        return sum(1 for e in list(self._live.values())
                   if not any(s.id in running or s.first_token_at for s in e.seqs))

    def stats(self):
        with self.inbox.cond:
            waiting = self.inbox.queued()
            running = len(self._live) - (waiting - len(self.inbox.waiting))
            snap = self._llm.snapshot() if self._llm is not None else None
        return self.metrics.snapshot(ready=self.ready, draining=self.draining, running=running, waiting=waiting,
                                     max_queue=self.max_queue, kv=snap and snap.kv,
                                     preemptions=snap.preemptions if snap else 0)

    def close(self, timeout: float | None = None) -> None:
        with self.inbox.cond:
            for e in self._live.values():
                e.handle.abort(e.handle.abort_reason or Aborted("the server closed"))
        self.inbox.close(timeout)

    # ------------------------------------------------------------------ the worker
    def _load(self) -> bool:
        """Build the LLM on this (the worker's) thread; on failure keep the error and say so."""
        try:
            llm = self._make_llm()
            if self.inbox.draining:  # SIGTERM came during the load: serve nobody, and skip sizing the KV pool
                return False
            self.max_model_len = llm.max_model_len
            llm.snapshot()  # sizes the KV pool now: a budget too small fails the load
            self._fingerprint = Fingerprint(llm)
            self._group = self._make_lockstep(llm) if self._make_lockstep else None
            self._llm, self._engine = llm, self._group or llm
        except BaseException as e:  # noqa: BLE001 -- reported to the CLI, which exits with it
            self.inbox.load_failed(e)
            if self._on_fatal:
                self._on_fatal(e)
            return False
        self.inbox.set_ready()
        return True

    def _work(self) -> None:
        if not self._load():
            return
        llm = self._llm
        held = HeldEvents(self.stream_interval)  # this thread's events, delivered before forwards and when work runs out
        origin = self._group.nonfinite_origin if self._group else (lambda ids: nonfinite_origin(llm.model, ids))
        llm.on_step(before_forward=held.step, nonfinite_origin=origin)
        with held.holding():
            try:
                self._rounds(held)
            finally:
                held.deliver()

    def _rounds(self, held: HeldEvents) -> None:
        idle_wait = self._group.idle_wait_s if self._group else None  # an idle leader wakes to heartbeat
        while True:
            if not self._llm.has_work:
                held.deliver()  # no forward comes to deliver them
            new = self.inbox.take(bool(self._live), idle_wait)
            if new is None:  # closed
                break
            for job in self.inbox.take_jobs():  # between steps: nothing else is using the model
                job.run(self._llm)
            if not new and not self._live:
                if self._group is not None and not self._heartbeat():
                    return
                continue
            for handle in new:
                self._admit(handle)
            for e in list(self._live.values()):
                if e.handle.aborted:
                    self._route_all(self._engine.abort([s for s in e.seqs if not s.finished]))
            try:
                updates = self._engine.step()
            except Exception as e:  # noqa: BLE001 -- a bug in one step must not kill the server
                if self._group is not None:
                    return self._broken(e)
                log.exception("internal error in a scheduler step", exc_info=e)
                self._fail_all(e)
                continue
            self._route_all(updates)
        self._fail_all(None)  # closed: end what is left
        if self._group is not None:
            try:
                self._group.stop()
            except SluiceError as e:
                log.warning("could not tell the other ranks to stop: %s", e)

    def _admit(self, handle: RequestHandle) -> None:
        if handle.aborted:
            self.metrics.record("aborted")
            handle.emit(Failed(handle.abort_reason or Aborted("aborted while waiting")))
            return
        request = handle.request
        try:
            requests, prompt_tokens = checked_requests(self._llm, request)
        except SluiceError as e:
            self.metrics.record("invalid")
            handle.emit(Failed(e))
            return
        # Every prompt passed before any is added: a refused list runs nothing.
        seqs = [self._engine.add_request(r) for r in requests]
        entry = self._live[handle.number] = _Live(handle, seqs, prompt_tokens, set(range(len(seqs))))
        self._owner.update((s.id, (entry, i)) for i, s in enumerate(seqs))
        echo = choice_prompts(self._llm.tokenizer, request, requests) if request.echo else None
        handle.emit(Started(prompt_tokens, echo))

    def _route_all(self, updates) -> None:
        for u in updates:
            self._route(u)

    def _route(self, u) -> None:
        seq = u.seq
        if seq.id not in self._owner:
            return
        entry, index = self._owner[seq.id] if not u.finished else self._owner.pop(seq.id)
        handle = entry.handle
        if u.text or u.logprobs or u.prompt_logprobs:
            handle.emit(Delta(index, u.text, u.logprobs, u.prompt_logprobs))
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
                log.warning("request %d (x-request-id %s), choice %d: %s", handle.number, handle.request.request_id,
                            index, seq.error)
            handle.emit(Finished(index, seq.finish_reason, tokens, seq.error))
        if not entry.open:
            del self._live[handle.number]
            handle.emit(Failed(handle.abort_reason) if handle.abort_reason else Done())

    def _fail_all(self, error: Exception | None) -> None:
        """End every request in flight (telling its client `error`, if any). The LLM alone, not the
        leader: after a failed step or at the end, the followers are not told."""
        seqs = []
        for e in list(self._live.values()):
            seqs += [s for s in e.seqs if not s.finished]
            if error is not None:
                e.handle.abort(error)
        self._route_all(self._llm.abort(seqs))

    # ------------------------------------------------------------------ tensor parallelism
    def _heartbeat(self) -> bool:
        try:
            self._group.heartbeat()
        except Exception as e:  # noqa: BLE001 -- any failure here ends the group
            self._broken(e)
            return False
        return True

    def _broken(self, error: Exception) -> None:
        """A collective failed (a follower died or hung) or a step raised: the ranks are out of step
        for good, so fail what is in flight and stop serving."""
        from ..parallel.group import ParallelError
        if isinstance(error, ParallelError):
            why = f"the tensor-parallel group failed ({error})"
            log.error("%s; failing the requests in flight and shutting down", why)
        else:  # a bug on rank 0, perhaps between two collectives: the ranks cannot be trusted to agree
            why = f"internal error in a tensor-parallel step ({type(error).__name__}: {error})"
            log.error("%s; shutting down", why, exc_info=error)
        failed = GroupFailed(f"{why}; the server is shutting down")
        try:
            self._fail_all(failed)
        except Exception:  # noqa: BLE001 -- the engine may be half-way through a step; fail the handles anyway
            log.exception("ending the requests in flight")
            for e in list(self._live.values()):
                e.handle.abort(failed)
                e.handle.emit(Failed(failed))
        self.inbox.die(failed)
        if self._on_fatal:
            self._on_fatal(failed)
