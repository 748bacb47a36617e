"""OpenAI-compatible HTTP over the engine: `sluice serve` (fastapi, uvicorn: core dependencies of sluice).

    app.py          routes, error handlers          serving.py     OpenAI request <-> engine events, SSE
    protocol.py     pydantic wire models            errors.py      OpenAI's error object, statuses
    guard.py        x-request-id, API key, body     metrics.py     Prometheus text
    engine.py       the ServingEngine interface (submit, abort, stats, drain) and its events
    prompts.py      a request's prompts -> the LLM's checked Requests (a list of prompts too)
    fingerprint.py  system_fingerprint: a hash of what decides the output
    kernels.py      `sluice serve` and the native kernel builds: no request ever waits for one
    inbox.py        the bounded queue of accepted requests, the server's state, the worker thread
    batch_engine.py   the ServingEngine: one object holding the LLM, an inbox and one worker that drives
                      LLM.requests / add_request / step / abort; under `sluice serve --tp N` it drives a
                      parallel.lockstep.Leader over the LLM instead (composed, not a subclass); every
                      LLM option (speculative decoding, compile, the fused head) runs in its batch
    live.py         the live page (page/: HTML, JS, CSS shipped in the package) and POST /v1/sluice/valves,
                    an observed forward run as a job on the worker between two steps
"""

from .app import create_app
from .engine import GenerationRequest, RequestHandle, ServingEngine
from .batch_engine import BatchServingEngine

__all__ = ["create_app", "BatchServingEngine", "GenerationRequest", "RequestHandle", "ServingEngine"]
