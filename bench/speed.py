"""sluice against its peers, llama-bench style: pp512 / tg128 tokens/s at batch 1, greedy, mean and
standard deviation over interleaved rounds, ratios to sluice, and achieved GB/s against the read
bandwidth measured between rounds.

    python bench/speed.py --vs transformers --vs llama.cpp --json runs/bench/speed.json
    python bench/speed.py --model DIR --dtype bfloat16 --vs llama.cpp --gguf model-bf16.gguf

A thin wrapper: the benchmark lives in the package (sluice.benchmarks.speed), so an installed
sluice runs the same thing as `sluice bench`. Flags: see --help.
"""

from __future__ import annotations

from sluice.cli.bench import add_speed_arguments
from sluice.benchmarks.common import script_main
from sluice.benchmarks.speed import print_tables, run


def main(argv=None) -> dict:
    return script_main("bench/speed.py", __doc__, add_speed_arguments, run, print_tables, argv)


if __name__ == "__main__":
    main()
