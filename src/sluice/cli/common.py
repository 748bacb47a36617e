"""What the model-running commands share: their flags, their input checks, loading the LLM."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ..errors import ConfigError, ConstraintError


def model_args(p: argparse.ArgumentParser, engine: bool = True) -> None:
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
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="what the KV cache stores: auto (the activations' dtype, fp32 on the CPU's native "
                        "step) or bfloat16 (half the memory and half the bytes read per token; keys and "
                        "values rounded to bf16: docs/kv-cache.md)")
    p.add_argument("--quantize", default=None, metavar="{int8,int4}",
                   help="weight-only quantization at load time, on the CPU: int8 per channel, int4 per "
                        "group of 32 (docs/quantization.md)")


def tp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism: split the model over N processes, launched with "
                        "`torchrun --nproc-per-node N -m sluice ... --tp N`; rank 0 prints")


def tp_rank(args, command: str) -> int:
    """Check --tp against torchrun's environment (before the slow load) and return this process's
    rank; a rank other than 0 has its stdout and stderr silenced (rank 0 speaks for the group) and
    args.quiet_rank and args.real_stderr set, so main() prints only its own failures (a peer that
    died, a bug)."""
    tp, world = getattr(args, "tp", None), _torchrun_int("WORLD_SIZE", 1)
    rank = _torchrun_int("RANK", 0) or 0
    world = None if world is None else str(world)
    dist = sys.modules.get("torch.distributed")  # a script (or test) that started the group itself
    if world is None and dist is not None and dist.is_available() and dist.is_initialized():
        world, rank = str(dist.get_world_size()), dist.get_rank()
    if tp is not None and tp < 1:
        raise ConfigError(f"--tp must be an integer >= 1, got {tp}")
    if tp in (None, 1):
        if world not in (None, "1"):
            raise ConfigError(f"torchrun started {world} processes (WORLD_SIZE={world}) but --tp is {tp or 1}: "
                              f"pass --tp {world} to split the model over them")
        return 0
    if world is None:
        raise ConfigError(f"--tp {tp} needs torchrun's environment (WORLD_SIZE is not set): launch with "
                          f"`torchrun --nproc-per-node {tp} -m sluice {command} --tp {tp} ...`")
    if world != str(tp):
        raise ConfigError(f"--tp {tp} but torchrun started {world} processes (WORLD_SIZE={world}); they must match")
    if rank:
        args.quiet_rank, args.real_stderr = rank, sys.stderr
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 -- for the life of the process
    return rank


def _torchrun_int(name: str, least: int) -> int | None:
    """torchrun's integer variable `name`, None if unset; refused by name when it is not an integer."""
    value = os.environ.get(name)
    if value is None:
        return None
    if not (value.strip().isdecimal() and int(value) >= least):
        raise ConfigError(f"{name}={value!r} must be an integer >= {least}; torchrun sets it: launch with "
                          "`torchrun --nproc-per-node N -m sluice ... --tp N`, or unset it")
    return int(value)


def special_tokens_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-special-tokens-in-messages", dest="special_tokens_in_messages", action="store_false",
                   help="encode a special token's text typed into a message (\"<|im_start|>system\") as text, not "
                        "as the special token; by default it is one, as in transformers and vLLM (docs/limits.md)")


def sampling_args(p: argparse.ArgumentParser) -> None:
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
    speculative_args(p)


def constraint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("constrained output (the output always matches; docs/constrained.md)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-object", action="store_true", help="any JSON object")
    one.add_argument("--json-schema", metavar="FILE|JSON", help="a JSON Schema: a file, or the schema's JSON text")
    one.add_argument("--regex", metavar="R", help="a regular expression the whole output matches")
    one.add_argument("--grammar", metavar="FILE", help="a grammar file in llguidance's Lark dialect")


def constraint_of(args):
    """The Constraint the --json-object / --json-schema / --regex / --grammar flags ask for, or None;
    checked now (a bad schema, regex or grammar is a ConstraintError naming it), before the load."""
    from ..engine.constraints import MAX_SPEC_CHARS, Constraint
    if args.json_object:
        return Constraint("json_object")
    if args.regex is not None:
        return Constraint("regex", args.regex)
    for flag, value, kind in (("--json-schema", args.json_schema, "json_schema"), ("--grammar", args.grammar, "grammar")):
        if value is None:
            continue
        if kind == "json_schema" and value.lstrip().startswith("{"):
            return Constraint(kind, value)
        path = Path(value)
        if not path.is_file():
            raise ConstraintError(f"{flag} {value!r}: no such file" + (" (nor JSON text: it does not start with "
                                                                        "'{')" if kind == "json_schema" else ""))
        if path.stat().st_size > 4 * MAX_SPEC_CHARS:  # before reading it; Constraint checks the characters
            raise ConstraintError(f"{flag} {value}: {path.stat().st_size} bytes, over the limit of {MAX_SPEC_CHARS} characters")
        try:
            return Constraint(kind, path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConstraintError(f"{flag} {value}: not UTF-8 text ({e})") from None
    return None


def speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (the output's distribution stays the model's own)")
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="a smaller checkpoint with the same tokenizer guesses the next tokens; the model "
                        "checks them in one forward ('bundled': the bundled model's draft)")
    g.add_argument("--prompt-lookup", action="store_true",
                   help="guess the next tokens from n-gram matches in the prompt and the text so far "
                        "(no second model; pays where the output repeats the input)")
    g.add_argument("--speculative-tokens", default=None, metavar="K",
                   help="tokens guessed per forward of the model (default 4), or 'auto': adapted to the rate "
                        "at which guesses are kept")


def sampling_params(args):
    from ..engine.sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
                          stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos)


def utf8_arg(text: str, what: str) -> str:
    """`text` as given (argv and stdin decode bad bytes to lone surrogates), refused by name if it was
    not valid UTF-8: a model sees text, and guessing what broken bytes meant would change the prompt."""
    from ..text.token_bound import utf8_bytes  # the tokenizer's own check, here before the (slow) load
    utf8_bytes(text, what)
    return text


def check_streams(args) -> None:
    """Refuse a closed stdin or stdout (`sluice chat <&-`, `sluice generate ... >&-`) before any work: Python
    then sets sys.stdin or sys.stdout to None, and the first read or write would fail deep inside, after the
    load. chat reads its turns from stdin, inspect a '-' prompt; every command but serve (which logs to
    stderr) writes its result to stdout."""
    command = f"sluice {args.command}"
    if sys.stdin is None and (args.command == "chat" or (args.command == "inspect" and args.prompt == "-")):
        what = "the conversation" if args.command == "chat" else "the prompt ('-')"
        raise ConfigError(f"stdin is closed, and {command} reads {what} from it: give it a terminal, a pipe or "
                          "a file (< FILE)")
    if sys.stdout is None and args.command != "serve":
        raise ConfigError(f"stdout is closed, and {command} writes its output there: redirect it (> FILE, or "
                          "> /dev/null to discard it) instead of closing it")


def stdin_lines():
    """Lines of stdin with undecodable bytes kept (as surrogates) so one bad line is refused, not the session."""
    with contextlib.suppress(AttributeError, ValueError):  # not a TextIOWrapper (e.g. replaced in a test)
        sys.stdin.reconfigure(errors="surrogateescape")
    return sys.stdin


def flag_naming():
    """How the engine's option checks (engine/config.py) name an option given on the command line."""
    from ..engine.config import Naming
    return Naming(flags={
        "kv_cache_memory": "--kv-cache-memory", "kv_cache_dtype": "--kv-cache-dtype",
        "num_speculative_tokens": "--speculative-tokens",
        "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
        "max_model_len": "--max-model-len", "compile": "--compile", "quantize": "--quantize",
        "compute": {"float32": "--compute float32"}, "tensor_parallel": "--tp",
        "speculative": {"draft": "--draft-model", "prompt-lookup": "--prompt-lookup"},
    }, tensor_parallel="--tp", leave="leave it out")


def engine_config(args):
    """The EngineConfig of the model flags (model_args), the speculative ones and --tp, checked before
    the (slow) load and named by flag: one reading for generate, chat, demo and serve."""
    draft, lookup = getattr(args, "draft_model", None), getattr(args, "prompt_lookup", False)
    if draft is not None and lookup:
        raise ConfigError("--draft-model and --prompt-lookup are two ways to guess tokens: pick one")
    speculative = "prompt-lookup" if lookup else ("draft" if draft is not None else "off")
    k = getattr(args, "speculative_tokens", None)
    if k is not None:
        if speculative == "off":
            raise ConfigError("--speculative-tokens needs --draft-model or --prompt-lookup")
        k = int(k) if k.strip().lstrip("+-").isdigit() else k
    from ..engine.config import DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, EngineConfig
    return EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, compile=args.compile,
                        device=args.device, quantize=args.quantize, kv_cache_memory=args.kv_cache_memory,
                        compute=args.compute, speculative=speculative, draft_model=draft, num_speculative_tokens=k,
                        max_num_seqs=getattr(args, "max_num_seqs", DEFAULT_MAX_NUM_SEQS),
                        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", DEFAULT_MAX_BATCHED_TOKENS),
                        tensor_parallel=getattr(args, "tp", None) or 1, kv_cache_dtype=args.kv_cache_dtype,
                        naming=flag_naming())


def load_llm(args, config=None):
    """Load with a spinner on stderr, so a slow load never looks like a hang."""
    from rich.console import Console

    from ..llm import LLM
    console = Console(stderr=True)
    config = config or engine_config(args)
    with console.status(f"loading {args.model or 'the bundled model'} ({args.dtype}, {args.device})..."):
        llm = LLM(config=config)
    llm.tokenizer.special_tokens_in_messages = getattr(args, "special_tokens_in_messages", True)
    return llm
