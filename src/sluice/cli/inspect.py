"""`sluice inspect`: the observatory on one prompt, as tables, JSON or an HTML report."""

from __future__ import annotations

from .common import stdin_lines, tp_rank, utf8_arg


def cmd_inspect(args) -> int:
    from rich.console import Console

    from ..errors import ObservatoryError
    from ..model import load
    from ..observatory.analysis import inspect
    from ..text.tokenizer import Tokenizer
    tp_rank(args, "inspect")  # --tp against torchrun's environment, before the load; silences ranks > 0
    prompt = utf8_arg(stdin_lines().read() if args.prompt == "-" else args.prompt, "the prompt")
    if not prompt:  # refused before the (slow) load; too long is checked once the tokenizer is here
        raise ObservatoryError("the prompt is empty: give some text to inspect, e.g. "
                               "sluice inspect \"def read_config(path):\"")
    tp = getattr(args, "tp", 1) or 1  # --tp comes with the tensor-parallel model flags
    if getattr(args, "target", None) is not None and (args.surgery or args.text):
        raise ObservatoryError("--target chooses the token of the report's logit attribution; it does not apply "
                               "to --surgery/--text")
    if getattr(args, "tuned_lens", None) is not None and (args.surgery or args.text or tp > 1):
        raise ObservatoryError("--tuned-lens applies to the report of one process, not to --surgery/--text or --tp")
    if tp > 1:
        return _inspect_tp(args, prompt, tp)
    if args.surgery or args.text:  # what-if: before/after table (observatory/surgery_report.py)
        from ..observatory.surgery_report import run_cli
        return run_cli(args, prompt)
    out, training = _root_inputs(args)  # read (and checked) before the slow part
    err = Console(stderr=True, highlight=False)
    with err.status(f"loading {args.model or 'the bundled model'} ({args.dtype})..."):
        model = load(args.model, dtype=args.dtype)
        tokenizer = Tokenizer.from_pretrained(model.model_dir)
    target = target_id(tokenizer, args.target, model.config.vocab_size) if args.target is not None else None
    data = inspect(model, tokenizer, prompt, target=target, tuned_lens=_tuned(args, model))
    return _emit(args, data, training, out, err)


def _tuned(args, model):
    """--tuned-lens: None (the one beside the model, if any), False ('none'), or the loaded lens: a
    file that does not fit the model is refused here, before the measurements."""
    if args.tuned_lens is None:
        return None
    if args.tuned_lens.lower() == "none":
        return False
    from ..observatory.tuned_lens import load as load_tuned
    return load_tuned(args.tuned_lens, model)


def target_id(tokenizer, text: str, vocab_size: int) -> int:
    """--target: one token's text, or id:N, -> its id; anything else is refused with the reason."""
    from ..errors import ObservatoryError
    if text.startswith("id:") and text[3:].strip().isdigit():
        i = int(text[3:])
        if i >= vocab_size:
            raise ObservatoryError(f"--target {text}: the vocabulary has ids 0..{vocab_size - 1}")
        return i
    ids = tokenizer.encode(text, add_special_tokens=False, what="--target") if text else []
    if len(ids) != 1:
        pieces = ", ".join(repr(tokenizer.decode([i], skip_special_tokens=False)) for i in ids[:8])
        raise ObservatoryError(f"--target {text!r} is {len(ids)} tokens ({pieces or 'none'}): give the text of "
                               "exactly one token, or id:N")
    return ids[0]


def _emit(args, data: dict, training, out, err) -> int:
    """Print (tables or JSON) and write the report; the exit status (3: a NaN/inf finding)."""
    from ..observatory.analysis import to_json
    from ..observatory.report import save
    from ..observatory.tables import print_all
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


def _inspect_tp(args, prompt: str, tp: int) -> int:
    """`torchrun --nproc-per-node N -m sluice inspect --tp N ...`: every rank loads its part and runs
    the same pass (observatory/sharded.py reduces the statistics); rank 0 alone prints and writes.
    Rank 0's checks of --out and --training are shared, so all ranks stop together on bad input."""
    from rich.console import Console

    from ..errors import SluiceError, SurgeryError
    from ..observatory.analysis import inspect
    from ..parallel import init, load_rank, shutdown
    from ..parallel.group import all_gather_object
    from ..text.tokenizer import Tokenizer
    if args.surgery or args.text:
        raise SurgeryError("--surgery/--text are not implemented under tensor parallelism (--tp): run the "
                           "what-if on one process")
    ranks = init()  # cmd_inspect's tp_rank has checked the group's size against --tp
    try:
        root, out, training, problem = ranks.rank == 0, None, None, None
        if root:
            try:
                out, training = _root_inputs(args)
            except SluiceError as e:
                problem = e
        if all_gather_object(None if problem is None else str(problem))[0] is not None:
            if root:
                raise problem
            return 2  # rank 0 prints the reason
        err = Console(stderr=True, highlight=False, quiet=not root)
        with err.status(f"loading {args.model or 'the bundled model'} ({args.dtype}), rank {ranks.rank} of {tp}..."):
            model = load_rank(args.model if args.model is not None else _bundled(), ranks, dtype=args.dtype)
            tokenizer = Tokenizer.from_pretrained(model.model_dir)
        cfg = getattr(model, "full_config", model.config)
        target = target_id(tokenizer, args.target, cfg.vocab_size) if args.target is not None else None
        data = inspect(model, tokenizer, prompt, target=target)
        return _emit(args, data, training, out, err) if root else 0
    finally:
        shutdown()


def _root_inputs(args):
    from ..observatory.report import prepare_out_dir
    out = prepare_out_dir(args.out) if args.out else None
    training = None
    if args.training:
        from ..observatory.training import training_valves
        training = {"run": args.training, **training_valves(args.training)}
    return out, training


def _bundled():
    from ..model.loading import bundled_model_dir
    return bundled_model_dir()
