"""`sluice serve` and sluice's native kernel builds (engine/native): no request ever waits for one.

Elsewhere SLUICE_KERNEL_BUILD=wait makes the first call that needs a missing kernel build it in the
foreground, waiting as long as another process holds its build lock. A server cannot: its one worker
thread would hold every request, and SIGTERM could not stop it on time. So `sluice serve` switches its
process to background builds (no_request_waits), and reads "wait" as: the load waits, at most
KERNEL_WAIT_S and never past a SIGTERM, for the native whole-step kernel to be built (wait_for_kernels),
while /health and requests get a 503 with Retry-After that names the build (build_in_progress). After
the load, a kernel still missing is picked up when its background build lands; the torch path serves
meanwhile.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Callable

from ..engine import fast_step
from ..engine.cpu_paths import native_step_fits
from ..engine.native import NATIVE_DIR, build_mode, target
from ..engine.native.lock import holder

KERNEL_WAIT_S = 900.0  # the step kernel's cold build takes 1-3 min on a busy 2-core machine; past this, serve without
POLL_S = 0.5


def no_request_waits() -> bool:
    """Switch this process to background builds; whether SLUICE_KERNEL_BUILD asked to wait (a value that
    is neither raises ConfigError, as anywhere)."""
    wait = build_mode() == "wait"
    os.environ["SLUICE_KERNEL_BUILD"] = "background"
    return wait


@functools.cache
def _targets() -> tuple:
    return tuple(target(source) for source in sorted(NATIVE_DIR.glob("*.cpp")))


def build_in_progress() -> str | None:
    """Who is building one of this environment's kernels now, as a clause for a message; None if nobody."""
    for t in _targets():
        h = holder(t.lock)
        if h is not None:
            return f"its native CPU kernels are being built by {h.describe()} ({h.what or t.source.name})"
    return None


def loading_message(message: str) -> str:
    """A "still loading" refusal, with the kernel build the load may be waiting for."""
    build = build_in_progress()
    return f"{message}: {build}" if build else message


def wait_for_kernels(llm, stopped: Callable[[], bool], timeout: float = KERNEL_WAIT_S) -> str | None:
    """If llm's model can take the native whole step (the kernel that decides its speed, 5x the torch
    step on small models) and that kernel is still to be built: wait for it (another process's build, or
    one started now in the background) until it lands, stopped(), or timeout. None when there is nothing
    left to wait for, else why the wait ended early. The other kernels land while the server serves:
    the sampler's give the torch functions' results bit for bit, so switching to them changes nothing."""
    if llm.engine_config.kernels is False or not native_step_fits(llm.model, llm.device):
        return None
    deadline, said = time.monotonic() + timeout, False
    while fast_step.building():
        if not said:
            said = True
            print(f"sluice serve: the model is loaded; waiting before it says ready (SLUICE_KERNEL_BUILD=wait): "
                  f"{build_in_progress() or 'its native CPU kernels are being built'}", file=sys.stderr, flush=True)
        if stopped():
            return "the server is shutting down"
        if time.monotonic() > deadline:
            return f"still building after {timeout:.0f} s ({build_in_progress() or 'nobody holds a build lock'})"
        time.sleep(POLL_S)
    return None
