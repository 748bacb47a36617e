"""sluice against its peers, llama-bench style: pp512 / tg128 tokens/s at batch 1, greedy, mean and
standard deviation over interleaved rounds, ratios to sluice, and achieved GB/s against the read
bandwidth measured between rounds.

    python bench/speed.py --vs transformers --vs llama.cpp --json runs/bench/speed.json
    python bench/speed.py --model DIR --dtype bfloat16 --vs llama.cpp --gguf model-bf16.gguf

A thin wrapper: the benchmark lives in the package (sluice.benchmarks.speed), so an installed
sluice runs the same thing as `sluice bench`. Flags: see --help.
"""

from __future__ import annotations

import argparse
import sys

from sluice.benchmarks.cli import add_speed_arguments
from sluice.benchmarks.common import save_json
from sluice.benchmarks.speed import print_tables, run
from sluice.errors import SluiceError


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_speed_arguments(ap)
    args = ap.parse_args(argv)
    try:
        result = run(args)
    except SluiceError as e:
        print(f"bench/speed.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    print_tables(result)
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
