"""Per-rank memory under tensor parallelism: what each rank holds after parallel.load_rank, against
the whole model loaded in one process, measured two ways: the bytes of the rank's distinct
parameters (parallel.resident_bytes) and the growth of the process's anonymous resident memory
(RssAnon) over the load.

    python bench/random_checkpoint.py qwen3-0.6b --dtype bfloat16 --out /tmp/sluice-q06-bf16
    flock /tmp/sluice-bench.lock .venv/bin/python bench/tp_memory.py --model /tmp/sluice-q06-bf16 \
        --ranks 2,4 --json docs/results/bench-tp-memory.json

Ranks are spawned processes in one gloo group (file store), one thread each; nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
from pathlib import Path

import torch

from common import environment


def rss_bytes() -> int:
    """Anonymous resident memory (RssAnon): the process's own copies. File-backed pages of the
    mmapped checkpoint (RssFile) are the shared, evictable page cache: a rank reading a column
    slice (o, down) touches every row of the file's tensor, which VmRSS would count against it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _rank(model: str, dtype: str, rank: int, world: int, store: str, q) -> None:
    torch.set_num_threads(1)
    from sluice import parallel as P
    ranks = P.init(rank, world, store, timeout_s=300)
    try:
        before = rss_bytes()
        m = P.load_rank(model, ranks, dtype=dtype)
        q.put((rank, P.resident_bytes(m), rss_bytes() - before, m.huge_pages))
    finally:
        P.shutdown()


def whole(model: str, dtype: str, q) -> None:
    torch.set_num_threads(1)
    from sluice import load
    from sluice.parallel import resident_bytes
    before = rss_bytes()
    m = load(model, dtype=dtype)
    q.put((resident_bytes(m), rss_bytes() - before, m.huge_pages))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=whole, args=(a.model, a.dtype, q))
    p.start()
    w_bytes, w_rss, w_huge = q.get()
    p.join()
    out = {"benchmark": "tp_memory", **environment(), "model": a.model, "dtype": a.dtype,
           "whole": {"param_bytes": w_bytes, "rss_anon_growth": w_rss, "huge_pages": w_huge}, "ranks": {}}
    print(f"one process: parameters {w_bytes / 2**20:.1f} MiB, RssAnon growth {w_rss / 2**20:.1f} MiB, "
          f"huge pages {w_huge['moved_bytes'] / 2**20:.1f} MiB ({w_huge['reason'] or 'moved'})")
    for n in (int(x) for x in a.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            store = f"file://{tmp}/store"
            procs = [ctx.Process(target=_rank, args=(a.model, a.dtype, r, n, store, q)) for r in range(n)]
            for pr in procs:
                pr.start()
            got = sorted(q.get() for _ in range(n))
            for pr in procs:
                pr.join()
        rows = [{"rank": r, "param_bytes": b, "rss_anon_growth": g, "param_share": b / w_bytes, "huge_pages": h}
                for r, b, g, h in got]
        out["ranks"][str(n)] = rows
        for row in rows:
            print(f"N={n} rank {row['rank']}: parameters {row['param_bytes'] / 2**20:.1f} MiB "
                  f"({row['param_share']:.3f} of the whole, 1/N = {1 / n:.3f}), "
                  f"RssAnon growth {row['rss_anon_growth'] / 2**20:.1f} MiB, "
                  f"huge pages {row['huge_pages']['moved_bytes'] / 2**20:.1f} MiB ({row['huge_pages']['reason'] or 'moved'})")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
