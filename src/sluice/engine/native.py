"""Building sluice's own CPU extensions (gemv.cpp, and any other engine/*.cpp) once per machine.

Each extension is compiled on first use with the compiler torch's cpp_extension finds, for this
machine (-march=native; the build directory's name carries a hash of the source, the CPU's flags and
torch's version, so a cache shared between different CPUs never runs a foreign build) and cached
across runs in torch's extension directory. Without a compiler, or on a CPU without AVX2 + FMA, or
with SLUICE_NO_KERNELS set, the extension is unavailable and says why; callers keep their plain
torch path then. SLUICE_KERNEL_FLAGS adds compiler flags (part of the build's hash): "-mno-avx512f"
builds the AVX2 paths on an AVX-512 CPU, to test or time what an AVX2-only machine runs.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

# -fopenmp: at::parallel_for splits work across torch's OpenMP threads only when the extension itself
# is compiled with OpenMP; without it the pragma is dropped and the kernel runs on one core (what the
# first measurements in docs/benchmarks.md saw: 9-10 GB/s against 13-16 with two threads).
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

# torch's build lock (a file named `lock` in the build directory) is removed by the process that
# built; one killed mid-build leaves it, and every later load would wait on it forever. A build takes
# about a minute here: a lock this much older than that belongs to no live build.
STALE_LOCK_SECONDS = 15 * 60


def cflags() -> list[str]:
    """CFLAGS plus the extra flags in SLUICE_KERNEL_FLAGS (whitespace-separated), if any."""
    return CFLAGS + os.environ.get("SLUICE_KERNEL_FLAGS", "").split()


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove build_dir/lock if it is older than STALE_LOCK_SECONDS; True if it did."""
    import time
    lock = Path(build_dir) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except OSError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False
    print(f"sluice: removing a stale build lock {lock} ({age / 60:.0f} min old; a killed build left it)",
          file=sys.stderr, flush=True)
    lock.unlink(missing_ok=True)
    return True


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


class NativeExtension:
    """One engine/*.cpp built lazily; `.module()` is the loaded extension or None (see `.failure`).
    The source must export `bool has_avx2()`, so a build that lost -march=native is caught."""

    def __init__(self, source: Path, what: str):
        self.source, self.what = source, what
        self.failure: str | None = None
        self._module = None
        self._lock = threading.Lock()

    def _build(self):
        from torch.utils.cpp_extension import _get_build_directory, load
        flags = cflags()
        tag = hashlib.sha256(self.source.read_bytes() + " ".join(sorted(cpu_flags()) + flags).encode()
                             + torch.__version__.encode()).hexdigest()[:12]
        name = f"sluice_{self.source.stem}_{tag}"
        build_dir = Path(_get_build_directory(name, verbose=False))
        clear_stale_lock(build_dir)
        if not any(build_dir.glob("*.so")):
            print(f"sluice: building its {self.what} (once per machine, about a minute)...",
                  file=sys.stderr, flush=True)
        return load(name=name, sources=[str(self.source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    verbose=False)

    def module(self):
        if self._module is not None or self.failure is not None:
            return self._module
        with self._lock:
            if self._module is None and self.failure is None:
                if os.environ.get("SLUICE_NO_KERNELS"):
                    self.failure = "disabled by SLUICE_NO_KERNELS"
                elif not {"avx2", "fma"} <= cpu_flags():
                    self.failure = "this CPU has no AVX2 + FMA"
                else:
                    try:
                        self._module = self._build()
                    except Exception as e:  # no compiler, no headers: the plain path stays
                        first = str(e).splitlines()[0] if str(e) else type(e).__name__
                        self.failure = f"could not build the {self.what}: {first}"
                if self._module is not None and not self._module.has_avx2():
                    self.failure = f"the {self.what} was built without AVX2 + FMA"
        return self._module if self.failure is None else None

    def why_unavailable(self) -> str | None:
        """None when the extension builds and loads here, else why not (building it on first call)."""
        self.module()
        return self.failure
