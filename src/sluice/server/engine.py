"""The narrow interface between the HTTP layer and whatever generates: `ServingEngine`.

The server only ever calls submit(), abort(), stats(), ready / draining and model_name of the
implementation behind it: batch_engine.BatchServingEngine (requests join and leave the LLM's
continuous batch at every step; on rank 0 of a tensor-parallel group too, its steps followed by the
other ranks), or a test's stand-in.

A submitted request comes back as a RequestHandle: an async iterator of events, in order,
    Started(prompt_tokens)  then, per choice, Delta(index, text)... Finished(index, reason, tokens),
    then Done
or Failed(error) alone when the request is refused before any output (a bad prompt, context
overflow) or aborted before it started (Failed(Aborted())). A request aborted with a reason (the
server's drain deadline) ends with Failed(reason) instead of Done, whatever it sent before. Events are put by the engine's own threads and read on the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Union

from ..engine.sampling_params import SamplingParams
from .metrics import Snapshot


class NotReady(Exception):
    """The model is still loading (or failed to load)."""


class Draining(Exception):
    """The server is shutting down: in-flight requests finish, new ones are refused."""


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows."""


class Aborted(Exception):
    """The request was aborted before it started (its client went away, or the server closed)."""


@dataclass
class GenerationRequest:
    """One request: a prompt (text or token ids), several prompts, or chat messages, and a SamplingParams
    per choice. With several prompts, params holds n per prompt, prompt-major: choice k is choice k % n
    of prompt k // n (OpenAI's numbering); they are all checked before any of them runs.

    max_tokens_given False: the request left max_tokens unset, so the engine fills the model's default,
    clamped to what the context has left after the prompt (as OpenAI and vLLM do)."""
    params: list[SamplingParams]
    prompt: Union[str, list[int], None] = None
    messages: list[dict] | None = None
    max_tokens_given: bool = True
    prompts: list[Union[str, list[int]]] | None = None
    request_id: str | None = None  # the HTTP request's x-request-id, for log lines
    tools: list[dict] | None = None  # the chat template's `tools` (OpenAI's tool dicts, transformers' convention)
    tool_plan: object = None  # tools.ToolPlan: how the server reads tool calls out of the text (not the engine's)
    echo: bool = False  # Started carries each choice's prompt text (server/echo.py)


@dataclass
class Started:
    prompt_tokens: int
    echo: list[tuple[str, str]] | None = None  # when the request echoes, per choice: its prompt's text and first token's


@dataclass
class Delta:
    index: int
    text: str
    logprobs: list | None = None  # engine.logprobs.TokenLogprob of the tokens consumed since the last Delta
    prompt_logprobs: list | None = None  # a choice's first Delta, when its params asked: Seq.prompt_logprobs


@dataclass
class Finished:
    index: int
    finish_reason: str  # "stop", "length", or "error" (then `error` says why)
    completion_tokens: int
    error: str | None = None


@dataclass
class Failed:
    error: Exception  # a sluice error (the request's fault) or anything else (ours)


@dataclass
class Done:
    pass


Event = Union[Started, Delta, Finished, Failed, Done]
_ids = itertools.count()


class RequestHandle:
    """One submitted request. Iterate it (on the event loop that submitted it) for its events;
    abort() from anywhere stops it at the engine's next step, or before it starts."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.number = next(_ids)
        self.arrival = time.perf_counter()
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._aborted = threading.Event()
        self.abort_reason: Exception | None = None  # told to the client, if one is still there
        self.streaming = False  # a Delta of it has been delivered (HeldEvents: the first goes out at once)

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def abort(self, reason: Exception | None = None) -> None:
        if not self._aborted.is_set():
            self.abort_reason = reason
        self._aborted.set()

    def emit(self, event: Event) -> None:
        """Called from the engine's thread; inside HeldEvents.holding() the event waits for deliver()."""
        box = getattr(_held, "box", None)
        if box is not None:
            box.events.append((self, event))
        else:
            _deliver([(self, event)])

    async def next(self) -> Event:
        return await self._events.get()

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for events in self.batches():
            for event in events:
                yield event

    async def batches(self) -> AsyncIterator[list[Event]]:
        """The events in order, every one already waiting in one list (a stream writes them together)."""
        while True:
            events = [await self._events.get()]
            while not self._events.empty() and not isinstance(events[-1], (Done, Failed)):
                events.append(self._events.get_nowait())
            yield events
            if isinstance(events[-1], (Done, Failed)):
                return


_held = threading.local()


class HeldEvents:
    """The engine thread's emit() calls, held and then delivered together: one wake-up of each event
    loop per engine step instead of one per token (asyncio's self-pipe write per event was 8% of the
    engine thread with 8 clients). Each handle still gets its events in order.

    The worker delivers them just before the next forward (Scheduler.before_forward), not as soon as
    the step ends. The event loop then turns them into SSE chunks while the native step runs with
    the GIL released, instead of holding the GIL against the worker's own Python (scheduling,
    sampling) and stalling it: on 2 cores the two threads' Python runs one at a time.
    """

    def __init__(self, interval: int = 1):
        self.events: list[tuple[RequestHandle, Event]] = []
        self.interval = interval  # steps between deliveries of plain text (`sluice serve --stream-interval`)
        self._steps = 0  # steps since the last delivery

    def step(self) -> None:
        """Before a forward: deliver what is held once `interval` steps have passed since the last
        delivery, or at once when anything held is more than a further piece of a request's text: its
        start, its first text (time to first token), a choice's end or the request's (a client may send
        its next request then). With interval N a stream's chunks come in writes of up to N tokens each,
        still one SSE chunk a token: the event loop wakes and writes to each socket once per N steps,
        the cost that grows with the streams (docs/server.md)."""
        self._steps += 1
        if self._steps >= self.interval or any(not isinstance(e, Delta) or not h.streaming for h, e in self.events):
            self.deliver()

    @contextlib.contextmanager
    def holding(self):
        """Within it, this thread's emit() calls wait here for deliver()."""
        _held.box = self
        try:
            yield
        finally:
            _held.box = None

    def deliver(self) -> None:
        events, self.events, self._steps = self.events, [], 0
        if events:
            for handle, event in events:
                handle.streaming = handle.streaming or isinstance(event, Delta)
            _deliver(events)


def _deliver(events: list[tuple[RequestHandle, Event]]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for handle, event in events:
        by_loop.setdefault(handle._loop, []).append((handle, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop has closed (server gone): nobody is listening any more
            for handle, _ in items:
                handle.abort()


def _put_all(items: list[tuple[RequestHandle, Event]]) -> None:
    for handle, event in items:
        handle._events.put_nowait(event)


class ServingEngine(Protocol):
    model_name: str
    max_model_len: int
    system_fingerprint: str | None  # what decides the output (server/fingerprint.py), once loaded

    @property
    def ready(self) -> bool: ...

    @property
    def draining(self) -> bool: ...

    @property
    def load_error(self) -> Exception | None: ...

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises NotReady, Draining or QueueFull instead of queueing."""

    def abort(self, handle: RequestHandle, reason: Exception | None = None) -> None:
        """Stop a request (a client went away): drop it from the queue, or end its generation."""

    def stats(self) -> Snapshot: ...

    def begin_drain(self) -> None:
        """Refuse new requests from now on; the ones in flight go on."""

    def abort_all(self, reason: Exception) -> None:
        """End every request now (the drain's deadline); their clients hear `reason`."""

    def close(self, timeout: float | None = None) -> None:
        """Abort what is left and stop the engine's threads."""
