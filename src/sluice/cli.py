"""The `sluice` command line: demo, generate, chat, inspect, train, bench, profile, export-gguf.

Every failure reaches the user as one line on stderr, never a traceback: a SluiceError (bad input,
named) or an OSError (the file system said no) exits 2; Ctrl-C, even during start-up while torch
is still importing, exits 130; a closed stdout pipe (`sluice generate ... | head`) ends quietly;
anything else is a bug in sluice and says so (SLUICE_TRACEBACK=1 shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from .errors import RequestError, SluiceError


def _model_args(p: argparse.ArgumentParser, engine: bool = True) -> None:
    """--model and --dtype; with engine=True also the generation engine's own flags."""
    p.add_argument("--model", default=None,
                   help="local checkpoint directory or cached Hugging Face repo id "
                        "(default: the bundled model sluice trained itself)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    if not engine:
        return
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda, cuda:N or mps; an unavailable one is an error")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="refuse requests longer than this many tokens (default: the model's context)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--compute", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="with --dtype bfloat16: float32 keeps the weights in bf16 and computes the rest in "
                        "fp32 (faster on CPUs without bf16 instructions); auto picks it there for models "
                        "over 64 MiB")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="most memory a request's KV cache and sampling buffers may take, e.g. 2GiB or "
                        "512MB; a request over it is refused with the numbers (default: half of the "
                        "memory free at the time)")
    p.add_argument("--quantize", default=None, metavar="{int8,int4}",
                   help="weight-only quantization at load time, on the CPU: int8 per channel, int4 per "
                        "group of 32 (docs/quantization.md)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset values come from the model's generation_config.json)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--top-k", type=int, help="0 or -1 = off")
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable), excluded from the output")
    g.add_argument("--stop-token-id", action="append", type=int, dest="stop_token_ids")
    g.add_argument("--ignore-eos", action="store_true")


def _params(args):
    from .engine.sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
                          stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos)


def _utf8(text: str, what: str) -> str:
    """`text` as given (argv and stdin decode bad bytes to lone surrogates), refused by name if it was
    not valid UTF-8: a model sees text, and guessing what broken bytes meant would change the prompt."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start].encode("utf-8", "surrogateescape")
        raise RequestError(f"{what} is not valid UTF-8: byte {bad!r} at character {e.start}") from None
    return text


def _stdin_lines():
    """Lines of stdin with undecodable bytes kept (as surrogates) so one bad line is refused, not the session."""
    with contextlib.suppress(AttributeError, ValueError):  # not a TextIOWrapper (e.g. replaced in a test)
        sys.stdin.reconfigure(errors="surrogateescape")
    return sys.stdin


def _kv_budget(args) -> None:
    """A malformed --kv-cache-memory is refused before the (slow) load."""
    if args.kv_cache_memory is not None:
        from .engine.kv_cache import parse_size
        parse_size(args.kv_cache_memory, "--kv-cache-memory")


def _load_llm(args):
    """Load with a spinner on stderr, so a slow load never looks like a hang."""
    from rich.console import Console

    from .engine import LLM
    console = Console(stderr=True)
    with console.status(f"loading {args.model or 'the bundled model'} ({args.dtype}, {args.device})..."):
        return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, compile=args.compile,
                   device=args.device, quantize=args.quantize, kv_cache_memory=args.kv_cache_memory, compute=args.compute)


def cmd_generate(args) -> int:
    params = _params(args)  # validate before the (slow) load
    _utf8(args.prompt, "the prompt")
    _kv_budget(args)
    llm = _load_llm(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}])
    if args.json:
        out = llm.generate([prompt], params)[0]
        print(json.dumps({"prompt": args.prompt, "text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason, "stats": llm.last_stats.as_dict()},
                         ensure_ascii=False))
        return 0
    deltas = llm.stream(prompt, params)  # a request that cannot run fails here, before the echo
    if not args.chat:
        sys.stdout.write(args.prompt)
    for delta in deltas:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = llm.last_stats
    print(f"[{s.prompt_tokens} prompt tokens, {s.generated_tokens} generated "
          f"({llm.last_output.finish_reason}); prefill {s.prefill_tok_s:.1f} tok/s, "
          f"decode {s.decode_tok_s:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    params = _params(args)
    _utf8(args.system or "", "--system")
    _kv_budget(args)
    llm = _load_llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    _stdin_lines()
    history = list(system)
    print("sluice chat: /reset clears the conversation, /exit or Ctrl-D quits, "
          "Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        line = line.strip()
        if not line:
            continue
        try:
            _utf8(line, "that line")
        except RequestError as e:
            print(f"error: {e}; nothing was sent", file=sys.stderr)
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            history = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt = llm.chat_prompt(history)
        except SluiceError as e:
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        reply = []
        try:
            for delta in llm.stream(prompt, params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        except SluiceError as e:  # e.g. the conversation outgrew the context: say so, keep going
            history.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_train(args) -> int:
    from .training.recipe import Recipe
    from .training.train import run
    recipe = Recipe.load(args.recipe or Path(__file__).parent / "training" / "recipes" / "stdlib.toml")
    summary = run(recipe, args.out, resume=args.resume, stop_at=args.stop_at)
    print(json.dumps({k: v for k, v in summary.items() if k != "data"}, indent=1))
    return 0


def cmd_inspect(args) -> int:
    from rich.console import Console

    from .errors import ObservatoryError
    from .model import load
    from .observatory.analysis import inspect, to_json
    from .observatory.report import prepare_out_dir, save
    from .observatory.tables import print_all
    from .tokenizer import Tokenizer
    prompt = _utf8(_stdin_lines().read() if args.prompt == "-" else args.prompt, "the prompt")
    if not prompt:  # refused before the (slow) load; too long is checked once the tokenizer is here
        raise ObservatoryError("the prompt is empty: give some text to inspect, e.g. "
                               "sluice inspect \"def read_config(path):\"")
    if args.surgery or args.text:  # what-if: before/after table (observatory/surgery_report.py)
        from .observatory.surgery_report import run_cli
        return run_cli(args, prompt)
    out = prepare_out_dir(args.out) if args.out else None
    training = None
    if args.training:  # read (and checked) before the slow part
        from .observatory.training import training_valves
        training = {"run": args.training, **training_valves(args.training)}
    err = Console(stderr=True, highlight=False)
    with err.status(f"loading {args.model or 'the bundled model'} ({args.dtype})..."):
        model = load(args.model, dtype=args.dtype)
        tokenizer = Tokenizer.from_pretrained(model.model_dir)
    data = inspect(model, tokenizer, prompt)
    if training is not None:
        data["training"] = training
    if out is not None:
        with err.status(f"writing the report to {out}..."):
            paths = save(data, out)
    if args.json:
        print(to_json(data))
    else:
        print_all(data)
    if out is not None:
        err.print(f"report: {paths['html']} (plus report.json and {len(paths) - 2} PNGs in {out})")
    for finding in data["findings"]:
        err.print(f"[bold red]finding:[/bold red] {finding['message']}")
    return 3 if data["findings"] else 0


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(_load_llm(args))


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: these pull in torch, and main() catches a Ctrl-C only from here on.
    from .benchmarks.cli import add_bench_parser
    from .model.gguf_cli import add_export_gguf_parser
    from .observatory.profile_cli import add_profile_parser, add_roofline_parser

    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="stream a few completions from the bundled model and show its "
                                    "four numerical valves")
    _model_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="continue a prompt, streaming to the terminal")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("prompt")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("inspect", help="measure the four valves, logit lens and softmax safety on one "
                                       "prompt; tables, or JSON, or an HTML report with plots",
                       epilog="exit status: 0 ok, 2 bad input (the message names it), 3 the forward "
                              "produced NaN/inf (reported as a finding with its origin; report still written)")
    _model_args(p, engine=False)
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
    p.add_argument("prompt", help="the text to inspect ('-' reads it from stdin)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("train", help="pretrain a model from a TOML recipe")
    p.add_argument("--recipe", default=None, help="recipe file (default: the bundled model's recipe)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and exit after this step (resume later with --resume)")
    p.set_defaults(func=cmd_train)
    add_bench_parser(sub)
    add_export_gguf_parser(sub)
    add_profile_parser(sub)
    add_roofline_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    command = "sluice"
    try:
        args = build_parser().parse_args(argv)
        command = f"sluice {args.command}"
        return args.func(args)
    except SluiceError as e:
        return _fail(f"{command}: error: {e}", 2)
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
                     f"{type(e).__name__}: {e} (set SLUICE_TRACEBACK=1 to see where)", 1)


def _fail(message: str, code: int) -> int:
    with contextlib.suppress(Exception):  # stderr itself may be a closed pipe
        print(message, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
