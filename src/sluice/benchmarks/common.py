"""What every benchmark records (CPU, versions, threads, commit) and how it times a call."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..engine.gemv import cpu_info

# A benchmark times the native kernels: a missing one is built first (saying so), not left to a background
# build while the torch path is timed (engine/native/extension.py).
os.environ.setdefault("SLUICE_KERNEL_BUILD", "wait")


ISA_ENV = ("SLUICE_KERNEL_FLAGS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def code_version() -> dict:
    """The commit the measured code comes from (None outside a git checkout) and whether
    src/sluice had uncommitted changes, read once at the start of a run."""
    pkg = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(pkg), *args], capture_output=True, text=True,
                                  timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", ".")
    return {"sluice_path": str(pkg), "commit": commit,
            "uncommitted_changes": bool(dirty) if commit and dirty is not None else None}


def environment() -> dict:
    from .. import __version__
    return {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "versions": {"torch": torch.__version__, "python": platform.python_version(),
                         "sluice": __version__},
            # glibc's allocator settings decide whether a big tensor comes back from the OS (page
            # faults on every call) or from the heap; LD_PRELOAD may swap in another allocator.
            "allocator_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"},
            # what narrows the instruction sets below the CPU's: sluice's kernel build flags (-mno-avx512f: the AVX2
            # paths), ATen's and oneDNN's dispatch caps; docs tables put such runs under a machine kind of their own
            "isa_env": {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)},
            "code": code_version(), "loadavg_at_start": list(os.getloadavg()), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int,
                     min_sample_s: float) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds per call of each function: `reps` samples each, taken round-robin (A B C, B C A,
    ...) so that drift and background load hit every function alike. A sample is n back-to-back
    calls, n chosen per function so one sample lasts at least `min_sample_s` (a 5 us call is
    timed in batches; a 300 ms one alone). The caller warms up (compiles) before this."""
    calls = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        once = max(time.perf_counter() - t0, 1e-7)
        calls[name] = max(1, math.ceil(min_sample_s / once))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    gc_was_on = gc.isenabled()
    gc.disable()  # a collection in the middle of one sample would be charged to one function
    try:
        for r in range(reps):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn, n = fns[name], calls[name]
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                samples[name].append((time.perf_counter() - t0) / n)
    finally:
        if gc_was_on:
            gc.enable()
    return samples, calls


def summary(xs: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one sample) and the samples themselves, as results files keep them."""
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "samples": xs}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def provenance() -> dict:
    """What a results file adds as it is written: the native builds the run loaded (their names carry a hash of
    the sources they were built from) and the code version then. A build is made at first use, so a run whose
    sources changed after it started shows it here: code_at_save differs from the environment's code."""
    from ..engine.native.extension import LOADED
    return {"native_kernels": list(LOADED), "code_at_save": code_version()}


def save_json(path: str | Path | None, result: dict) -> None:
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**result, **provenance()}, indent=1))


def script_main(prog: str, doc: str, add_arguments: Callable, run: Callable, print_tables: Callable,
                argv=None) -> dict:
    """What each bench/<name>.py script does: the package's arguments, run, tables, optional JSON;
    a bad input is one line on stderr and exit status 2, as `sluice bench` gives it."""
    import argparse
    import sys

    from ..errors import SluiceError
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        result = run(args)
    except SluiceError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print_tables(result)
    save_json(args.json, result)
    return result
