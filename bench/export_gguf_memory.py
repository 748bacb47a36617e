"""Peak memory and time of `sluice export-gguf`, this checkout's against another sluice source tree.

    python bench/random_checkpoint.py qwen3-0.6b --dtype float32 --out /tmp/q06-f32
    git archive c33e256 src | tar -x -C /tmp/before         # the whole-model export, for comparison
    python bench/export_gguf_memory.py --model /tmp/q06-f32 --before-src /tmp/before/src \\
        --before-label c33e256 --out docs/results/export-gguf-memory.json

Each export runs in a fresh process; the peak is Linux's resident high-water mark (VmHWM), reset
after the imports, so it is the export's own peak plus what the imports hold. The GGUF file goes
to a temporary directory and is deleted after each run. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CHILD = """
import json, sys, time
from sluice.model.gguf_export import export_gguf
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark from here on
before = status("VmRSS")
start = time.perf_counter()
summary = export_gguf(sys.argv[1], sys.argv[2], sys.argv[3])
print(json.dumps({"seconds": round(time.perf_counter() - start, 2), "rss_before_mb": round(before / 2**20, 1),
                  "peak_rss_mb": round(status("VmHWM") / 2**20, 1), "file_mb": round(summary["bytes"] / 2**20, 1)}))
"""


def run(model: Path, outtype: str, src: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="export-gguf-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(src)}
        r = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(Path(tmp) / "m.gguf"), outtype],
                           capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode:
        raise SystemExit(f"export with {src} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--before-src", type=Path, required=True, help="a sluice src/ tree to compare with")
    ap.add_argument("--before-label", required=True, help="what that tree is (a commit)")
    ap.add_argument("--outtypes", nargs="+", default=["bf16", "q8_0"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    files = sorted(args.model.glob("*.safetensors"))
    result = {"model": args.model.name, "checkpoint_mb": round(sum(p.stat().st_size for p in files) / 2**20, 1),
              "dtype": json.loads((args.model / "config.json").read_text()).get("torch_dtype")
              or json.loads((args.model / "config.json").read_text()).get("dtype"),
              "before": args.before_label, "after": commit(), "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "load_average_at_start": os.getloadavg()[0], "runs": {}}
    start = time.time()
    for outtype in args.outtypes:
        before = run(args.model, outtype, args.before_src.resolve())
        after = run(args.model, outtype, ROOT / "src")
        result["runs"][outtype] = {"before": before, "after": after,
                                   "peak_ratio": round(after["peak_rss_mb"] / before["peak_rss_mb"], 3),
                                   "time_ratio": round(after["seconds"] / before["seconds"], 3)}
        print(outtype, result["runs"][outtype], flush=True)
    result["wall_seconds"] = round(time.time() - start, 1)
    result["load_average_at_end"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
