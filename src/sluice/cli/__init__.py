"""The `sluice` command line: demo, generate, chat, inspect, train, serve, bench, profile, export-gguf, lens.

Every failure reaches the user as one line on stderr, never a traceback: a SluiceError (bad input,
named) or an OSError (the file system said no) exits 2; Ctrl-C, even during start-up while torch
is still importing, exits 130; a closed stdout pipe (`sluice generate ... | head`) ends quietly;
anything else is a bug in sluice and says so (SLUICE_TRACEBACK=1 shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from ..errors import SluiceError
from .common import check_streams, constraint_args, model_args, sampling_args, special_tokens_arg, tp_args
from .inspect import cmd_inspect
from .run import cmd_chat, cmd_demo, cmd_generate
from .serve import add_serve_parser
from .train import cmd_train


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: these pull in torch, and main() catches a Ctrl-C only from here on.
    from .bench import add_bench_parser
    from .gguf import add_export_gguf_parser
    from .lens import add_lens_parser
    from .profile import add_profile_parser, add_roofline_parser

    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="stream a few completions from the bundled model and show its "
                                    "four numerical valves")
    model_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="continue a prompt, streaming to the terminal")
    model_args(p)
    tp_args(p)
    sampling_args(p)
    constraint_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    special_tokens_arg(p)
    p.add_argument("prompt")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    model_args(p)
    sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    special_tokens_arg(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("inspect", help="measure the four valves, logit lens and softmax safety on one "
                                       "prompt; tables, or JSON, or an HTML report with plots",
                       epilog="exit status: 0 ok, 2 bad input (the message names it), 3 the forward "
                              "produced NaN/inf (reported as a finding with its origin; report still written)")
    model_args(p, engine=False)
    tp_args(p)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write report.html (self-contained), report.json and the PNG plots here "
                        "(created if missing)")
    p.add_argument("--json", action="store_true",
                   help="print every number as one JSON document on stdout instead of tables "
                        "(NaN/inf as the strings \"nan\", \"inf\", \"-inf\")")
    p.add_argument("--training", default=None, metavar="RUN",
                   help="also show how the valves formed over a `sluice train` run (its directory "
                        "or log.jsonl), e.g. one of recipes/stdlib-valves.toml")
    p.add_argument("--surgery", action="append", metavar="NAME[=VALUE]",
                   help="what-if on the live model (repeatable), measured against the unmodified one: "
                        "final-norm=off, norm=layer|rms, softcap=off|V, attn-softcap=off|V, "
                        "residual-scale=F, attn-scale=F, mlp-scale=F, softmax=naive|safe|online, "
                        "softmax-dtype=float32|bfloat16|float16 (docs/observatory.md)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="with --surgery: score bits per byte on this file (default: the model's "
                        "held-out text); the prompt is what both models continue greedily")
    p.add_argument("--target", default=None, metavar="TOKEN",
                   help="the token whose logit is attributed to each block's attention and MLP, and whose rank "
                        "and probability are followed through every layer of the logit and tuned lens: its text "
                        "(one token, e.g. ' return') or id:N (default: the model's top-1 prediction at each "
                        "position, and no trajectory)")
    p.add_argument("--tuned-lens", default=None, metavar="PATH",
                   help="a tuned lens (`sluice lens train`'s directory or tuned_lens.safetensors) to show beside "
                        "the logit lens; default: the one saved beside the model, if any; 'none': no tuned lens")
    p.add_argument("prompt", help="the text to inspect ('-' reads it from stdin)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("train", help="pretrain a model from a TOML recipe")
    p.add_argument("--recipe", default=None, help="recipe file (default: the bundled model's recipe)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and exit after this step (resume later with --resume)")
    p.set_defaults(func=cmd_train)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_export_gguf_parser(sub)
    add_profile_parser(sub)
    add_roofline_parser(sub)
    add_lens_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    command, args = "sluice", None
    try:
        args = build_parser().parse_args(argv)
        command = f"sluice {args.command}"
        check_streams(args)
        return args.func(args)
    except SluiceError as e:
        # Under torchrun every rank fails alike; a silenced rank (common.tp_rank) speaks only when it
        # alone knows why: a collective failed because another rank died.
        quiet = getattr(args, "quiet_rank", 0) and type(e).__name__ != "ParallelError"
        return _fail(f"{command}: error: {e}", 2, args, quiet)
    except KeyboardInterrupt:
        return _fail("\ninterrupted", 130)
    except BrokenPipeError:
        # The reader went away (`| head`): like other Unix tools, stop quietly. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    except MemoryError:
        return _fail(f"{command}: error: out of memory (a smaller model, batch, --max-tokens or "
                     "--dtype bfloat16 needs less)", 2)
    except OSError as e:  # a full disk, a permission, a vanished file: the system's words, one line
        return _fail(f"{command}: error: {e}", 2)
    except Exception as e:  # noqa: BLE001 -- a bug in sluice: one line, the traceback on request
        if os.environ.get("SLUICE_TRACEBACK"):
            raise
        return _fail(f"{command}: internal error (a bug in sluice, please report it): "
                     f"{type(e).__name__}: {e} (set SLUICE_TRACEBACK=1 to see where)", 1, args)


def _fail(message: str, code: int, args=None, quiet: bool = False) -> int:
    with contextlib.suppress(Exception):  # stderr itself may be a closed pipe
        if not quiet:  # a silenced torchrun rank keeps its real stderr for its own failures
            print(message, file=getattr(args, "real_stderr", None) or sys.stderr)
    return code


def exit_process(code: int) -> None:
    """sys.exit(code); but a process that joined a tensor-parallel group (torchrun ... --tp N) leaves
    with os._exit after flushing: there the interpreter's own teardown, after the group was destroyed,
    aborted (SIGABRT, "terminate called without an active exception") in 2 to 6 of 8 runs measured,
    turning a finished run into a failed one. The cause inside torch/gloo is not found yet."""
    group = sys.modules.get("sluice.parallel.group")
    if getattr(group, "JOINED", False):
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code if isinstance(code, int) else 1)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
