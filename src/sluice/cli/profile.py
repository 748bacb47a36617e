"""`sluice profile` and `sluice roofline`: their arguments and handlers (cli/__init__.py only adds them).

matplotlib and the measuring code are imported when a command runs, not when the parser is built.
Every argument is read as text and checked here, so bad input is one line naming it (exit 2),
never argparse's usage dump or a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import ObservatoryError

DEFAULT_CONTEXTS = "128,1024,4096,16384"
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _positive_int(text: str, flag: str) -> int:
    try:
        value = int(text.strip())
    except (ValueError, AttributeError):
        raise ObservatoryError(f"{flag} takes positive integers, got {text!r}") from None
    if value <= 0:
        raise ObservatoryError(f"{flag} takes positive integers, got {text!r}")
    return value


def parse_contexts(text: str) -> list[int]:
    parts = [p for p in text.split(",")]
    if not text.strip() or any(not p.strip() for p in parts):
        raise ObservatoryError(f"--contexts takes comma-separated positive integers, e.g. {DEFAULT_CONTEXTS}; "
                               f"got {text!r}")
    return [_positive_int(p, "--contexts") for p in parts]


def parse_dtype(text: str):
    import torch
    if text not in DTYPES:
        raise ObservatoryError(f"--dtype must be one of {', '.join(DTYPES)}, got {text!r}")
    return getattr(torch, DTYPES[text])


def _float(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ObservatoryError(f"{flag} takes a number, got {text!r}") from None


def cmd_profile(args) -> int:
    import torch
    from rich.console import Console

    from ..engine.sampling import SamplingParams
    from ..model import load
    from ..observatory.analysis import to_json
    from ..observatory.profile import PATHS, plan_contexts, profile
    from ..observatory.profile_native import native_reason
    from ..observatory.profile_report import prepare_out_dir, save
    from ..observatory.profile_tables import print_profile
    contexts = parse_contexts(args.contexts)  # everything checked before the (slow) load
    parse_dtype(args.dtype)
    reps = _positive_int(args.reps, "--reps")
    if args.path not in ("auto", *PATHS):
        raise ObservatoryError(f"--path must be one of auto, {', '.join(PATHS)}, got {args.path!r}")
    params = SamplingParams(temperature=_float(args.temperature, "--temperature"),
                            top_k=None if args.top_k is None else int(_float(args.top_k, "--top-k")),
                            top_p=_float(args.top_p, "--top-p"), seed=0).with_defaults({"temperature": 1.0})
    out = prepare_out_dir(args.out) if args.out else None
    err = Console(stderr=True, highlight=False)
    with err.status(f"loading {args.model or 'the bundled model'} ({DTYPES[args.dtype]})..."):
        model = load(args.model, dtype=DTYPES[args.dtype])
    # A clamped context is said now, not only in the report after minutes of measuring.
    said = plan_contexts(contexts, model.config.max_position_embeddings)[1]
    for note in said:
        err.print(f"note: {note}")
    path = args.path
    if path != "torch" and model.embed.weight.dtype == torch.bfloat16:
        # What LLM(dtype="bfloat16") runs by default (compute="auto"): bf16 weights with fp32 activations
        # wherever the native step can take the model (engine/cpu_paths.py decides, for both).
        from ..engine.cpu_paths import set_compute
        if set_compute(model, torch.device("cpu"), "auto", "auto", None):
            err.print("note: bf16 weights, fp32 activations and KV cache: the native step, as LLM(dtype='bfloat16') "
                      "runs this model (--path torch profiles bf16 activations)")
    if path != "torch" and (why := native_reason(model)) is not None:
        if path == "native":
            raise ObservatoryError(f"--path native: the native step cannot run this model ({why})")
        err.print(f"note: profiling the torch path: the native step cannot run this model ({why})")
        path = "torch"
    elif path == "auto":
        path = "native"

    def progress(row):
        err.print(f"context {row['context']:,}: {row['step_ms']:.2f} ms/step, components sum "
                  f"{100 * row['sum_vs_step']:+.1f}% ({row['seconds']:.0f} s)")
    with err.status("measuring (median of round-robin passes; see docs/profile.md)..."):
        data = profile(model, contexts, reps=reps, params=params, progress=progress, path=path,
                       kv_cache_dtype=args.kv_cache_dtype)
    if out is not None:
        paths = save(data, out)
    if args.json:
        print(to_json(data))
        for note in data["notes"]:  # the tables show them; a JSON reader may not look
            if note not in said:
                err.print(f"note: {note}")
    else:
        print_profile(data)
    if out is not None:
        err.print(f"report: {paths['html']} (plus profile.json and {len(paths) - 2} PNGs in {out})")
    return 0


def read_config(path: str):
    """config.json (a file, or a checkpoint directory holding one) -> ModelConfig; no weights read."""
    from ..model.config import ModelConfig
    p = Path(path)
    if p.is_dir():
        return ModelConfig.from_hf(p)
    if not p.is_file():
        raise ObservatoryError(f"--config {path}: no such file (give a config.json or a directory holding one)")
    return ModelConfig.from_json_file(p)  # a bad file is a ConfigError naming it


def cmd_roofline(args) -> int:
    from ..observatory.analysis import to_json
    from ..observatory.profile_report import prepare_out_dir, save
    from ..observatory.profile_tables import print_roofline
    from ..observatory.roofline import HARDWARE_NAMES, roofline
    from ..observatory.roofline_tp import INTERCONNECTS
    if args.hardware not in HARDWARE_NAMES:
        raise ObservatoryError(f"--hardware must be one of {', '.join(HARDWARE_NAMES)}, got {args.hardware!r}")
    if args.interconnect is not None and args.interconnect not in INTERCONNECTS:
        raise ObservatoryError(f"--interconnect must be one of {', '.join(INTERCONNECTS)}, got {args.interconnect!r}")
    dtype = parse_dtype(args.dtype)
    batch, context = _positive_int(args.batch, "--batch"), _positive_int(args.context, "--context")
    tp = _positive_int(args.tp, "--tp")
    link = {"link_bandwidth": _float(args.link_bandwidth, "--link-bandwidth"),
            "link_latency": _float(args.link_latency, "--link-latency"),
            "collective_overhead": _float(args.collective_overhead, "--collective-overhead")}
    cfg = read_config(args.config)
    out = prepare_out_dir(args.out) if args.out else None
    data = roofline(cfg, args.hardware, batch=batch, context=context, dtype=dtype, tp=tp,
                    interconnect=args.interconnect, **link)
    if out is not None:
        paths = save(data, out)
    if args.json:
        print(to_json(data))
    else:
        print_roofline(data)
    if out is not None:
        print(f"report: {paths['html']} (plus roofline.json and {len(paths) - 2} PNGs in {out})", file=sys.stderr)
    return 0


def _output_args(p) -> None:
    p.add_argument("--json", action="store_true", help="print every number as one JSON document on stdout")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the PNG plots, the JSON and a self-contained HTML page here (created if missing)")


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="where one decode step's time goes, by component, against the KV-cache "
                                       "length; bytes read and achieved bandwidth",
                       description="Times one decode step (batch 1) by component at each context length: the "
                                   "native step by its phase timers, or the torch modules with forward hooks; and "
                                   "compares the bytes it reads with this machine's measured bandwidth and the "
                                   "roofline bound (docs/profile.md).",
                       epilog="exit status: 0 ok, 2 bad input (the message names it)")
    p.add_argument("--model", default=None, help="local checkpoint directory or cached Hugging Face repo id "
                                                 "(default: the bundled model)")
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.add_argument("--contexts", default=DEFAULT_CONTEXTS,
                   help=f"comma-separated KV-cache lengths (default {DEFAULT_CONTEXTS}); clamped to the "
                        "model's max_position_embeddings")
    p.add_argument("--reps", default="15", help="round-robin rounds per context (default 15)")
    p.add_argument("--path", default="auto",
                   help="native: the native step's own phase timers (what the engine runs); torch: the eager "
                        "torch modules timed with forward hooks; auto (default): native where the model can "
                        "take it (fp32 activations), else torch, saying why")
    p.add_argument("--temperature", default=None, help="sampler temperature (default 1; 0 = greedy argmax)")
    p.add_argument("--top-k", default=None, help="sampler top-k (default off; any filter adds a vocabulary sort)")
    p.add_argument("--top-p", default=None, help="sampler top-p (default off)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the KV cache the step reads, as LLM(kv_cache_dtype=): auto (default) the activations' "
                        "dtype, or bfloat16 (half the bytes: docs/kv-cache.md)")
    _output_args(p)
    p.set_defaults(func=cmd_profile)


def add_roofline_parser(sub) -> None:
    from ..observatory.roofline import HARDWARE_NAMES
    from ..observatory.roofline_tp import INTERCONNECTS
    p = sub.add_parser("roofline", help="predicted bytes, FLOPs and tokens/s bound of a decode step from "
                                        "config.json and a GPU's (or this CPU's) peaks",
                       epilog="exit status: 0 ok, 2 bad input (the message names it)")
    p.add_argument("--config", required=True, help="a config.json, or a checkpoint directory holding one")
    p.add_argument("--hardware", required=True, help=", ".join(HARDWARE_NAMES))
    p.add_argument("--batch", default="1", help="sequences decoded together (default 1)")
    p.add_argument("--context", default="4096", help="tokens in each sequence's KV cache (default 4096)")
    p.add_argument("--dtype", default="bf16", help="weights and KV cache dtype: bf16 (default) or fp32")
    p.add_argument("--tp", default="1", help="tensor-parallel ranks (default 1): the step of one rank, plus "
                                             "its all-reduces over --interconnect (docs/parallel.md)")
    p.add_argument("--interconnect", default=None,
                   help=f"the link between ranks with --tp: {', '.join(INTERCONNECTS)} (default nvlink)")
    p.add_argument("--link-bandwidth", default=None, metavar="GB/S",
                   help="override the interconnect's bandwidth per direction, GB/s")
    p.add_argument("--link-latency", default=None, metavar="US",
                   help="override the latency of one ring step, microseconds (an all-reduce takes 2(N-1) steps)")
    p.add_argument("--collective-overhead", default=None, metavar="US",
                   help="override the fixed cost of one collective, microseconds")
    _output_args(p)
    p.set_defaults(func=cmd_roofline)
