"""OpenAI-compatible HTTP over the engine: `sluice serve` (fastapi, uvicorn: core dependencies of sluice).

    app.py          routes, error handlers          serving.py     OpenAI request <-> engine events, SSE
    protocol.py     pydantic wire models            errors.py      OpenAI's error object, statuses
    guard.py        API key and body size           metrics.py     Prometheus text
    engine.py       the ServingEngine interface, which one of these implements:
    batch_engine.py   the LLM's continuous-batching scheduler (the default)
    llm_engine.py     one request at a time, for an LLM on the static path (speculative decoding, compile)
    tp_engine.py      rank 0 of `sluice serve --tp N`: the batch engine, its steps replayed by the followers
"""

from .app import create_app
from .engine import GenerationRequest, RequestHandle, ServingEngine
from .batch_engine import BatchServingEngine
from .llm_engine import LLMEngine

__all__ = ["create_app", "BatchServingEngine", "GenerationRequest", "LLMEngine", "RequestHandle", "ServingEngine"]
