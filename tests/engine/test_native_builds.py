"""Every native kernel builds wherever it can: on a machine with a compiler, ninja and AVX2 + FMA (every
CI machine here), a kernel that does not build fails the suite here, instead of its tests skipping (they
skip where the kernel is unavailable, which on such a machine means a broken build). Where the machine
cannot build (no compiler, no AVX2 + FMA, SLUICE_NO_KERNELS set) this skips, saying why."""

from __future__ import annotations

import os

import pytest

from sluice.engine import accept, fast_step, gemv, sample, select
from sluice.engine.native.build import cpu_flags, missing_tools

KERNELS = {"step": fast_step.why_unavailable, "select": select.why_unavailable, "gemv": gemv.why_unavailable,
           "sample": sample.why_unavailable, "accept": accept.why_unavailable}


def why_this_machine_cannot_build() -> str | None:
    if os.environ.get("SLUICE_NO_KERNELS"):
        return "SLUICE_NO_KERNELS is set"
    if not {"avx2", "fma"} <= cpu_flags():
        return "this CPU has no AVX2 + FMA"
    missing = missing_tools()
    return "; ".join(missing) if missing else None


@pytest.mark.parametrize("name", KERNELS)
def test_the_kernel_builds_where_the_machine_can(name):
    cannot = why_this_machine_cannot_build()
    if cannot is not None:
        pytest.skip(f"no native kernels on this machine: {cannot}")
    # tests/conftest.py sets SLUICE_KERNEL_BUILD=wait: a missing kernel is built now, in the foreground
    why = KERNELS[name]()
    assert why is None, f"the {name} kernel did not build on a machine that can build it: {why}"
