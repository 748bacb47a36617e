"""Generation: requests, the scheduler and its paged cache, the runner (prefill + static-shape decode step),
sampling and speculative decoding. The LLM facade over it is sluice/llm.py."""

from .outputs import RequestOutput, Stats
from .runner import Runner

__all__ = ["RequestOutput", "Runner", "Stats"]
