"""The sampler's random draws: torch's mt19937 generator (what every sampler used before
engine/noise.py) against the counter-based noise, for whole rows and for top-k candidates, and the
Sampler over 8 rows (4 sampled with top_k 40 / top_p 0.95, 4 greedy), as the load test's batches are.

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/sampling_noise.py

Medians of --repeats calls (and the 10th percentile: this machine's neighbours make medians jumpy), in
microseconds. Results in docs/benchmarks.md ("counter-based sampling noise"), with the CPU's flags.
"""

from __future__ import annotations

import argparse

import torch

from common import call_times
from sluice.engine.native import cpu_flags
from sluice.engine.noise import RowStream, uniforms_at, uniforms_range
from sluice.engine.sampling import Sampler, SamplingParams


def us(fn, repeats: int) -> tuple[float, float]:
    """(median, 10th percentile) microseconds a call."""
    times = call_times(fn, repeats, warmup=max(10, repeats // 10))
    return times[len(times) // 2] * 1e6, times[len(times) // 10] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=500)
    args = ap.parse_args()
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    print(f"threads {torch.get_num_threads()}, CPU flags {' '.join(flags)}")
    rows = [RowStream(i) for i in range(4)]
    for V in (8192, 151_936):
        gens, out = [torch.Generator().manual_seed(i) for i in range(4)], torch.empty(4, V)
        r = max(20, args.repeats // (V // 8192))
        ids = torch.randint(0, V, (4, 40))
        old = us(lambda out=out, gens=gens: [out[i].uniform_(generator=gens[i]) for i in range(4)], r)
        new = us(lambda V=V: uniforms_range(rows, 0, V), r)
        cand = us(lambda ids=ids: uniforms_at(rows, ids), r)
        print(f"V={V:>7}, 4 rows: mt19937 whole rows {old[0]:7.0f} (p10 {old[1]:.0f})   counter whole rows "
              f"{new[0]:6.0f} (p10 {new[1]:.0f})   counter, 40 candidates a row {cand[0]:4.0f} (p10 {cand[1]:.0f})")
    V = 8192
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=i) if i % 2 else SamplingParams(temperature=0.0)
              for i in range(8)]
    sampler, x = Sampler(params, V), torch.randn(8, V, generator=torch.Generator().manual_seed(0)) * 3
    med, p10 = us(lambda: sampler(x), args.repeats)
    print(f"Sampler, 8 rows of {V} (4 sampled, top_k 40, top_p 0.95): {med:.0f} us (p10 {p10:.0f})")


if __name__ == "__main__":
    main()
