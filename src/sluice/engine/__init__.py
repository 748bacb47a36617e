"""Generation: the runner (prefill + static-shape decode step) and the LLM API over it."""

from .llm import LLM
from .outputs import RequestOutput, Stats
from .runner import Runner

__all__ = ["LLM", "RequestOutput", "Runner", "Stats"]
