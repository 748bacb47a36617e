"""ParallelServingEngine: the BatchServingEngine of rank 0 in `sluice serve --tp N`.

Rank 0 hears the clients, checks each request (a bad one is refused here and never reaches the
other ranks), and runs the scheduler as BatchServingEngine does; before each step it broadcasts
the step's adds and aborts to the followers (parallel/lockstep.py), which make the same calls and
step with it. All collectives run on the worker thread, in one order.

Failures: a collective that fails (a follower died, or hung past the collective timeout) or any
other exception in a step leaves the ranks out of step for good, so the engine stops: the requests
in flight end with a GroupFailed error (503 / a stream's finish_reason "error" with the message),
new requests and /health get 503, and on_fatal tells the CLI, which exits nonzero. Rank 0's own
death reaches the followers as a ParallelError within the timeout.

Locating where a NaN starts (batch_engine.nonfinite_origin) reruns a sequence through rank 0's
model alone, which would leave the others waiting in a collective: under tensor parallelism the
error message says so instead.
"""

from __future__ import annotations

import logging

from ..parallel.group import ParallelError
from ..parallel.lockstep import Channel, Leader, heartbeat_interval
from .batch_engine import BatchServingEngine
from .engine import Draining, Failed

log = logging.getLogger("sluice.server")

NO_ORIGIN = ("its origin is not located under tensor parallelism (that reruns the sequence on one rank alone); "
             "`sluice inspect` on the same text shows the layer where it starts")


class GroupFailed(Draining):
    """The tensor-parallel group broke: the server is going away (its clients get a 503)."""


class ParallelServingEngine(BatchServingEngine):
    """BatchServingEngine(make_llm, name, ..., timeout_s=) where make_llm builds LLM(tensor_parallel=N) on
    rank 0; the other ranks run parallel.lockstep.follow over the same LLM."""

    def __init__(self, *args, timeout_s: float, **kwargs):
        self.idle_wait_s = heartbeat_interval(timeout_s)
        self._timeout_s = timeout_s
        self._leader: Leader | None = None
        super().__init__(*args, **kwargs)  # starts the worker

    def _loaded(self) -> None:
        super()._loaded()  # builds the BatchEngine: the followers build theirs at the same point
        self._batch.scheduler.nonfinite_origin = lambda ids: NO_ORIGIN
        self._leader = Leader(Channel(self._timeout_s))

    def _add(self, ids, params):
        seq = super()._add(ids, params)
        self._leader.added(seq, ids, params)
        return seq

    def _abort_seq(self, seq) -> None:
        super()._abort_seq(seq)
        self._leader.aborted(seq)

    def _step(self) -> list:
        # The adds and aborts are applied first, so that the state sent is the one the step starts from
        updates = self._batch.scheduler.apply_aborts()
        self._leader.step(self._batch.scheduler)
        return updates + super()._step()

    def _idle(self) -> bool:
        try:
            self._leader.heartbeat()
        except Exception as e:  # noqa: BLE001 -- any failure here ends the group
            self._broken(e)
            return False
        return True

    def _step_failed(self, error: Exception) -> bool:
        self._broken(error)
        return False

    def _wind_down(self) -> None:
        super()._wind_down()
        try:
            self._leader.stop()
        except ParallelError as e:
            log.warning("could not tell the other ranks to stop: %s", e)

    def _broken(self, error: Exception) -> None:
        if isinstance(error, ParallelError):
            why = f"the tensor-parallel group failed ({error})"
            log.error("%s; failing the requests in flight and shutting down", why)
        else:  # a bug on rank 0, perhaps between two collectives: the ranks cannot be trusted to agree
            why = f"internal error in a tensor-parallel step ({type(error).__name__}: {error})"
            log.error("%s; shutting down", why, exc_info=error)
        failed = GroupFailed(f"{why}; the server is shutting down")
        try:
            self._fail_all(failed)
        except Exception:  # noqa: BLE001 -- the scheduler may be half-way through a step; fail the handles anyway
            log.exception("ending the requests in flight")
            for e in list(self._live.values()):
                e.handle.abort(failed)
                e.handle.emit(Failed(failed))
        self._die(failed)

