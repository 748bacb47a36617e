"""OpenAI-compatible HTTP over the engine: `sluice serve`. Needs the `server` extra (fastapi, uvicorn).

    app.py        routes, error handlers       serving.py   OpenAI request <-> engine events, SSE
    protocol.py   pydantic wire models         errors.py    OpenAI's error object, statuses
    engine.py     the ServingEngine interface  llm_engine.py  that interface over today's LLM
    guard.py      API key and body size        metrics.py   Prometheus text
"""

from .app import create_app
from .engine import GenerationRequest, RequestHandle, ServingEngine
from .llm_engine import LLMEngine

__all__ = ["create_app", "GenerationRequest", "LLMEngine", "RequestHandle", "ServingEngine"]
