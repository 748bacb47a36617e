"""How long the tests take here: the inner loop (`pytest -m "not slow"`) and the full suite (`pytest`, what
CI and the README's test command run).

    python bench/suite_times.py --out docs/results/suite-times.json      # both, quick first
    python bench/suite_times.py --only quick

Wall seconds of each run, pytest's own summary line (passed / skipped / deselected), and the load average
before and after: a run whose load passed the core count is marked contended. Kernels are built before the
first timed run, so neither run pays for a compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_info, save_json

from sluice.benchmarks.common import code_version

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"quick": ["-m", "not slow"], "full": []}


def run(extra: list[str]) -> dict:
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra], cwd=ROOT,
                       capture_output=True, text=True)
    seconds = time.monotonic() - t0
    summary = next((line.strip("= ") for line in reversed(p.stdout.splitlines()) if " in " in line), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary)}
    after = os.getloadavg()[0]
    return {"seconds": round(seconds, 1), "minutes": round(seconds / 60, 1), "rc": p.returncode,
            "summary": summary, **counts, "load_before": round(load, 2), "load_after": round(after, 2),
            "contended": max(load, after) > (os.cpu_count() or 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--only", choices=list(RUNS), help="time one of the two runs")
    args = ap.parse_args(argv)
    subprocess.run([sys.executable, "-c", "from sluice.engine import fast_step, gemv, select\n"
                    "for m in (fast_step, gemv, select): m.why_unavailable()"], check=True)  # common: build mode "wait"
    result = {"machine": {"cpu": cpu_info(), "cpus": os.cpu_count(), "code": code_version(),
                          "date": time.strftime("%Y-%m-%d")}}
    for name, extra in RUNS.items():
        if args.only in (None, name):
            result[name] = run(extra)
            print(f"{name}: {result[name]['summary']} ({result[name]['minutes']} min, load "
                  f"{result[name]['load_before']}-{result[name]['load_after']})", flush=True)
    save_json(args.out, result)
    return 0 if all(r["rc"] == 0 for k, r in result.items() if k in RUNS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
