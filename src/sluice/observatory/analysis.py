"""`inspect(model, tokenizer, prompt)`: every observatory measurement of one prompt, as one dict.

The dict holds plain Python numbers and lists (per layer, per position; the batch dimension is
dropped, there is one prompt), so `sluice inspect --json` prints it, and the plots, the terminal
tables and the HTML report are all drawn from it and nothing else. Non-finite floats stay floats
here; `to_json()` writes them as the strings "nan", "inf", "-inf" (JSON has no such numbers).

One forward under `observe()` gives the four valves; a hook on the last block keeps x_L for the
softmax check with the final norm bypassed; the logit lens runs its own forward. When the forward
produced a NaN or inf, that is the first finding (module, layer, position), and the analyses that
cannot work on non-finite data are listed under "skipped" with the reason instead of crashing.

Before a long run its cost is printed on stderr (inspect_cost.py: FLOPs, memory, and a time from a
short calibration); the dict itself stays free of timings, so a tensor-parallel run's dict equals a
single process's. Progress shows as a live bar on a terminal and as plain lines on stderr otherwise.
"""

from __future__ import annotations

import json
import math
import re
import sys
from contextlib import ExitStack, nullcontext
from pathlib import Path

import numpy as np
import torch

from ..errors import ObservatoryError
from .attach import logit_lens, observe
from .attention import attention_data
from .attribution import attribution_data
from .growth import fit_growth
from .inspect_cost import ANNOUNCE_S, LineProgress, describe, estimate
from .lens import head_logits
from .probes import LOGIT_STATS
from .softmax import softmax_safety
from .trajectories import add_views

SCHEMA = "sluice.inspect/1"
LENS_TOPK = 5
HIST_BINS = 80
MASSIVE_PER_LAYER = 3
# A channel is a massive activation when |x| is at least 10x its token's RMS, i.e. 100x an average
# channel's energy; the largest of C Gaussian channels is only ~sqrt(2 ln C), 3-4x, so the
# ordinary top channels of every layer are not listed (the largest one is still named).
MASSIVE_RATIO = 10.0
# Progress is drawn on stderr only when the work is long enough to look like a hang without it.
PROGRESS_TOKENS, PROGRESS_PARAMS = 256, 100e6


_VISIBLE = {" ": "\u00b7", "\n": "\u21b5", "\t": "\u2192", "\r": "\u240d"}


def visible_token(text: str, width: int | None = None) -> str:
    """A token as a reader can see it: space as a middle dot, newline as a return arrow, tab as an
    arrow, other control characters as \\xNN, cut to `width` characters with an ellipsis."""
    out = "".join(_VISIBLE.get(c, c if c.isprintable() else f"\\x{ord(c):02x}") for c in text) or "\u2205"
    if width is not None:  # in tight cells, an indentation run "········" reads better as "·×8"
        out = re.sub("\u00b7{3,}", lambda m: f"\u00b7\u00d7{len(m.group())}", out)
    return out if width is None or len(out) <= width else out[:width - 1] + "\u2026"


def check_prompt(prompt: str, ids: list[int], max_positions: int) -> None:
    """Refuse what cannot be inspected, naming the numbers, before any forward runs."""
    if not prompt or not ids:
        raise ObservatoryError("the prompt is empty: give some text to inspect, e.g. "
                               "sluice inspect \"def read_config(path):\"")
    if len(ids) > max_positions:
        raise ObservatoryError(f"the prompt is {len(ids):,} tokens, longer than the model's context of "
                               f"{max_positions:,} tokens (max_position_embeddings): shorten it by "
                               f"{len(ids) - max_positions:,} tokens")


def _progress(show: bool):
    """A rich progress display on stderr, plain lines where stderr is not a terminal (a log shows
    signs of life), or a do-nothing stand-in with the same methods."""
    if not show:
        class _Quiet:
            def add_task(self, *a, **k):
                return 0

            def advance(self, *a, **k):
                pass

            def update(self, *a, **k):
                pass
        return nullcontext(_Quiet())
    if not sys.stderr.isatty():
        return LineProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True)


def _rows(t: torch.Tensor) -> list:
    """A (..., B=1, T) tensor -> nested lists without the batch dimension."""
    return t.select(-2, 0).tolist() if t.ndim >= 2 else t.tolist()


def _histogram(with_norm: torch.Tensor, without_norm: torch.Tensor) -> dict:
    """Counts of the vocabulary's logits at one position, with and without the final norm, on
    shared bins so the two can be overlaid. Non-finite logits are counted, not binned."""
    a, b = with_norm.double().numpy(), without_norm.double().numpy()
    finite = np.concatenate([a[np.isfinite(a)], b[np.isfinite(b)]])
    if finite.size == 0:
        return {"edges": [], "with_final_norm": [], "without_final_norm": [],
                "nonfinite": {"with_final_norm": int(a.size), "without_final_norm": int(b.size)}}
    lo, hi = float(finite.min()), float(finite.max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, HIST_BINS + 1)
    count = lambda x: np.histogram(x[np.isfinite(x)], bins=edges)[0].tolist()  # noqa: E731
    return {"edges": edges.tolist(), "with_final_norm": count(a), "without_final_norm": count(b),
            "nonfinite": {"with_final_norm": int((~np.isfinite(a)).sum()),
                          "without_final_norm": int((~np.isfinite(b)).sum())}}


class _Tokens:
    """id -> readable text, decoded one token at a time and cached (lens grids repeat ids a lot)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, i: int) -> str:
        if i not in self.cache:
            self.cache[i] = self.tokenizer.decode([i], skip_special_tokens=False)
        return self.cache[i]


def inspect(model, tokenizer, prompt: str, progress: bool | None = None, target: int | None = None,
            tuned_lens=None) -> dict | None:
    """Measure everything the observatory knows about one forward of `prompt` (see module doc).

    progress: None = show a progress bar on stderr for long prompts or big models. target: the
    token id whose logit is attributed to the blocks at every position (None: each position's own
    top-1 prediction); given, its rank and probability through both lenses are kept too
    ("lens_views", trajectories.py). tuned_lens: a TunedLens, a path to one, None for the one saved
    beside the model if any, False for none; with one, "lens_views" holds it beside the logit lens.
    On a tensor-parallel rank model (parallel.load_rank), every rank calls this with the same prompt;
    the probes and the lens reduce over the ranks (observatory/sharded.py) and rank 0 gets the dict
    a single process would build, the other ranks None."""
    sharded = getattr(model, "world", 1) > 1
    root = getattr(model, "rank", 0) == 0
    cfg = getattr(model, "full_config", model.config)  # a rank model's own config is its narrow part
    # max_tokens: a prompt too long for the context is refused from its byte count, before tokenizing
    ids = tokenizer.encode(prompt, max_tokens=cfg.max_position_embeddings) if prompt else []
    check_prompt(prompt, ids, cfg.max_position_embeddings)
    T = len(ids)
    text = _Tokens(tokenizer)
    show = progress if progress is not None else (T >= PROGRESS_TOKENS or cfg.num_params >= PROGRESS_PARAMS)
    show = show and root
    # calibrating runs the LM head alone, which on a tensor-parallel rank would be a collective
    cost = estimate(model, T, calibrate=False if sharded else None)
    if root and (show or cost.get("seconds_estimate", 0) >= ANNOUNCE_S):
        print(describe(cost), file=sys.stderr, flush=True)
    data: dict = {"schema": SCHEMA, "prompt": prompt,
                  "model": {"name": Path(getattr(model, "model_dir", "model")).name,
                            "path": str(getattr(model, "model_dir", "")),
                            "architecture": cfg.architecture, "num_params": cfg.num_params,
                            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                            "vocab_size": cfg.vocab_size,
                            "max_position_embeddings": cfg.max_position_embeddings,
                            "dtype": str(model.embed.weight.dtype).removeprefix("torch.")},
                  "tokens": {"ids": ids, "text": [text(i) for i in ids]},
                  "findings": [], "skipped": {}}
    x = torch.tensor([ids])
    with _progress(show) as bar:
        fwd = bar.add_task("forward + probes (layers)", total=cfg.num_layers)
        last: dict[str, torch.Tensor] = {}
        with ExitStack() as stack, torch.inference_mode():
            obs = stack.enter_context(observe(model, capacity=(1, T), attribution=True))
            for block in model.layers:
                h = block.register_forward_hook(lambda *_: bar.advance(fwd))
                stack.callback(h.remove)
            h = model.layers[-1].register_forward_hook(lambda _m, _i, out: last.update(x_L=out.detach()))
            stack.callback(h.remove)
            logits = model(x)[0]  # (T, V) fp32; (T, V/N) on a tensor-parallel rank
        _probes(data, obs, text)
        nonfinite = data["nonfinite"]["first"] is not None
        _internals(data, obs, model, target, text, nonfinite)
        lens_task = bar.add_task("logit lens (layers)", total=cfg.num_layers + 1)
        _attempt(data, "lens", nonfinite, lambda: _lens(data, model, x, text, lambda _l: bar.advance(lens_task)))
        _attempt(data, "lens_views", nonfinite, lambda: add_views(data, model, x, text, target, tuned_lens))
        steps = bar.add_task("softmax safety, growth fit", total=2)
        _attempt(data, "softmax_safety", nonfinite,
                 lambda: _softmax(data, model, logits, last["x_L"][0], sharded))
        bar.advance(steps)
        ms = [float(np.mean(np.square(r))) for r in data["residual"]["rms"]]  # mean square per layer
        _attempt(data, "growth", nonfinite, lambda: data.update(growth=fit_growth(ms)))
        bar.advance(steps)
    return data if root else None


def _attempt(data: dict, name: str, nonfinite: bool, fn) -> None:
    """Run one analysis; a refusal (ObservatoryError), or any failure once the forward is known to
    hold NaN/inf, is recorded under data["skipped"][name] instead of ending the whole report."""
    try:
        fn()
    except ObservatoryError as e:
        data["skipped"][name] = str(e)
    except Exception as e:  # noqa: BLE001 - only swallowed when non-finite data explains it
        if not nonfinite:
            raise
        data["skipped"][name] = (f"cannot be computed on a forward that holds NaN/inf (see the non-finite "
                                 f"finding); it failed with {type(e).__name__}: {e}")


def _probes(data: dict, obs, text) -> None:
    """The valve probes' statistics, per layer and position, plus the non-finite check."""
    s = obs.stats
    data["valves"] = obs.summary()
    rms = s["resid_rms"]
    data["residual"] = {"rms": _rows(rms), "var": _rows(s["resid_var"]),
                        "absmax": _rows(s["resid_absmax"]), "mean_rms": rms.mean((1, 2)).tolist()}
    gain = obs.norm_gain()
    data["norms"] = {"names": list(obs.norm_names), "in_rms": _rows(s["norm_in_rms"]),
                     "out_rms": _rows(s["norm_out_rms"]), "gain": _rows(gain),
                     "mean_gain": gain.mean((1, 2)).tolist()}
    ratio = obs.branch_ratio()
    data["branches"] = {"names": list(obs.branch_names), "rms": _rows(s["branch_rms"]),
                        "ratio": _rows(ratio), "mean_ratio": ratio.mean((1, 2)).tolist()}
    per_pos = {k: _rows(s["logits"][i]) for i, k in enumerate(LOGIT_STATS)}
    top1 = _rows(s["top1_id"])
    data["logits"] = {"per_position": {**per_pos, "top1_id": top1, "top1_token": [text(i) for i in top1]}}
    first = obs.first_nonfinite()
    counts = s["nonfinite"].sum((1, 2)).tolist()
    data["nonfinite"] = {"first": first, "total": int(sum(counts)),
                         "per_site": {n: int(c) for n, c in zip(obs.sites.tracked, counts) if c}}
    if first is not None:
        where = f"layer {first['layer']}" if first["layer"] is not None else "outside the blocks"
        tok = data["tokens"]["text"][first["position"]]
        data["findings"].append({
            "kind": "nonfinite", **first,
            "message": f"non-finite values (NaN/inf) first appear in {first['module']} ({where}) at "
                       f"position {first['position']} (token {tok!r}): {first['positions']:,} token outputs there, "
                       f"{first['total']:,} over all modules; every later number inherits them"})
    _attempt(data, "massive_activations", first is not None, lambda: _massive(data, obs))


def _internals(data: dict, obs, model, target, text, nonfinite: bool) -> None:
    """Per-head attention statistics and the attribution of growth and logit (attention.py, attribution.py)."""
    _attempt(data, "attention", nonfinite, lambda: data.update(attention=attention_data(obs.attention, model)))
    _attempt(data, "attribution", nonfinite,
             lambda: data.update(attribution=attribution_data(obs.attribution(target), text, target is not None)))


def _massive(data: dict, obs) -> None:
    """Up to MASSIVE_PER_LAYER channels per layer that pass MASSIVE_RATIO, and the largest ratio
    seen anywhere (massive or not), so a report with none still says how close the model came."""
    massive = obs.massive_activations(top=MASSIVE_PER_LAYER, min_ratio=MASSIVE_RATIO)
    tops = obs.massive_activations(top=1)
    largest = max(tops, key=lambda r: r["ratio_to_rms"]) if tops else None
    for row in [*massive, *([largest] if largest else [])]:
        row["token"] = data["tokens"]["text"][row["position"]]
    data["massive_activations"] = massive
    data["massive_rule"] = {"min_ratio_to_rms": MASSIVE_RATIO, "per_layer": MASSIVE_PER_LAYER, "largest": largest}


def _lens(data: dict, model, x: torch.Tensor, text, on_layer=None) -> None:
    lens = logit_lens(model, x, topk=LENS_TOPK, on_layer=on_layer)
    top_ids = lens.top_ids[:, 0]  # (L+1, T, k)
    data["lens"] = {"topk": LENS_TOPK, "top_ids": top_ids.tolist(),
                    "top_probs": lens.top_probs[:, 0].tolist(),
                    "top1_token": [[text(i) for i in row] for row in top_ids[..., 0].tolist()],
                    "p_predicted": _rows(lens.predicted_prob), "kl_to_final": _rows(lens.kl),
                    "entropy": _rows(lens.entropy), "predicted": lens.predicted[0].tolist()}


def _softmax(data: dict, model, logits: torch.Tensor, x_last: torch.Tensor, sharded: bool = False) -> None:
    """The softmax check on the real logits, and on what the LM head gives when the final norm is
    bypassed (x_L straight into the head): the case the final norm exists to prevent. Under tensor
    parallelism both (T, V) are gathered to rank 0, which alone computes this part (sharded.py)."""
    with torch.inference_mode():
        raw = head_logits(model, x_last, final_norm=False).float()  # (T, V), or (T, V/N) on a rank
    if sharded:
        from .sharded import gather_to_root
        both = gather_to_root(torch.stack([logits.float(), raw]))  # (2, T, V) on rank 0
        if both is None:
            return
        logits, raw = both[0], both[1]
    data["softmax_safety"] = {"with_final_norm": softmax_safety(logits),
                              "without_final_norm": softmax_safety(raw)}
    per_pos = lambda z: {"max": z.amax(-1).tolist(), "logsumexp": torch.logsumexp(z, -1).tolist()}  # noqa: E731
    data["logits"]["without_final_norm"] = per_pos(raw)
    data["logits"]["histogram"] = {"position": logits.shape[0] - 1, **_histogram(logits[-1], raw[-1])}


def jsonable(obj):
    """Plain JSON: NaN and infinities become the strings "nan", "inf", "-inf"; tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("nan" if obj != obj else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return jsonable(obj.item())
    return obj


def to_json(data: dict, indent: int | None = None) -> str:
    return json.dumps(jsonable(data), indent=indent, ensure_ascii=False, allow_nan=False)
