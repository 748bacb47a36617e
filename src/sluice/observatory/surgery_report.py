"""`sluice inspect --surgery NAME[=VALUE] ...`: the before/after table of `surgery.compare`.

Everything the user typed is checked before the model loads (surgery names and values, the --text
file); what depends on the model (a soft-cap it does not have) is refused right after loading.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import ObservatoryError
from .tables import SHORT_DTYPE, cell_text, titled_table


def _count(n: int, red: bool = True) -> str:
    return f"[red]{n:,}[/red]" if n and red else f"{n:,}"


def compare_table(data: dict) -> Table:
    """Rows = the numbers, columns = the unmodified model and the model under surgery."""
    b, a, t = data["before"], data["after"], data["text"]
    m = data["model"]
    caption = (f"scored: {t['source']}; {t['scored_tokens']:,} tokens, {t['scored_bytes']:,} bytes, "
               f"windows of {t['window']:,} tokens. Bits per byte: -log2 p of each next token, p from the "
               "softmax row's method and dtype; entropy: the model's own distribution (fp32); a red "
               "count: something overflowed.")
    tab = titled_table(f"valve surgery on {m['name']} ({m['architecture']}, {m['dtype']}): "
                       + ", ".join(data["surgeries"]), caption)
    for name in ("", "before (unmodified)", "after"):
        tab.add_column(name, justify="right" if name else "left")

    def row(label, fn):
        tab.add_row(label, fn(b), fn(a))
    row("surgery", lambda d: "none" if d is b else escape(", ".join(data["surgeries"])))
    row("softmax (LM head, evaluation)",
        lambda d: f"{d['softmax']} {SHORT_DTYPE.get(d['softmax_dtype'], d['softmax_dtype'])}")
    row("bits per byte", lambda d: cell_text(d["bits_per_byte"], ".4f"))
    row("logit range", lambda d: f"{cell_text(d['logit_min'], '.2f')} .. {cell_text(d['logit_max'], '.2f')}")
    row("mean entropy (nats)", lambda d: cell_text(d["mean_entropy_nats"], ".3f"))
    row("logits over the dtype's exp() limit",
        lambda d: f"{_count(d['logits_over_threshold'], False)} (> {d['overflow_threshold']:.2f})")
    row("exp() results that overflowed", lambda d: _count(d["exp_overflow"]))
    row("non-finite probabilities", lambda d: _count(d["nonfinite_probs"]))
    row("positions broken", lambda d: f"{_count(d['rows_broken'])} / {t['scored_tokens']:,}")
    row("non-finite logits (forward)", lambda d: _count(d["nonfinite_logits"]))
    return tab


def continuation_table(data: dict) -> Table:
    tab = titled_table(f"greedy continuation, at most {data['max_new_tokens']} tokens, of the prompt "
                       f"{data['prompt'][:60]!r}{'...' if len(data['prompt']) > 60 else ''}")
    tab.add_column("before (unmodified)")
    tab.add_column("after")
    tab.add_row(escape(data["before"]["continuation"]), escape(data["after"]["continuation"]))
    return tab


def print_compare(data: dict, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    for note in ([data["text"]["note"]] if data["text"]["note"] else []) + data["notes"]:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    console.print(compare_table(data))
    console.print()
    console.print(continuation_table(data))


def run_cli(args, prompt: str) -> int:
    """The --surgery branch of `sluice inspect`: 0 done, 3 a forward produced NaN/inf."""
    from ..model import load
    from ..text.tokenizer import Tokenizer
    from .analysis import to_json
    from .surgery import compare, parse
    from .surgery_eval import MAX_TEXT_BYTES
    if not args.surgery:
        raise ObservatoryError("--text only applies with --surgery NAME[=VALUE]")
    if args.out or args.training:
        raise ObservatoryError("--surgery prints a before/after comparison; it does not combine "
                               "with --out or --training (run those without --surgery)")
    plan = parse(args.surgery)  # a bad name or value is refused before the (slow) load
    text = None
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise ObservatoryError(f"--text {path}: no such file")
        if path.stat().st_size > MAX_TEXT_BYTES:
            raise ObservatoryError(f"--text {path} is {path.stat().st_size:,} bytes, over the limit "
                                   f"of {MAX_TEXT_BYTES:,}: pass a shorter file")
        text = path.read_bytes().decode("utf-8", errors="replace")
    err = Console(stderr=True, highlight=False)
    with err.status(f"loading {args.model or 'the bundled model'} ({args.dtype})..."):
        model = load(args.model, dtype=args.dtype)
        tokenizer = Tokenizer.from_pretrained(model.model_dir)
    with err.status("measuring the model before and after surgery..."):
        data = compare(model, tokenizer, plan, text=text, prompt=prompt)
    if args.json:
        print(to_json(data))
    else:
        print_compare(data)
    broken = [k for k in ("before", "after") if data[k]["nonfinite_logits"]]
    for k in broken:
        err.print(f"[bold red]finding:[/bold red] the forward {k} surgery produced "
                  f"{data[k]['nonfinite_logits']:,} non-finite logits")
    sys.stdout.flush()
    return 3 if broken else 0
