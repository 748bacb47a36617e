"""The `model.` numbers of docs/observatory.md, measured on the bundled model (bench/docs_numbers.py).

Only public entry points: sluice.load, sluice.Tokenizer, sluice.surgery.compare and
sluice.observatory.analysis.inspect (what `sluice inspect` and `sluice inspect --surgery` print).
The surgery text is the held-out split of the bundled model's recipe, which is this interpreter's
standard library, so the numbers belong to one Python minor version: `model.python` names it and
the test compares them only on that version.
"""

from __future__ import annotations

import sys
from functools import cache

PROMPT = "def read_config(path):"
SURGERIES = {  # value-name prefix -> the surgeries the prose quotes
    "final": ["final-norm=off"],
    "final_naive": ["final-norm=off", "softmax=naive"],
    "final_online16": ["final-norm=off", "softmax=online", "softmax-dtype=float16"],
    "layer": ["norm=layer"],
    "naive16": ["softmax=naive", "softmax-dtype=float16"],
}


def f(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


def _row(rows: list[dict], method: str, dtype: str) -> dict:
    return next(r for r in rows if r["method"] == method and r["dtype"] == dtype)


@cache
def measure() -> dict:
    import sluice
    from sluice.observatory.analysis import inspect
    model = sluice.load()
    tok = sluice.Tokenizer.from_pretrained(model.model_dir)
    return {"short": inspect(model, tok, PROMPT, progress=False),
            "surgery": {k: sluice.surgery.compare(model, tok, s, prompt=PROMPT) for k, s in SURGERIES.items()}}


def valves(d: dict) -> dict[str, str]:
    v = d["valves"]
    rms, names, gains = v["residual_rms"], d["norms"]["names"], d["norms"]["mean_gain"]
    # the hidden-size norms after block 0's attention norm (q/k norms act per head, the final norm last)
    deep = [g for n, g in zip(names, gains) if n != "layers.0.attn_norm" and not n.endswith(("q_norm", "k_norm", "final_norm"))]
    ratios = dict(zip(d["branches"]["names"], d["branches"]["mean_ratio"]))
    later = [r for n, r in ratios.items() if not n.startswith("layers.0.")]
    last = d["logits"]["per_position"]
    return {
        "model.prompt.tokens": str(len(d["tokens"]["ids"])),
        "model.layers": str(d["model"]["num_layers"]), "model.norms": str(len(names)),
        "model.valves.embed_rms": f(rms[0], 3), "model.valves.last_rms": f(rms[-1], 1),
        "model.valves.growth": f"{rms[-1] / rms[0]:.0f}x", "model.valves.final_out": f(v["final_norm_out"]),
        "model.valves.final_shrink": f"{rms[-1] / v['final_norm_out']:.1f}x",
        "model.growth.verdict": d["growth"]["verdict"].replace("R^2", "R²"),
        "model.gain.first": f"{gains[names.index('layers.0.attn_norm')]:.0f}",
        "model.gain.deep": f"{1 / max(deep):.1f} to {1 / min(deep):.1f}",
        "model.branch.first": f"{ratios['layers.0.attn']:.0f}",
        "model.branch.deep": f"{min(later):.2f} to {max(later):.2f}",
        "model.logits.with": f"[{last['min'][-1]:.1f}, {last['max'][-1]:.1f}]",
        "model.logits.without_max": f(d["logits"]["without_final_norm"]["max"][-1], 1),
    }


def massive(d: dict) -> dict[str, str]:
    """How many channels pass inspect's massive rule (|x| >= 10x the token's RMS), and the largest
    ratio seen, where: the bundled model's top channels are outliers, not massive activations."""
    rule, rows = d["massive_rule"], d["massive_activations"]
    big = rule["largest"]
    return {"model.massive.rule": f"{rule['min_ratio_to_rms']:.0f}x",
            "model.massive.count": str(len(rows)),
            "model.massive.largest": f"{big['ratio_to_rms']:.1f}x",
            "model.massive.largest_channel": str(big["channel"]),
            "model.massive.largest_layer": "the embeddings" if big["layer"] == 0 else f"x_{big['layer']}",
            "model.massive.largest_token": "`" + big["token"].replace("\n", "↵") + "`"}


def safety(short: dict) -> dict[str, str]:
    s_with, s_without = short["softmax_safety"]["with_final_norm"], short["softmax_safety"]["without_final_norm"]
    n16 = _row(s_with, "naive", "float16")
    bf16 = [_row(t, m, "bfloat16")["max_abs_err"] for t in (s_with, s_without) for m in ("naive", "safe", "online")]
    safe_broken = sum(r["rows_broken"] for t in short["softmax_safety"].values() for r in t if r["method"] != "naive")
    return {
        "model.safety.safe_broken": str(safe_broken),
        "model.safety.naive16.broken": f"{n16['rows_broken']} of {n16['rows']}",
        "model.safety.naive16.overflow": str(n16["overflow"]),
        "model.safety.naive16_raw.broken": f"{_row(s_without, 'naive', 'float16')['rows_broken']} of {n16['rows']}",
        "model.safety.naive16_raw.overflow": f(_row(s_without, "naive", "float16")["overflow"], 0),
        "model.safety.bf16_err": f"{min(bf16):.0e} to {max(bf16):.0e}",
    }


def table(before: dict, after: dict, name: str) -> str:
    def cont(r):
        return "`" + r["continuation"].replace("\n", "\\n").replace("|", "\\|") + "`"
    rows = [("bits per byte", f(before["bits_per_byte"], 4), f(after["bits_per_byte"], 4)),
            ("logit range", *(f"{r['logit_min']:.2f} .. {r['logit_max']:.2f}" for r in (before, after))),
            ("mean entropy (nats)", f(before["mean_entropy_nats"], 3), f(after["mean_entropy_nats"], 3)),
            (f"logits over fp32's exp() limit ({before['overflow_threshold']:.2f})",
             str(before["logits_over_threshold"]), str(after["logits_over_threshold"])),
            ("exp() overflows / non-finite probs / broken positions (safe fp32)",
             *(f"{r['exp_overflow']} / {r['nonfinite_probs']} / {r['rows_broken']}" for r in (before, after))),
            ("greedy continuation", cont(before), cont(after))]
    return "\n".join([f"| | before (unmodified) | after `{name}` |", "|---|---|---|"] +
                     [f"| {a} | {b} | {c} |" for a, b, c in rows])


def surgery(s: dict) -> dict[str, str]:
    fin, fin_n, fin_o16, lay, n16 = (s[k] for k in SURGERIES)
    b, a, t = fin["before"], fin["after"], fin["text"]
    bpb = (lambda r: "inf" if r["bits_per_byte"] == float("inf") else f(r["bits_per_byte"], 4))
    return {
        "model.text.source": t["source"].split(": ", 1)[1].removeprefix("the first ").replace(" bytes of ", " bytes of the held-out files "),
        "model.text.scored_tokens": f(t["scored_tokens"], 0), "model.text.scored_bytes": f(t["scored_bytes"], 0),
        "model.text.window": f(t["window"], 0),
        "model.surgery.final.table": table(b, a, "final-norm=off"),
        "model.surgery.layer.table": table(lay["before"], lay["after"], "norm=layer"),
        "model.surgery.final.worse": f"{a['bits_per_byte'] / b['bits_per_byte']:.1f}x",
        "model.surgery.final.logit_max": f"{a['logit_max']:.0f} instead of {b['logit_max']:.0f}",
        "model.surgery.final.entropy": f"{a['mean_entropy_nats']:.2f} nats instead of {b['mean_entropy_nats']:.2f}",
        "model.surgery.final.over": str(a["logits_over_threshold"]),
        "model.surgery.final_naive.broken": f"{fin_n['after']['rows_broken']:,} of the {t['scored_tokens']:,}",
        "model.surgery.final_naive.exp_inf": f(fin_n["after"]["exp_overflow"], 0),
        "model.surgery.final_naive.bpb": bpb(fin_n["after"]),
        "model.surgery.final_online16.bpb": bpb(fin_o16["after"]),
        "model.surgery.final.bpb": bpb(a),
        "model.surgery.layer.delta": f"{lay['after']['bits_per_byte'] - lay['before']['bits_per_byte']:+.3f}",
        "model.surgery.layer.percent": f"{100 * (lay['after']['bits_per_byte'] / lay['before']['bits_per_byte'] - 1):+.1f}%",
        "model.surgery.naive16.exp_inf": f(n16["after"]["exp_overflow"], 0),
        "model.surgery.naive16.broken": f(n16["after"]["rows_broken"], 0),
        "model.surgery.naive16.bpb": bpb(n16["after"]),
        "model.surgery.unmodified.logit_max": f(n16["before"]["logit_max"], 2),
    }


def values() -> dict[str, str]:
    m = measure()
    return {"model.python": f"{sys.version_info.major}.{sys.version_info.minor}",
            **valves(m["short"]), **massive(m["short"]), **safety(m["short"]), **surgery(m["surgery"])}
