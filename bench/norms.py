"""RMSNorm versus LayerNorm (the claim: "RMSNorm saves 10-50%"): kernel time over a grid of sizes,
eager and torch.compile'd, and the norms' share of a decode step on Qwen3-0.6B / Llama-3-8B shapes.

    python bench/norms.py --json docs/results/bench-norms.json          # full run (kernels + decode share)
    python bench/norms.py --quick --no-compile --json o.json    # seconds-long smoke test

A thin wrapper: the benchmark lives in the package (sluice.benchmarks.norms), so an installed
sluice runs the same thing as `sluice bench norms`. Flags: see --help.
"""

from __future__ import annotations

from sluice.cli.bench import add_norms_arguments
from sluice.benchmarks.common import script_main
from sluice.benchmarks.norms import print_tables, run


def main(argv=None) -> dict:
    return script_main("bench/norms.py", __doc__, add_norms_arguments, run, print_tables, argv)


if __name__ == "__main__":
    main()
