"""Run a snippet of Python in a child process with its memory and time capped.

Hardening tests feed sluice hostile input (a chat template that multiplies a string by 10^8, a
config claiming 10^9 layers). If the fix regresses, the test must fail, not take the machine
down: the child gets an address-space limit (RLIMIT_AS; importing torch and sluice needs well
under 1 GiB of it) and a wall-clock timeout, and the test reads its exit status, output and peak
resident memory. The timeout only stops a hang: each caller sets it to at least 10x what its child
takes on a quiet machine, so a busy machine never trips it; tests assert memory and outcomes, not time.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from dataclasses import dataclass


@dataclass
class Bounded:
    returncode: int
    stdout: str
    stderr: str
    peak_mib: float  # the child's peak resident set (VmHWM)
    timed_out: bool


def run_bounded(code: str, mem_mib: int = 2048, timeout: float = 60.0, cwd=None) -> Bounded:
    """Run `code` (dedented) under python -c with at most `mem_mib` MiB of address space and
    `timeout` seconds. The child prints its VmHWM on exit, so a MemoryError still reports a peak."""
    prologue = textwrap.dedent("""
        import atexit, sys
        def _peak():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    sys.stderr.write("\\n@@peak_kib " + line.split()[1] + "\\n")
        atexit.register(_peak)
    """)
    limit = mem_mib * 1024 * 1024

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)], capture_output=True,
                           text=True, timeout=timeout, preexec_fn=cap, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return Bounded(-9, out, err, float("nan"), True)
    peak, err_lines = float("nan"), []
    for line in p.stderr.splitlines():
        if line.startswith("@@peak_kib "):
            peak = int(line.split()[1]) / 1024
        else:
            err_lines.append(line)
    return Bounded(p.returncode, p.stdout, "\n".join(err_lines), peak, False)
