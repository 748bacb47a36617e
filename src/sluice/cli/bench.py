"""`sluice bench [<name>]`: the speed table against peers by default (benchmarks/speed.py), or a named
benchmark as a sub-subcommand (norms; batch: batched decode, benchmarks/batch_decode.py).

Kept free of torch imports: the arguments are declared here, the work is imported when it runs.
bench/<name>.py scripts reuse the same argument functions, so both accept the same flags.
"""

from __future__ import annotations

import argparse


def add_norms_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="small grid, tiny model shapes, few repeats: runs in seconds (a smoke test, "
                        "not a measurement)")
    p.add_argument("--no-compile", action="store_true",
                   help="only eager rows (torch.compile costs a few seconds per kernel on a small CPU)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every sample here as JSON")
    p.add_argument("--dtypes", default=None, help="comma-separated, default float32,bfloat16")
    p.add_argument("--hidden", default=None, help="comma-separated hidden sizes (default 1024,2048,4096,8192)")
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,16,256,4096)")
    p.add_argument("--reps", type=int, default=None,
                   help="samples per kernel and per decode step, interleaved (default 15, --quick 3)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's choice, one per core); recorded")
    p.add_argument("--models", default=None,
                   help="model shapes for the decode-step share, comma-separated "
                        "(default qwen3-0.6b,llama-3-8b)")
    p.add_argument("--layers", type=int, default=4,
                   help="layers built for llama-3-8b (default 4: 32 do not fit in 24 GiB in fp32); "
                        "qwen3-0.6b is built at its full 28")
    p.add_argument("--kv-len", type=int, default=512, help="tokens already in the KV cache (default 512)")
    p.add_argument("--decode-compile", action="store_true",
                   help="also time the torch.compile'd decode step (minutes of compiling per model)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-step share, kernels only")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel grid, decode-step share only")


def add_speed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or cached repo id (default: the bundled model)")
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.add_argument("--quantize", default=None, metavar="int8|int4",
                   help="sluice's weight-only quantization (llama.cpp then gets a q8_0 GGUF for int8, q4_0 for int4)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the pp test (default 512)")
    p.add_argument("--gen", type=int, default=128, help="new tokens of the tg test (default 128)")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per engine, interleaved (default 3)")
    p.add_argument("--vs", action="append", metavar="ENGINE",
                   help="also time transformers or llama.cpp (repeatable)")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="the checkpoint as GGUF for llama.cpp (default: exported by sluice, cached)")
    p.add_argument("--llama-python", default=None, metavar="PATH",
                   help="a python that can import llama_cpp (default: this one, else .peers/lcpp-venv)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads; llama.cpp gets the same count (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="sluice with compile=True (torch.compile'd decode step)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="sluice's KV cache (LLM(kv_cache_dtype=)); llama.cpp keeps its default, f16")
    p.add_argument("--probe-mib", type=int, default=2048,
                   help="size of the read-bandwidth probe between rounds (default 2048; 0 = none)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every sample here as JSON")
    p.add_argument("--sequential", action="store_true",
                   help="load one engine at a time (its warmup and rounds, then it closes), for checkpoints "
                        "too big to hold twice in memory; by default engines are loaded together and rounds rotate")
    p.add_argument("--passes", type=int, default=1,
                   help="with --sequential: this many passes over the engines, each of --reps rounds per engine, "
                        "the order reversed every other pass (A B, B A, ...), so slow drift of the machine falls on "
                        "both engines alike (default 1)")
    # Speculative decoding, for sluice only (the peers decode plainly): tg then counts emitted tokens,
    # and the acceptance rate and tokens per target forward are printed under the table.
    p.add_argument("--draft-model", default=None, metavar="PATH|bundled",
                   help="sluice speculates with this draft (same tokenizer; 'bundled' for the bundled model)")
    p.add_argument("--prompt-lookup", action="store_true", help="sluice speculates by prompt lookup (n-grams)")
    p.add_argument("--speculative-tokens", default=None, metavar="K|auto",
                   help="guesses per target forward when speculating (default 4; auto adapts)")


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or cached repo id (default: the bundled model)")
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.add_argument("--quantize", default=None, metavar="int8|int4",
                   help="sluice's weight-only quantization (llama.cpp then gets a q8_0 / q4_0 GGUF)")
    p.add_argument("--batch", default=None, metavar="B[,B...]",
                   help="sequences decoding together, comma-separated (default 8)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens of every sequence (default 128)")
    p.add_argument("--gen", type=int, default=None, help="decode steps after the prompt (default 128)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds per engine, interleaved (default 3)")
    p.add_argument("--vs", action="append", metavar="llama.cpp",
                   help="also run llama.cpp's own batched decode, llama-batched-bench")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="the checkpoint as GGUF for llama.cpp (default: exported by sluice, cached)")
    p.add_argument("--batched-bench", default=None, metavar="PATH",
                   help="the llama-batched-bench binary (default: on PATH, else .peers/lcpp-tools/bin/; "
                        "bench/build_batched_bench.sh builds it)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads; llama.cpp gets the same count (default: torch's choice)")
    p.add_argument("--probe-mib", type=int, default=None,
                   help="size of the read-bandwidth probe between rounds (default 2048; 0 = none)")
    p.add_argument("--quick", action="store_true",
                   help="prompt 16, gen 8, batches 1 and 4, one round: a smoke test, not a measurement")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every sample here as JSON")


def cmd_bench_speed(args) -> int:
    from ..benchmarks.common import save_json
    from ..benchmarks.speed import print_tables, run
    result = run(args)
    print_tables(result)
    save_json(args.json, result)
    return 0


def cmd_bench_norms(args) -> int:
    from ..benchmarks.common import save_json
    from ..benchmarks.norms import print_tables, run
    result = run(args)
    print_tables(result)
    save_json(args.json, result)
    return 0


def cmd_bench_batch(args) -> int:
    from ..benchmarks.batch_decode import print_tables, run
    from ..benchmarks.common import save_json
    result = run(args)
    print_tables(result)
    save_json(args.json, result)
    return 0


def add_bench_parser(sub) -> None:
    """Add `bench` and its benchmarks to the `sluice` subcommands (`sub` from add_subparsers)."""
    p = sub.add_parser("bench", help="tokens/s against transformers and llama.cpp (pp512, tg128), or a "
                                     "named benchmark; tables, or JSON",
                       description="With no BENCHMARK: a llama-bench-style table of prefill (pp) and decode "
                                   "(tg) tokens/s at batch 1, greedy, for sluice and the peers named "
                                   "with --vs, interleaved round by round, with achieved GB/s against "
                                   "the read bandwidth measured between rounds (docs/benchmarks.md). "
                                   "The options below belong to this table; a BENCHMARK has its own.",
                       epilog="exit status: 0 ok, 2 bad input (the message names it)")
    add_speed_arguments(p)
    p.set_defaults(func=cmd_bench_speed)
    bench = p.add_subparsers(dest="bench", required=False, metavar="BENCHMARK")
    q = bench.add_parser("norms", help="RMSNorm versus LayerNorm: kernel time and share of a decode step",
                         description="RMSNorm versus LayerNorm (the claim: 'RMSNorm saves 10-50%'): "
                                     "forward time of sluice's norms and torch's own over a grid "
                                     "of sizes, eager and torch.compile'd, and the norms' share of a "
                                     "decode step on Qwen3-0.6B and Llama-3-8B shapes (random weights).",
                         epilog="exit status: 0 ok, 2 bad input (the message names it)")
    add_norms_arguments(q)
    q.set_defaults(func=cmd_bench_norms)
    q = bench.add_parser("batch", help="batched greedy decode tokens/s against llama.cpp's llama-batched-bench",
                         description="Batched decode: B sequences of --prompt random tokens each, prefilled "
                                     "in one step, then --gen greedy steps of B rows; decode tokens/s summed "
                                     "over the rows, against llama.cpp's own batched decode "
                                     "(llama-batched-bench, same GGUF, same threads) with --vs llama.cpp "
                                     "(docs/benchmarks.md).",
                         epilog="exit status: 0 ok, 2 bad input (the message names it)")
    add_batch_arguments(q)
    q.set_defaults(func=cmd_bench_batch)
