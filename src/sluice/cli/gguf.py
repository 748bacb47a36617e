"""`sluice export-gguf`: arguments here, the work in model/gguf_export.py (imported when it runs, so
`sluice --help` stays free of torch and gguf)."""

from __future__ import annotations

import json
import sys

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # model.gguf_export.OUTTYPES, repeated to keep this import-free


def cmd_export_gguf(args) -> int:
    from rich.console import Console

    from ..model.gguf_export import export_gguf

    console = Console(stderr=True)
    with console.status(f"exporting {args.model or 'the bundled model'} to {args.out} ({args.outtype})...") as status:
        def progress(done, total):
            status.update(f"writing tensors {done}/{total} ({args.outtype})...")
        summary = export_gguf(args.model, args.out, args.outtype, progress=progress)
    if args.json:
        print(json.dumps(summary))
    else:
        types = ", ".join(f"{n} {k}" for k, n in summary["types"].items())
        tokenizer = (f"{summary['tokens']} tokens, pre-tokenizer {summary['tokenizer_pre'] or 'default'}"
                     if summary["tokens"] else "no tokenizer")
        print(f"wrote {summary['path']}: {summary['arch']} ({summary['architecture']}), "
              f"{summary['tensors']} tensors ({types}), {summary['bytes'] / 2**20:.1f} MiB, {tokenizer}, "
              f"in {summary['seconds']:.1f} s")
    for note in summary["notes"]:
        print(f"note: {note}", file=sys.stderr)
    return 0


def add_export_gguf_parser(sub) -> None:
    """Add `export-gguf` to the `sluice` subcommands (`sub` from add_subparsers)."""
    p = sub.add_parser("export-gguf", help="write a checkpoint as a GGUF file for llama.cpp",
                       description="Write a checkpoint as GGUF (llama.cpp's format): weights renamed and "
                                   "laid out as llama.cpp expects, hyperparameters, tokenizer and chat "
                                   "template. Llama, Mistral, Qwen2 and Qwen3 checkpoints.",
                       epilog="exit status: 0 ok, 2 bad input or an unsupported model (the message names it)")
    p.add_argument("--model", default=None,
                   help="local checkpoint directory or cached Hugging Face repo id "
                        "(default: the bundled model sluice trained itself)")
    p.add_argument("--out", required=True, metavar="FILE", help="the .gguf file to write (replaced if it exists)")
    p.add_argument("--outtype", default="bf16", choices=OUTTYPES,
                   help="type of the 2-D weights (norms and biases stay f32); q8_0 and q4_0 fall back to "
                        "f16 for matrices whose rows are not a multiple of 32 (default: bf16)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=cmd_export_gguf)
