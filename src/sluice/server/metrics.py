"""Serving metrics, kept by the engine's worker and read by /metrics in Prometheus' text format.

Written by hand rather than with prometheus_client: a few counters and two histograms are a page of
code, and a scrape must not take a lock the worker holds for long (every update here is a few adds).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

# Seconds. TTFT spans queueing plus prefill; time per output token spans one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value
        self.n += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total, self.n)


@dataclass
class Snapshot:
    """What /metrics shows, read at one moment."""
    ready: bool
    draining: bool
    running: int
    waiting: int
    max_queue: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int]  # requests by outcome: stop, length, error, aborted, rejected
    ttft: Histogram
    tpot: Histogram
    kv: object = None  # engine.paged_cache.PoolStats of the continuous-batching engine; None before it is built
    preemptions: int = 0


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def record(self, outcome: str, prompt_tokens: int = 0, generated: int = 0,
               ttft: float | None = None, tpot: float | None = None) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated
            self.finished[outcome] = self.finished.get(outcome, 0) + 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def snapshot(self, **state) -> Snapshot:
        with self._lock:
            return Snapshot(prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
                            finished=dict(self.finished), ttft=self.ttft.copy(), tpot=self.tpot.copy(), **state)


def _num(v: float) -> str:
    return "+Inf" if v == math.inf else repr(float(v)) if isinstance(v, float) else str(v)


def render(s: Snapshot, model: str) -> str:
    """Prometheus text exposition format 0.0.4."""
    label = f'model_name="{model.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP sluice_{name} {help_}", f"# TYPE sluice_{name} {kind}"])
        lines.extend(f"sluice_{name}{suffix} {_num(v)}" for suffix, v in samples)

    metric("ready", "gauge", "1 once the model is loaded and the server takes requests.",
           [(f"{{{label}}}", int(s.ready and not s.draining))])
    metric("num_requests_running", "gauge", "Requests being generated now.", [(f"{{{label}}}", s.running)])
    metric("num_requests_waiting", "gauge", "Requests queued for the engine.", [(f"{{{label}}}", s.waiting)])
    metric("max_queue", "gauge", "Queue length past which requests get 429.", [(f"{{{label}}}", s.max_queue)])
    metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [(f"{{{label}}}", s.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated.", [(f"{{{label}}}", s.generation_tokens)])
    metric("request_finished_total", "counter", "Generations finished, by outcome (a request of n choices counts n).",
           [(f'{{{label},finished_reason="{k}"}}', v) for k, v in sorted(s.finished.items())])
    if s.kv is not None:  # the continuous-batching engine's KV pool
        kv = s.kv
        for name, kind, help_, value in (
                ("kv_blocks_total", "gauge", "KV cache blocks in the pool.", kv.total),
                ("kv_blocks_used", "gauge", "KV cache blocks held by running requests.", kv.used),
                ("kv_blocks_free", "gauge", "KV cache blocks free (including cached prefixes nobody holds).", kv.free),
                ("kv_blocks_cached", "gauge", "Free blocks still holding a prefix a later prompt may reuse.", kv.cached),
                ("prefix_cache_queries_total", "counter", "Full prompt blocks that could come from the prefix cache.",
                 kv.queries),
                ("prefix_cache_hits_total", "counter", "Full prompt blocks found in the prefix cache.", kv.hits),
                ("prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total.", kv.hit_rate),
                ("num_preemptions_total", "counter", "Sequences preempted (blocks given back, recomputed later).",
                 s.preemptions)):
            metric(name, kind, help_, [(f"{{{label}}}", value)])
    for name, help_, h in (("time_to_first_token_seconds", "From arrival to the first token (queue + prefill).",
                            s.ttft),
                           ("time_per_output_token_seconds", "Decode time per token after the first.", s.tpot)):
        cumulative, samples = 0, []
        for b, c in zip((*h.buckets, math.inf), h.counts, strict=True):
            cumulative += c
            samples.append((f'_bucket{{{label},le="{_num(float(b))}"}}', cumulative))
        samples += [(f"_sum{{{label}}}", h.total), (f"_count{{{label}}}", h.n)]
        metric(name, "histogram", help_, samples)
    return "\n".join(lines) + "\n"
