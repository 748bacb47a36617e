"""RMSNorm versus LayerNorm (the claim: "RMSNorm saves 10-50%"): kernel time over a grid of sizes,
eager and torch.compile'd, and the norms' share of a decode step on Qwen3-0.6B / Llama-3-8B shapes.

    python bench/norms.py --json docs/bench-norms.json          # full run (kernels + decode share)
    python bench/norms.py --quick --no-compile --json o.json    # seconds-long smoke test

A thin wrapper: the benchmark lives in the package (sluice.benchmarks.norms), so an installed
sluice runs the same thing as `sluice bench norms`. Flags: see --help.
"""

from __future__ import annotations

import argparse
import sys

from sluice.benchmarks.cli import add_norms_arguments
from sluice.benchmarks.common import save_json
from sluice.benchmarks.norms import print_tables, run
from sluice.errors import SluiceError


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_norms_arguments(ap)
    args = ap.parse_args(argv)
    try:
        result = run(args)
    except SluiceError as e:
        print(f"bench/norms.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    print_tables(result)
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
