"""Generation, one path: checked requests, the scheduler and its paged cache, the step's plan, forward,
draw (sampling, the fused head, speculative verification) and output stage; the fixed-batch Runner
is a measuring harness. The LLM facade over it is sluice/llm.py."""

from .outputs import RequestOutput, Stats
from .runner import Runner

__all__ = ["RequestOutput", "Runner", "Stats"]
