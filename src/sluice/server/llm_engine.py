"""LLMEngine: the ServingEngine interface over an `LLM` on the static path, one request at a time.

`sluice serve` uses it when the LLM runs speculative decoding or compile=True (LLM.static_path), which
the continuous-batching scheduler does not implement; everything else is served by BatchServingEngine
(batch_engine.py), which reuses this class's queue, worker thread and events.

An LLM holds one KV cache and refuses a second request while one runs, so a single worker thread
owns it: it builds the LLM (so /health can say 503 while that takes), then takes requests from a
bounded queue in arrival order. A request with n > 1 runs its choices as n generations one after
another (choice i seeded with seed + i, so each equals an n = 1 request with that seed);
BatchServingEngine runs them side by side as sequences of one batch.

Abort: a waiting request leaves the queue at once; a running one is stopped at its next text delta
by closing the LLM's stream() generator, which frees the LLM (LLM.static_run's finally clause).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import replace
from typing import Callable

from ..errors import NumericsError, RequestError, SluiceError
from .engine import (Aborted, Delta, Done, Draining, Failed, Finished, GenerationRequest, NotReady, QueueFull,
                     RequestHandle, Started)
from .errors import ContextOverflow
from .metrics import Metrics, Snapshot

log = logging.getLogger("sluice.server")


class LLMEngine:
    def __init__(self, make_llm: Callable[[], object], model_name: str, max_queue: int = 64,
                 on_fatal: Callable[[Exception], None] | None = None):
        """make_llm builds the LLM; it runs on the worker thread, which owns the LLM from then on.
        on_fatal(error) is called (on that thread) when the engine cannot serve: the load failed
        (load_error), or it broke later (fatal_error: a tensor-parallel rank died)."""
        self.model_name = model_name
        self.max_queue = max_queue
        self.max_model_len = 0
        self.metrics = Metrics()
        self.load_error: Exception | None = None
        self.fatal_error: Exception | None = None
        self._make_llm, self._on_fatal = make_llm, on_fatal
        self._llm = None
        self._ready = threading.Event()
        self._draining = False
        self._closed = False
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: RequestHandle | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="sluice-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the interface
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def draining(self) -> bool:
        return self._draining

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        handle = RequestHandle(request, asyncio.get_running_loop())
        with self._cond:
            if self._draining or self._closed:
                why = f" ({self.fatal_error})" if self.fatal_error else ""
                raise Draining(f"the server is shutting down{why}")
            if not self._ready.is_set():
                raise NotReady(f"the model failed to load: {self.load_error}" if self.load_error
                               else "the model is still loading")
            queued = self._queued()
            if queued >= self.max_queue:
                self.metrics.record("rejected")
                raise QueueFull(f"{queued} requests are already waiting (--max-queue {self.max_queue})")
            self._waiting.append(handle)
            self._cond.notify()
        return handle

    def _queued(self) -> int:
        """Requests accepted and not yet generating (what --max-queue bounds)."""
        return len(self._waiting)

    def abort(self, handle: RequestHandle, reason: Exception | None = None) -> None:
        handle.abort(reason)
        with self._cond:
            if handle in self._waiting:
                self._waiting.remove(handle)
                self.metrics.record("aborted")
                handle.emit(Failed(reason or Aborted("aborted while waiting")))

    def abort_all(self, reason: Exception) -> None:
        with self._cond:
            handles = [*self._waiting, *([self._running] if self._running else [])]
        for h in handles:
            self.abort(h, reason)

    def stats(self) -> Snapshot:
        with self._cond:
            running, waiting = int(self._running is not None), len(self._waiting)
        return self.metrics.snapshot(ready=self.ready, draining=self._draining, running=running,
                                     waiting=waiting, max_queue=self.max_queue)

    def begin_drain(self) -> None:
        with self._cond:
            self._draining = True

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._closed = self._draining = True
            for h in self._waiting:
                h.abort(Draining("the server closed"))
                h.emit(Failed(h.abort_reason or Draining("the server closed")))
            self._waiting.clear()
            if self._running is not None:
                self._running.abort(Draining("the server closed"))
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker
    def _load(self) -> bool:
        """Build the LLM on this (the worker's) thread; on failure keep the error and say so."""
        try:
            self._llm = self._make_llm()
            self.max_model_len = self._llm.max_model_len
            self._loaded()
        except BaseException as e:  # noqa: BLE001 -- reported to the CLI, which exits with it
            self.load_error = e
            if self._on_fatal:
                self._on_fatal(e)
            return False
        self._ready.set()
        return True

    def _loaded(self) -> None:
        """What a subclass prepares once the LLM exists, before the server says ready."""

    def _die(self, error: Exception) -> None:
        """The engine can serve no more (its worker is ending): refuse new requests (503, and /health
        says shutting down), fail the waiting ones with `error`, and tell on_fatal."""
        with self._cond:
            self.fatal_error = error
            self._draining = True
            self._ready.clear()
            for h in self._waiting:
                h.abort(error)
                h.emit(Failed(error))
            self._waiting.clear()
        if self._on_fatal:
            self._on_fatal(error)

    def _work(self) -> None:
        if not self._load():
            return
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                handle = self._running = self._waiting.popleft()
            try:
                self._serve(handle)
            except Exception as e:  # noqa: BLE001 -- a bug here must not kill the worker (and the server)
                log.exception("internal error serving request %d", handle.number)
                handle.emit(Failed(e))
            finally:
                with self._cond:
                    self._running = None

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        llm = self._llm
        if request.messages is not None:
            return llm.chat_prompt(request.messages)  # refuses a conversation that cannot fit, unrendered
        if isinstance(request.prompt, str):
            ids = llm.tokenizer.encode(request.prompt, max_tokens=llm.max_model_len)
        else:
            ids = list(request.prompt)  # token ids: LLM.stream checks them
        if not ids:
            raise RequestError("the prompt is empty: at least one token is needed to condition on")
        return ids

    def _resolve(self, request: GenerationRequest, n_prompt: int) -> list:
        """Fill each choice's params from the model's defaults; refuse what cannot fit the context."""
        llm, limit = self._llm, self._llm.max_model_len
        out = []
        for p in request.params:
            p = p.with_defaults(llm.generation_config)
            if not request.max_tokens_given:
                p = replace(p, max_tokens=max(1, min(p.max_tokens, limit - n_prompt)))
            if n_prompt + p.max_tokens > limit:
                raise ContextOverflow(n_prompt, p.max_tokens, limit)
            out.append(p)
        return out

    def _serve(self, handle: RequestHandle) -> None:
        if handle.aborted:
            self.metrics.record("aborted")
            handle.emit(Failed(handle.abort_reason or Aborted("aborted while waiting")))
            return
        request, llm = handle.request, self._llm
        try:
            ids = self._prompt_ids(request)
            params = self._resolve(request, len(ids))
            first = llm.stream(ids, params[0])  # every check of the LLM's runs here, before any compute
        except SluiceError as e:
            self.metrics.record("invalid")
            handle.emit(Failed(e))
            return
        handle.emit(Started(len(ids)))
        try:
            for i, p in enumerate(params):
                if handle.aborted:
                    self.metrics.record("aborted")
                    break
                make = (lambda: first) if i == 0 else (lambda p=p: llm.stream(ids, p))
                # TTFT is the request's: from its arrival to choice 0's first token
                self._run_choice(handle, i, make, arrival=handle.arrival if i == 0 else None)
        finally:
            first.close()  # never started if the request was aborted first: nothing to free then
        handle.emit(Failed(handle.abort_reason) if handle.abort_reason else Done())

    def _run_choice(self, handle: RequestHandle, index: int, make, arrival: float | None) -> None:
        llm, started = self._llm, time.perf_counter()
        reason, error, deltas = None, None, None
        try:
            deltas = make()
            for text in deltas:
                if handle.aborted:
                    break
                handle.emit(Delta(index, text))
            else:
                reason = llm.last_output.finish_reason
        except NumericsError as e:  # this request's logits went non-finite; the model stays usable
            reason, error = "error", str(e)
            log.warning("request %d, choice %d: %s", handle.number, index, e)
        except Exception as e:  # noqa: BLE001 -- one choice failing must not take the server down
            log.exception("internal error in request %d, choice %d", handle.number, index)
            reason, error = "error", f"internal error: {type(e).__name__}: {e}"
        finally:
            if deltas is not None:
                deltas.close()  # an abort closes the generator here: the LLM is free for the next request
        s = llm.last_stats  # counted live by the LLM, so an aborted choice reports what it did
        tokens = s.generated_tokens
        ttft = started - arrival + s.prefill_seconds if tokens and arrival is not None else None
        tpot = s.decode_seconds / (tokens - 1) if tokens > 1 else None
        self.metrics.record(reason or "aborted", s.prompt_tokens, tokens, ttft, tpot)
        if reason is not None:
            handle.emit(Finished(index, reason, tokens, error))
