"""One check for the AVX2 builds of sluice's native kernels, run on a machine with AVX-512.

Which SIMD path a kernel compiles depends on the CPU (build.py passes -march=native), and the machines
this project runs on differ: an AVX2-only AMD EPYC runs code that an AVX-512 Xeon never compiles. So on
an AVX-512 CPU each kernel's tests run a second time in a subprocess, against a build made as an
AVX2-only CPU would make it (SLUICE_KERNEL_FLAGS="-mno-avx512f -mno-avxvnni"; about a minute a kernel). On an
AVX2-only CPU the tests themselves already run that path, so the check skips.

-mno-avxvnni too: an Intel Xeon with AMX also has AVX-VNNI (the 256-bit VEX form of vpdpbusd), which
-march=native turns on and -mno-avx512f leaves on, so its "AVX2" build summed int4 and int8 codes with VNNI
(q4t.h, q8t.h) and the maddubs path of an AVX2-only AMD EPYC (Zen 2/3: no AVX-VNNI) went untested there.

These subprocesses keep torch's own kernels at the CPU's width (16 lanes). What only an AVX2 CPU's torch does (its
softmax sums in 8 lanes, inductor's 8-lane code) shows only in a whole run with torch capped as well. One such run
(2026-12-04) found a failure an AVX2-only host's CI would have had (a top_p test whose cut fell inside the 8-lane
bracket) and one of the capping itself (inductor's cache serving 16-lane code to the capped run; engine/mixed.py's
compile_forward). About 11 minutes here; worth a run before a kernel or sampler change lands:
    SLUICE_KERNEL_FLAGS="-mno-avx512f -mno-avxvnni" ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
    TORCH_EXTENSIONS_DIR=<a directory of its own> .venv/bin/python -m pytest -m "slow or not slow"
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.engine.gemv import cpu_flags

AVX2_FLAGS = "-mno-avx512f -mno-avxvnni"


def run_avx2_build(module: str, test_files: str | list[str], select: str) -> None:
    """Build `sluice.engine.<module>`'s kernel for AVX2 only, check that the build lacks AVX-512, then
    run the tests of `test_files` (one path or several) that `select` (a pytest -k expression) picks against it."""
    if "avx512f" not in cpu_flags():
        pytest.skip("no AVX-512 on this CPU: the default build is the AVX2 path, which the tests above check")
    if os.environ.get("SLUICE_KERNEL_FLAGS"):
        pytest.skip("SLUICE_KERNEL_FLAGS is set: the tests above already run the build it asks for")
    env = {**os.environ, "SLUICE_KERNEL_FLAGS": AVX2_FLAGS}
    probe = (f"from sluice.engine import {module} as m; k = m.kernel(); "
             "assert k is not None, m.why_unavailable(); assert k.has_avx2() and not k.has_avx512()")
    # The limits stop hangs (10x+ the build's minute and the tests' minutes); they are not speed limits.
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    tests = [Path(f).resolve() for f in ([test_files] if isinstance(test_files, str) else test_files)]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, tests), "-k", select],
                       env=env, capture_output=True, text=True, timeout=1800, cwd=tests[0].parents[2])
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-3000:]
