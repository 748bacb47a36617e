"""`sluice serve` and sluice's native kernel builds (engine/native): no request ever waits for one.

Elsewhere SLUICE_KERNEL_BUILD=wait makes the first call that needs a missing kernel build it in the
foreground, waiting as long as another process holds its build lock. A server cannot: its one worker
thread would hold every request, and SIGTERM could not stop it on time. So `sluice serve` switches its
process to background builds (no_request_waits), and reads "wait" as: the load waits, at most
KERNEL_WAIT_S and never past a SIGTERM, for this environment's kernels to be built (wait_for_kernels),
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

from ..engine.native import NATIVE_DIR, build_mode, cache_root, cpu_flags, missing_tools, target
from ..engine.native.extension import building_under, start_background
from ..engine.native.lock import holder

KERNEL_WAIT_S = 900.0  # a cold build of all five on a busy 2-core machine took ~5 min; past this, serve without
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


def wait_for_kernels(stopped: Callable[[], bool], timeout: float = KERNEL_WAIT_S) -> str | None:
    """Wait until every kernel of this environment is built, or has no build running (another process's
    is waited for; with none, one is started in the background), or stopped(), or timeout. None when
    there is nothing left to wait for, else why the wait ended early."""
    if os.environ.get("SLUICE_NO_KERNELS") or not {"avx2", "fma"} <= cpu_flags() or missing_tools():
        return None  # the kernels cannot be had here; the extensions say why when asked
    deadline, started, said = time.monotonic() + timeout, False, False
    while missing := [t for t in _targets() if not t.ready()]:
        if not building_under(cache_root()):
            if started:  # ours ended without them: its log says why; the torch path serves
                return f"the kernel build ended without {missing[0].source.name} (see {missing[0].log})"
            start_background(missing[0])
            started = True
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
