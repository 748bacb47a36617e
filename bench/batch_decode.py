"""Batched greedy decode, sluice against llama.cpp's own batched decode (llama-batched-bench): decode
tokens/s summed over B rows of a 128-token prompt and 128 new tokens each, interleaved rounds.

    python bench/batch_decode.py --model DIR --dtype bfloat16 --vs llama.cpp --json docs/results/bench-batch-q06-bf16.json
    python bench/batch_decode.py --quick                                    # a smoke test

llama-batched-bench is not in llama-cpp-python's wheel: `bash bench/build_batched_bench.sh` builds it.
A thin wrapper: the benchmark lives in the package (sluice.benchmarks.batch_decode), so an installed
sluice runs the same thing as `sluice bench batch`. Flags: see --help.
"""

from __future__ import annotations

from sluice.benchmarks.batch_decode import print_tables, run
from sluice.benchmarks.common import script_main
from sluice.cli.bench import add_batch_arguments


def main(argv=None) -> dict:
    return script_main("bench/batch_decode.py", __doc__, add_batch_arguments, run, print_tables, argv)


if __name__ == "__main__":
    main()
