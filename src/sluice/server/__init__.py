"""OpenAI-compatible HTTP over the engine: `sluice serve`. Needs the `server` extra (fastapi, uvicorn).

    app.py        routes, error handlers       serving.py   OpenAI request <-> engine events, SSE
    protocol.py   pydantic wire models         errors.py    OpenAI's error object, statuses
    engine.py     the ServingEngine interface  batch_engine.py  that interface over the continuous-batching
    llm_engine.py one request at a time, for the static path (speculative decoding)
    guard.py      API key and body size        metrics.py   Prometheus text
"""

from .app import create_app
from .engine import GenerationRequest, RequestHandle, ServingEngine
from .batch_engine import BatchServingEngine
from .llm_engine import LLMEngine

__all__ = ["create_app", "BatchServingEngine", "GenerationRequest", "LLMEngine", "RequestHandle", "ServingEngine"]
