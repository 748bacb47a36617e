"""This machine's ceilings, measured: memory bandwidth (a large tensor copy), matmul FLOP/s, free memory.

The copy is STREAM's "copy" kernel done by torch: read N bytes, write N bytes, counted as 2N bytes
moved. The source is far larger than any last-level cache, so this is DRAM's rate. A decode step
mostly reads (weights, KV cache), which this rate bounds from above.

Matmul FLOP/s is the best of a few shapes, from a matrix-vector product with the weight in cache
(batch-1 decode's shape) to a square product: on some CPUs the fastest path for a dtype is not the
big GEMM (PyTorch's bf16 GEMM without AVX-512-bf16 or AMX is far slower than its bf16 GEMV), and
a ceiling is the best the hardware and library reach, not the speed of one shape.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

COPY_BYTES = 512 << 20  # 512 MiB: 16x a 32 MiB L3
MATMUL_SHAPES = ((1, 1024, 1024), (1, 4096, 4096), (64, 1024, 1024), (512, 512, 512))


def _best(fn, min_s: float, min_reps: int = 3) -> float:
    """Fastest of repeated calls (seconds): at least min_reps calls and min_s seconds of them."""
    fn()  # first touch: page faults, lazy init
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def stream_copy(nbytes: int = COPY_BYTES, reps: int = 7) -> dict:
    """{"GB_s": best, "GB_s_median": median, "bytes": n}: 2n bytes moved per copy of n bytes."""
    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    moved = 2 * src.nbytes
    return {"GB_s": moved / min(times) / 1e9, "GB_s_median": moved / statistics.median(times) / 1e9,
            "bytes": src.nbytes, "reps": reps}


def matmul_flops(dtype: torch.dtype, shapes=MATMUL_SHAPES, min_s: float = 0.3) -> dict:
    """{"GFLOP_s": best over shapes, "shapes": [{m, k, n, GFLOP_s}]} for F.linear in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        best = _best(lambda x=x, w=w: F.linear(x, w), min_s)
        rows.append({"m": m, "k": k, "n": n, "GFLOP_s": 2 * m * k * n / best / 1e9})
    return {"GFLOP_s": max(r["GFLOP_s"] for r in rows), "shapes": rows}


def measure(dtype: torch.dtype, copy_bytes: int = COPY_BYTES) -> dict:
    """What `cpu-this-machine` means: the measured copy bandwidth and matmul FLOP/s in `dtype`."""
    return {"stream_copy": stream_copy(copy_bytes), "matmul": matmul_flops(dtype),
            "threads": torch.get_num_threads()}


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
