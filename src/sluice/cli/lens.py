"""`sluice lens train`: fit a tuned lens's translators (observatory/tuned_lens_fit.py) and save them."""

from __future__ import annotations

import argparse
import sys

from .common import model_args


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return n


def add_lens_parser(sub) -> None:
    p = sub.add_parser("lens", help="the tuned lens: `sluice lens train` fits per-layer translators that "
                                    "`sluice inspect` then shows beside the logit lens")
    lens_sub = p.add_subparsers(dest="lens_command", required=True)
    t = lens_sub.add_parser("train", help="fit the tuned lens of a model on a corpus and save it beside the model",
                            description="Fit one affine translator per layer (Belrose et al. 2023) minimising "
                                        "KL(final layer || lens) on the model's training corpus (its recipe.toml; "
                                        "the bundled corpus otherwise) or --text, judge it on held-out text, and "
                                        "write tuned_lens.safetensors + tuned_lens.json beside the model or in --out.")
    model_args(t, engine=False)
    t.add_argument("--tokens", type=_positive, default=16384,
                   help="tokens of training text whose streams are fitted on (default 16384)")
    t.add_argument("--steps", type=_positive, default=150, help="optimisation steps (default 150)")
    t.add_argument("--batch", type=_positive, default=256, help="token positions per step (default 256)")
    t.add_argument("--lr", type=float, default=1e-2, help="Adam's peak learning rate (default 0.01)")
    t.add_argument("--seed", type=int, default=0, help="file order and batch sampling seed (default 0)")
    t.add_argument("--text", default=None, metavar="FILE",
                   help="fit on this text file instead (its first 9/10; the last 1/10 judges it)")
    t.add_argument("--out", default=None, metavar="DIR",
                   help="write the files here (default: the model's own directory); `sluice inspect "
                        "--tuned-lens DIR` reads them from there")
    t.set_defaults(func=cmd_lens_train)


def cmd_lens_train(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..errors import ObservatoryError
    from ..model import load
    from ..observatory.report import prepare_out_dir
    from ..observatory.tuned_lens_fit import train
    from ..text.tokenizer import Tokenizer
    if not args.lr > 0:
        raise ObservatoryError(f"--lr must be a positive number, got {args.lr}")
    out = prepare_out_dir(args.out) if args.out else None  # checked before the slow part
    err = Console(stderr=True, highlight=False)
    with err.status(f"loading {args.model or 'the bundled model'} ({args.dtype})..."):
        model = load(args.model, dtype=args.dtype)
        tokenizer = Tokenizer.from_pretrained(model.model_dir)
    if out is None:  # a read-only install says so here, before the work, naming --out
        try:
            out = prepare_out_dir(model.model_dir)
        except ObservatoryError as e:
            raise ObservatoryError(f"cannot write the tuned lens beside the model in {model.model_dir} "
                                   f"({str(e).rsplit(': ', 1)[-1]}): pass --out DIR") from None
    every = max(1, args.steps // 10)

    def progress(step: int, loss: float) -> None:
        if (step + 1) % every == 0 or step == 0:
            print(f"step {step + 1}/{args.steps}: loss {loss:.3f} nats (sum over layers)", file=sys.stderr, flush=True)

    lens = train(model, tokenizer, tokens=args.tokens, steps=args.steps, text=args.text, seed=args.seed,
                 batch=args.batch, lr=args.lr, on_step=progress, say=lambda m: print(m, file=sys.stderr, flush=True))
    tensors, meta = lens.save(out)
    kl = lens.meta["heldout_kl"]
    t = Table(title=f"held-out KL(final || lens) per layer, nats, mean over "
                    f"{lens.meta['corpus']['heldout_tokens']:,} tokens", title_justify="left")
    for name in ("layer", "logit lens", "tuned lens"):
        t.add_column(name, justify="right")
    for layer, (a, b) in enumerate(zip(kl["logit_lens"], kl["tuned_lens"])):
        t.add_row("x_0 (first block's input)" if layer == 0 else f"x_{layer}", f"{a:.3f}", f"{b:.3f}")
    Console(highlight=False).print(t)
    if lens.meta["corpus"]["note"]:
        err.print(f"note: {lens.meta['corpus']['note']}")
    err.print(f"wrote {tensors} and {meta.name} ({lens.meta['fit']['seconds']:.0f} s of fitting); "
              "`sluice inspect` shows it beside the logit lens" + ("" if args.out is None else f" with --tuned-lens {out}"))
    return 0
