"""`sluice inspect`: the observatory on one prompt, as tables, JSON or an HTML report."""

from __future__ import annotations

from .common import _stdin_lines, _utf8


def cmd_inspect(args) -> int:
    from rich.console import Console

    from ..errors import ObservatoryError
    from ..model import load
    from ..observatory.analysis import inspect, to_json
    from ..observatory.report import prepare_out_dir, save
    from ..observatory.tables import print_all
    from ..tokenizer import Tokenizer
    prompt = _utf8(_stdin_lines().read() if args.prompt == "-" else args.prompt, "the prompt")
    if not prompt:  # refused before the (slow) load; too long is checked once the tokenizer is here
        raise ObservatoryError("the prompt is empty: give some text to inspect, e.g. "
                               "sluice inspect \"def read_config(path):\"")
    if args.surgery or args.text:  # what-if: before/after table (observatory/surgery_report.py)
        from ..observatory.surgery_report import run_cli
        return run_cli(args, prompt)
    out = prepare_out_dir(args.out) if args.out else None
    training = None
    if args.training:  # read (and checked) before the slow part
        from ..observatory.training import training_valves
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
