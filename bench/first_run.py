"""What a newcomer waits for: `sluice demo` with an empty kernel cache, the same again once the background
build has landed, and a run right after that build was killed mid-compile.

    python bench/first_run.py --out docs/results/first-run.json

Each demo runs as a user runs it (`python -m sluice demo`, the default SLUICE_KERNEL_BUILD=background) with
TORCH_EXTENSIONS_DIR pointing at a fresh, empty folder, so nothing this machine built before is used. Times
are wall seconds from starting the process: to the first generated character of the first completion, and
to its end. The load average is recorded beside each run; a run whose load passed the core count is marked
contended and is not a result.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import cpu_info, save_json

from sluice.benchmarks.common import code_version

FIRST_PROMPT = b"def fibonacci(n):"  # the demo's first prompt: what follows it is the first token
BUILDER = re.compile(r"\(pid (\d+)")


def demo(ext_dir: Path) -> dict:
    """One `sluice demo`: first-token and total seconds, its decode rates, its stderr lines, the builder's pid."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLUICE_KERNEL_BUILD", "SLUICE_NO_KERNELS")}
    env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "sluice", "demo"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    err: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: err.extend((time.monotonic() - t0, line.decode().rstrip())
                                                        for line in p.stderr), daemon=True)
    reader.start()
    out, first = b"", None
    while chunk := os.read(p.stdout.fileno(), 4096):
        out += chunk
        i = out.find(FIRST_PROMPT)
        if first is None and i >= 0 and len(out) > i + len(FIRST_PROMPT):
            first = time.monotonic() - t0
    rc = p.wait()
    total = time.monotonic() - t0
    reader.join(10)
    pids = [int(m.group(1)) for _, line in err if (m := BUILDER.search(line))]
    return {"rc": rc, "first_token_s": round(first, 2) if first is not None else None, "total_s": round(total, 2),
            "decode_tok_s": [float(x) for x in re.findall(rb"decode (\d+) tok/s", out)],
            "stderr": [f"@{t:.1f}s {line}" for t, line in err], "builder_pid": pids[0] if pids else None,
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid: int | None, t0: float) -> float | None:
    """Seconds from t0 until process `pid` is gone (None when there was none)."""
    if pid is None:
        return None
    while alive(pid):
        time.sleep(0.5)
    return round(time.monotonic() - t0, 1)


def machine() -> dict:
    import platform
    return {"cpu": cpu_info(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "code": code_version(), "date": time.strftime("%Y-%m-%d")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--kill-after", type=float, default=20.0,
                    help="seconds into the background build at which the killed-build case kills it")
    args = ap.parse_args(argv)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-first-run-") as tmp:
        cold_dir, killed_dir = Path(tmp, "cold"), Path(tmp, "killed")
        t0 = time.monotonic()
        runs["empty_cache"] = demo(cold_dir)
        runs["empty_cache"]["build_landed_s"] = wait_gone(runs["empty_cache"]["builder_pid"], t0)
        runs["built"] = demo(cold_dir)

        # A build killed mid-compile (SIGKILL to its whole process group, as a closed terminal or an OOM
        # kill would), then a rerun at once: it must not wait on the dead build's lock.
        t0 = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k not in ("SLUICE_KERNEL_BUILD", "SLUICE_NO_KERNELS")}
        env["TORCH_EXTENSIONS_DIR"] = str(killed_dir)
        starter = subprocess.run([sys.executable, "-c", "from sluice.engine import fast_step; "
                                  "print(fast_step.why_unavailable())"], capture_output=True, text=True, env=env)
        m = BUILDER.search(starter.stdout + starter.stderr)
        if m is None:
            raise SystemExit(f"no background build started: {starter.stdout}{starter.stderr}")
        pid = int(m.group(1))
        time.sleep(args.kill_after)
        os.killpg(pid, signal.SIGKILL)  # the builder leads its own session
        runs["after_killed_build"] = demo(killed_dir)
        runs["after_killed_build"]["killed_at_s"] = args.kill_after
        runs["after_killed_build"]["build_landed_s"] = wait_gone(runs["after_killed_build"]["builder_pid"], t0)
        runs["after_killed_build_built"] = demo(killed_dir)

    cores = os.cpu_count() or 1
    for r in runs.values():
        r["contended"] = max(r["load_before"], r["load_after"]) > cores
    result = {"machine": machine(), "runs": runs}
    for name, r in runs.items():
        print(f"{name:26s} rc={r['rc']} first token {r['first_token_s']} s, total {r['total_s']} s, "
              f"decode {r['decode_tok_s']} tok/s, load {r['load_before']}-{r['load_after']}"
              + (", CONTENDED" if r["contended"] else "")
              + (f", build landed at {r['build_landed_s']} s" if r.get("build_landed_s") else ""))
    save_json(args.out, result)
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
