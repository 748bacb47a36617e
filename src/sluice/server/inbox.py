"""The serving engine's front desk: a bounded queue of accepted requests, the server's state (loading,
ready, draining, closed, broken) and the worker thread that empties the queue.

Separate from batch_engine.py, which decides what the worker does with what it takes; this file only
says which requests may come in and hands them over in arrival order.

Beside requests it holds jobs: work on the model itself that is not generation (the live page's valves,
an observed forward). The worker runs them between two steps, so nothing else touches the model while
they do, and the batch only waits for them as it would for one more prefill chunk.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Callable

from .engine import Aborted, Draining, Failed, NotReady, QueueFull, RequestHandle
from .metrics import Metrics

MAX_JOBS = 8  # jobs waiting at once; more is a client polling too fast (QueueFull: a 429)


class Job:
    """fn(target), run later on the worker thread; `future` (on the submitting event loop) gets its result."""

    def __init__(self, fn: Callable[[object], object]):
        self.fn = fn
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future = self.loop.create_future()

    def run(self, target) -> None:
        try:
            result, error = self.fn(target), None
        except Exception as e:  # noqa: BLE001 -- the caller's to report; the worker carries on
            result, error = None, e
        self.settle(result, error)

    def settle(self, result, error: Exception | None) -> None:
        def done():
            if self.future.done():  # its client went away and the future was cancelled
                return
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        try:
            self.loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop has closed: nobody is waiting
            pass


class Inbox:
    def __init__(self, max_queue: int, queued_elsewhere: Callable[[], int] = lambda: 0):
        """queued_elsewhere(): requests the worker took in that have not started either; --max-queue
        bounds them together with the ones still here."""
        self.max_queue = max_queue
        self.metrics = Metrics()
        self.load_error: Exception | None = None
        self.fatal_error: Exception | None = None
        self.waiting: collections.deque[RequestHandle] = collections.deque()
        self.jobs: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.draining = self.closed = False
        self._queued_elsewhere = queued_elsewhere
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    def start_worker(self, target: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=target, name="sluice-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def queued(self) -> int:
        """Requests accepted and not yet generating (what --max-queue bounds)."""
        return len(self.waiting) + self._queued_elsewhere()

    # ------------------------------------------------------------------ the server's side
    def submit(self, request) -> RequestHandle:
        """Queue a request; raises NotReady, Draining or QueueFull instead of queueing."""
        handle = RequestHandle(request, asyncio.get_running_loop())
        with self.cond:
            self._check_open()
            queued = self.queued()
            if queued >= self.max_queue:
                self.metrics.record("rejected")
                raise QueueFull(f"{queued} requests are already waiting (--max-queue {self.max_queue})")
            self.waiting.append(handle)
            self.cond.notify()
        return handle

    def call(self, fn: Callable[[object], object]) -> asyncio.Future:
        """Queue fn(llm) for the worker, to run between two steps; await the future for its result.
        Raises NotReady, Draining or QueueFull (more than MAX_JOBS waiting) instead of queueing."""
        job = Job(fn)
        with self.cond:
            self._check_open()
            if len(self.jobs) >= MAX_JOBS:
                raise QueueFull(f"{len(self.jobs)} model jobs are already waiting (at most {MAX_JOBS})")
            self.jobs.append(job)
            self.cond.notify()
        return job.future

    def _check_open(self) -> None:
        if self.draining or self.closed:
            why = f" ({self.fatal_error})" if self.fatal_error else ""
            raise Draining(f"the server is shutting down{why}")
        if not self._ready.is_set():
            raise NotReady(f"the model failed to load: {self.load_error}" if self.load_error
                           else "the model is still loading")

    def abort(self, handle: RequestHandle, reason: Exception | None = None) -> None:
        """A waiting request fails now; a taken one is marked, for the worker to end."""
        handle.abort(reason)
        with self.cond:
            if handle in self.waiting:
                self.waiting.remove(handle)
                self.metrics.record("aborted")
                handle.emit(Failed(reason or Aborted("aborted while waiting")))
            self.cond.notify()

    def begin_drain(self) -> None:
        with self.cond:
            self.draining = True

    def close(self, timeout: float | None = None) -> None:
        """Fail what waits, tell the worker to end, and wait for it."""
        with self.cond:
            self.closed = self.draining = True
            self._fail_waiting(Draining("the server closed"), keep_reason=True)
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker's side
    def take(self, busy: bool, idle_wait: float | None) -> list[RequestHandle] | None:
        """What arrived since the last call, in order; when not busy, wait for something first (at most
        idle_wait seconds; None: until told). None once closed."""
        with self.cond:
            if not self.waiting and not self.jobs and not busy and not self.closed:
                self.cond.wait(idle_wait)
            if self.closed:
                return None
            new = list(self.waiting)
            self.waiting.clear()
        return new

    def take_jobs(self) -> list[Job]:
        with self.cond:
            jobs = list(self.jobs)
            self.jobs.clear()
        return jobs

    def set_ready(self) -> None:
        self._ready.set()

    def load_failed(self, error: BaseException) -> None:
        self.load_error = error

    def die(self, error: Exception) -> None:
        """The engine can serve no more (its worker is ending): refuse new requests (503, and /health
        says shutting down) and fail the waiting ones with `error`."""
        with self.cond:
            self.fatal_error = error
            self.draining = True
            self._ready.clear()
            self._fail_waiting(error, keep_reason=False)

    def _fail_waiting(self, error: Exception, keep_reason: bool) -> None:
        """keep_reason: a request already aborted for a reason (the drain deadline) hears that one."""
        for job in self.jobs:
            job.settle(None, error)
        self.jobs.clear()
        for h in self.waiting:
            h.abort(error)
            h.emit(Failed(h.abort_reason or error if keep_reason else error))
        self.waiting.clear()
