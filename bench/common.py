"""Helpers shared by the benchmark scripts (run as `python bench/<script>.py`, so this is importable)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from sluice.engine.gemv import cpu_info as native_cpu_info

# A benchmark times the native kernels: a missing one is built first (saying so), not left to a background
# build while the torch path is timed (engine/native/extension.py).
os.environ.setdefault("SLUICE_KERNEL_BUILD", "wait")


def cpu_info() -> dict:
    """The CPU (sluice's own record of it: model, family and model numbers, the kernel-deciding flags) and torch's
    thread count."""
    return {**native_cpu_info(), "torch_threads": torch.get_num_threads()}


def environment() -> dict:
    """What a result depends on besides the code: the CPU and the library versions."""
    import transformers

    import sluice
    return {"cpu": cpu_info(), "versions": {"torch": torch.__version__,
                                            "transformers": transformers.__version__,
                                            "sluice": sluice.__version__},
            # above the core count at the start (or the end, where a script records it): a contended run
            "loadavg_at_start": list(os.getloadavg()), "cores": os.cpu_count()}


def call_times(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of fn, sorted, after `warmup` untimed calls (first-touch of
    pages, lazy builds). Callers take the statistic they report: [0] the best, [len // 2] the median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)


def save_json(path: Path | None, result: dict) -> None:
    if path:
        import json

        from sluice.benchmarks.common import provenance
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**result, **provenance()}, indent=1))
