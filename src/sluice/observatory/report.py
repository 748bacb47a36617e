"""The HTML report of `sluice inspect`: one self-contained file, drawn from the dict `analysis.inspect`
makes and the PNGs `plots.write_all` wrote.

Self-contained means it opens from disk with no network: the PNGs are embedded as base64 data:
URIs, the CSS is inline, there are no scripts, web fonts or external links (in-page #anchors only).
Every string from the model or the prompt is HTML-escaped, and tokens show their whitespace
(space as a middle dot, newline as a return arrow) because for a tokenizer the space is the token.
"""

from __future__ import annotations

import base64
import math
from html import escape
from pathlib import Path

from matplotlib import colormaps
from matplotlib.colors import to_hex

from ..errors import ObservatoryError
from .analysis import visible_token
from .internals_report import ATTENTION_HOW, ATTRIBUTION_HOW, attention_section, attribution_section
from .lens_views_report import TRAJECTORY_HOW, TUNED_HOW, has_trajectory, has_tuned, trajectory_section, tuned_section
from .plots import LENS_POSITIONS

PROMPT_OPEN = 200  # prompts up to this many tokens are shown unfolded
NONFINITE_ROWS = 12  # modules listed in the non-finite check; the rest only inherit the first one's NaN
# (anchor, title) in report order; tests check that every one is present
SECTIONS = [("valves", "The four valves"), ("residual", "Residual stream"), ("growth", "Growth fit"),
            ("norms", "Norm gains"), ("branches", "Branch / stream ratios"),
            ("massive", "Massive activations"), ("attention", "Attention valves per head"),
            ("attribution", "Attribution by block"), ("logits", "Logit histogram and entropy per position"),
            ("lens", "Logit lens"), ("tuned", "Tuned lens beside the logit lens"),
            ("trajectory", "Target trajectory"), ("softmax", "Softmax safety"), ("nonfinite", "Non-finite check"),
            ("training", "Valves over training")]  # the last one only with --training
# sections shown only when their data is there: a tuned lens, a --target, a training run
OPTIONAL = {"tuned": has_tuned, "trajectory": has_trajectory, "training": lambda data: "training" in data}

CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1200px;
 padding:0 24px 48px;color:#1d1d1f;background:#fff}
h1{margin:24px 0 4px}h2{margin-top:40px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#555}.how{color:#444;max-width:880px}
nav{columns:2;margin:16px 0;background:#f6f6f8;padding:8px 24px;border-radius:6px;max-width:720px}
nav a{color:#0b57d0;text-decoration:none}
img{max-width:100%;height:auto;display:block;margin:12px 0}
table{border-collapse:collapse;margin:12px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right;vertical-align:top}
th{background:#f6f6f8}td.l,th.l{text-align:left}
.prompt{font:13px/1.9 ui-monospace,Menlo,Consolas,monospace;background:#f6f6f8;padding:10px;
 border-radius:6px;white-space:normal;max-height:480px;overflow-y:auto}
summary{cursor:pointer;color:#444;margin:8px 0}
.tok{border:1px solid #c8c8d0;border-radius:3px;padding:0 2px;margin:0 1px;background:#fff;
 font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre}
.ws{color:#aaa}
.finding{background:#fde8e8;border-left:5px solid #c62828;padding:8px 12px;margin:12px 0}
.skipped{background:#fff6e0;border-left:5px solid #e6a100;padding:8px 12px;margin:12px 0}
.ok{background:#e8f5e9;border-left:5px solid #2e7d32;padding:8px 12px;margin:12px 0}
.bad{color:#c62828;font-weight:600}
table.lens td{padding:0;text-align:center;font:11px/1.25 ui-monospace,Menlo,Consolas,monospace;min-width:44px}
table.lens td b{font-weight:800}
table.lens small{opacity:.8}
.scroll{overflow-x:auto;max-width:100%}
"""


def _num(x, spec: str = ".3g") -> str:
    if isinstance(x, str):
        return escape(x)
    if x is None:  # a valve this family does not have (OLMo 2 has no pre-norms)
        return "none"
    return format(x, spec) if math.isfinite(x) else str(x)


def tok_html(text: str, width: int | None = None) -> str:
    """A token as escaped HTML with its whitespace drawn (grey marks), in a bordered chip."""
    shown = escape(visible_token(text, width))
    for mark in ("\u00b7", "\u21b5", "\u2192", "\u2205"):
        shown = shown.replace(mark, f'<span class="ws">{mark}</span>')
    return f'<span class="tok">{shown}</span>'


def _prompt_html(data: dict) -> str:
    """Every prompt token as a chip (hover: position and id); a line break after each newline, so
    code keeps its shape. A long prompt is folded (<details>, no script needed) so that it does not
    push the measurements pages down."""
    out = []
    for pos, (i, text) in enumerate(zip(data["tokens"]["ids"], data["tokens"]["text"])):
        out.append(f'<span title="position {pos}, id {i}">{tok_html(text)}</span>')
        if "\n" in text:
            out.append("<br>")
    n = len(data["tokens"]["ids"])
    fold = "" if n <= PROMPT_OPEN else " (click to show)"
    return (f'<details{" open" if n <= PROMPT_OPEN else ""}><summary>The prompt as the model sees it: {n:,} '
            f'tokens{fold}; hover a token for its position and id</summary>'
            f'<div class="prompt">{"".join(out)}</div></details>')


def _table(head: list[str], rows: list[list[str]], left: int = 0, cls: str = "") -> str:
    """An HTML table; the first `left` columns are left-aligned text. Cells are already HTML."""
    th = "".join(f'<th class="l">{h}</th>' if j < left else f"<th>{h}</th>" for j, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="l">{c}</td>' if j < left else f"<td>{c}</td>"
                                    for j, c in enumerate(r)) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _img(pngs: dict[str, Path], name: str, alt: str) -> str:
    if name not in pngs:
        return f'<p class="skipped">No {escape(alt)} plot: its analysis was skipped (see above).</p>'
    b64 = base64.b64encode(Path(pngs[name]).read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{b64}" alt="{escape(alt)}">'


def _valves(data: dict) -> str:
    s, rms = data["valves"], data["valves"]["residual_rms"]
    _n = lambda x: _num(x, "#.3g")  # noqa: E731 - trailing zeros kept, so a column lines up
    # the norms this family has: pre (Llama), pre + post (Gemma's sandwich), post only (OLMo 2)
    kinds = [k for k in ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")
             if any(v is not None for v in s.get(k + "_in", ()))]
    heads = {"attn_norm": "valve 1, attention norm: RMS in &rarr; out", "attn_post_norm": "attention post-norm",
             "mlp_norm": "valve 1, MLP norm: RMS in &rarr; out", "mlp_post_norm": "MLP post-norm"}
    rows = [["embeddings", *[""] * len(kinds), f"x_0 {_n(rms[0])}"]]
    rows += [[f"block {i}", *(f"{_n(s[k + '_in'][i])} &rarr; {_n(s[k + '_out'][i])}" for k in kinds),
              f"x_{i + 1} {_n(rms[i + 1])}"] for i in range(len(s["attn_norm_in"]))]
    if s["final_norm_in"] is not None:
        rows.append(["valve 3, final norm", f"{_n(s['final_norm_in'])} &rarr; {_n(s['final_norm_out'])}",
                     *[""] * max(len(kinds) - 1, 0),
                     f"grew {_num(rms[-1] / max(rms[0], 1e-30), '.0f')}x" if math.isfinite(rms[-1]) else ""])
    V = data["model"]["vocab_size"]
    head = _table(["", *(heads[k] for k in kinds), "valve 2, residual stream RMS"], rows, left=1)
    return head + (f"<p>Valve 4, the LM head at the last position: logits in [{_n(s['logit_min'])}, "
                   f"{_n(s['logit_max'])}], log-sum-exp {_n(s['logsumexp'])}; softmax over {V:,} tokens: "
                   f"entropy {_n(s['entropy'])} nats (uniform would be {math.log(V):.2f}), top-1 probability "
                   f"{_n(s['top1_prob'])}.</p>")


def _growth(data: dict, pngs) -> str:
    g = data["growth"]
    rows = [["linear", f"{_num(g['slope'])} &middot; l + {_num(g['intercept'])}", _num(g["linear_r2"])],
            ["power law", f"{_num(g['coefficient'])} &middot; l<sup>{_num(g['exponent'], '.2f')}</sup>",
             _num(g["power_r2_linear"])]]
    if "quadratic" in g:
        rows.insert(1, ["quadratic", f"{_num(g['quadratic'])} &middot; l<sup>2</sup> + &hellip;", _num(g["quadratic_r2"])])
    bend = ""
    if "increments" in g:
        steps = ", ".join(_num(x, ".3g") for x in g["increments"])
        acc = g["acceleration"]
        bend = (f"<p>Mean square added by each block (block 0 first): {steps}; the last third of the "
                f"increments after block 0 over the first third: "
                f"{_num(acc, '.2f') + 'x' if math.isfinite(acc) else 'undefined (the first third adds nothing)'}.</p>")
    return (_img(pngs, "growth_fit", "growth fit")
            + _table(["fit (l = 1..L, the same points)", "formula", "R&sup2;"], rows, left=2)
            + bend + f"<p><b>Verdict:</b> {escape(g['verdict'])}</p>")


def _massive(data: dict) -> str:
    rule = data.get("massive_rule")
    intro = ""
    if rule is not None:
        big = rule["largest"]
        closest = (f" The largest |x| / RMS seen: channel {big['channel']} at {_num(big['ratio_to_rms'], '.1f')}x in "
                   f"{'emb' if big['layer'] == 0 else 'x_' + str(big['layer'])}, position {big['position']}."
                   if big else "")
        intro = (f"<p>Listed: channels whose |x| reaches {_num(rule['min_ratio_to_rms'], '.0f')}x their token's RMS "
                 f"(up to {rule['per_layer']} per layer).{closest}</p>")
        if not data["massive_activations"]:
            return intro + "<p>None here: no channel of any layer is massive by that rule.</p>"
    rows = [["emb" if r["layer"] == 0 else f"x_{r['layer']}", str(r["channel"]), _num(r["value"], ".4g"),
             str(r["position"]), tok_html(r["token"]), _num(r["ratio_to_rms"], ".1f"), str(r["tokens_in_topk"])]
            for r in data["massive_activations"]]
    return intro + _table(["layer", "channel", "value", "position", "token", "|x| / token RMS",
                           "tokens with it in their top-k"], rows)


def _lens(data: dict) -> str:
    lens, tokens = data["lens"], data["tokens"]["text"]
    first = max(0, len(tokens) - LENS_POSITIONS)
    cmap = colormaps["viridis"]
    final = lens["top_ids"][-1]
    head = ["layer"] + [f"{p}<br>{tok_html(tokens[p], 8)}" for p in range(first, len(tokens))]
    rows = []
    for layer, (ids, probs, words) in enumerate(zip(lens["top_ids"], lens["top_probs"], lens["top1_token"])):
        cells = ["emb" if layer == 0 else f"x_{layer}"]
        for p in range(first, len(tokens)):
            prob = probs[p][0]
            ok = isinstance(prob, float) and math.isfinite(prob)
            bg, fg = (to_hex(cmap(prob)), "#000" if prob > 0.6 else "#fff") if ok else ("#999", "#000")
            word = escape(visible_token(words[p], 8)) if ok else "&mdash;"  # NaN: no real top token
            word = f"<b>{word}</b>" if ids[p][0] == final[p][0] else word
            cells.append(f'<span style="display:block;background:{bg};color:{fg};padding:2px">'
                         f"{word}<br><small>{_num(prob, '.2f')}</small></span>")
        rows.append(cells)
    note = (f"<p>Showing the last {len(tokens) - first} of {len(tokens)} positions (the JSON has all of "
            "them).</p>" if first else "")
    # 32 columns can be wider than the page: the table scrolls sideways instead of overflowing it
    return note + f'<div class="scroll">{_table(head, rows[::-1], left=1, cls="lens")}</div>'


def _softmax(data: dict) -> str:
    out = []
    for key, title in (("with_final_norm", "With the final norm (the logits the model really produces)"),
                       ("without_final_norm", "Final norm bypassed (LM head applied to the raw x_L)")):
        rows = []
        for r in data["softmax_safety"][key]:
            broken = f"{r['rows_broken']:,}/{r['rows']:,}"
            rows.append([r["method"], r["dtype"], _num(r["logit_max"], ".2f"), _num(r["threshold"], ".2f"),
                         f"{r['overflow']:,}", f"{r['denom_overflow'] + r['denom_underflow']:,}", f"{r['nan']:,}",
                         f'<span class="bad">{broken}</span>' if r["rows_broken"] else broken,
                         _num(r["max_abs_err"], ".2e"), _num(r["max_logz_err"], ".2e")])
        out.append(f"<h3>{title}</h3>" + _table(
            ["method", "dtype", "max logit", "exp() overflows above", "exp() = inf", "sum = inf or 0", "NaN probs",
             "broken positions", "max |p &minus; p<sub>fp64</sub>|", "max |log Z error|"], rows, left=2))
    return "".join(out)


def _nonfinite(data: dict) -> str:
    nf = data["nonfinite"]
    if nf["first"] is None:
        return '<p class="ok">No NaN or inf in any observed module output, at any position.</p>'
    sites = list(nf["per_site"].items())
    rows = [[escape(site), f"{count:,}"] for site, count in sites[:NONFINITE_ROWS]]
    more = (f"<p>&hellip; and {len(sites) - NONFINITE_ROWS} later modules (all in report.json).</p>"
            if len(sites) > NONFINITE_ROWS else "")
    return (f'<p class="finding">{escape(data["findings"][0]["message"])}</p>'
            "<p>Non-finite values per module, in execution order (the first row is the origin; everything "
            "after it inherits the NaN/inf):</p>" + _table(["module", "token outputs with NaN/inf"], rows, left=1) + more)


# anchor -> (how to read it, body builder); bodies that need missing data show why instead
HOW = {
    "valves": "The article's four valves, measured on this prompt: each input norm maps a stream of "
              "growing RMS back to about its weight's scale; the residual stream only ever has branches "
              "added to it; the final norm flattens it before the LM head; the softmax turns logits into "
              "a distribution.",
    "residual": "RMS over the hidden channels of x_l, the stream after block l. The line is the mean over "
                "positions (band: min to max); the heat map shows every position, so a token the stream "
                "treats specially (often the first) stands out.",
    "growth": "If every block added an independent update of similar size, the mean square of x_l would grow "
              "linearly with depth. Every fit is least squares over the same layers 1..L (x_0, the embeddings, is "
              "left out of all of them), and the increments show whether the curve bends; the verdict "
              "says which shape describes the data.",
    "norms": "Gain = RMS out / RMS in. Below 1 the norm shrinks the stream (the usual case deep in the model, "
             "where the stream is large); the q/k norms act per attention head.",
    "branches": "RMS of what the attention or MLP branch adds, over the RMS of the stream it is added to: "
                "how much a block can still change the stream. Small ratios deep down mean the stream's "
                "direction is mostly settled.",
    "massive": "Per layer, the channels with the largest |x| over all positions, if they are massive. A channel holding many "
               "times the token's RMS is a 'massive activation'; seen at every layer on the same channel, "
               "it is carried along the residual stream.",
    "attention": ATTENTION_HOW,
    "attribution": ATTRIBUTION_HOW,
    "tuned": TUNED_HOW,
    "trajectory": TRAJECTORY_HOW,
    "logits": "First: the logits of all vocabulary entries at the last position, with the final norm (what "
              "the model really computes) and with it bypassed. Red lines: where exp() overflows. Second: "
              "the next-token entropy and top-1 probability at each position.",
    "lens": "Each layer's residual stream read through the final norm and LM head (the logit lens). A cell "
            "is the top next-token guess at that depth, coloured by its probability; bold = the same as the "
            "model's final prediction (top row). The column headers are the input tokens; each cell guesses the token that follows.",
    "softmax": "Softmax over the vocabulary computed three ways in three dtypes, against an fp64 "
               "reference, at every position. 'naive' is exp(z)/sum exp(z); 'safe' subtracts the max "
               "first; 'online' finds max and sum in one pass. With the final norm bypassed the logits "
               "follow the raw stream's scale, which is what the final norm protects the softmax from.",
    "training": "The same summary (residual RMS per layer, final norm, last position's logits and entropy) "
                "that `sluice train` records at each evaluation on one fixed held-out window: how the valves "
                "formed as the model learned.",
    "nonfinite": "Every module output (residual stream, norms, branches, every Linear, the LM head) is checked "
                 "for NaN and inf; the first module in execution order that has one is where it came from.",
}


def _body(anchor: str, data: dict, pngs) -> str:
    needs = {"growth": "growth", "lens": "lens", "softmax": "softmax_safety", "massive": "massive_activations",
             "attention": "attention", "attribution": "attribution"}
    if anchor in needs and needs[anchor] not in data:
        why = data["skipped"].get(needs[anchor], "not computed")
        return f'<p class="skipped">Skipped: {escape(why)}</p>'
    return {
        "valves": lambda: _valves(data),
        "residual": lambda: _img(pngs, "residual_rms", "residual RMS per layer")
        + _img(pngs, "residual_heatmap", "residual RMS heat map"),
        "growth": lambda: _growth(data, pngs),
        "norms": lambda: _img(pngs, "norm_gains", "norm gains"),
        "branches": lambda: _img(pngs, "branch_ratios", "branch/stream ratios"),
        "massive": lambda: _massive(data),
        "attention": lambda: attention_section(data, lambda name, alt: _img(pngs, name, alt)),
        "attribution": lambda: attribution_section(data, lambda name, alt: _img(pngs, name, alt), tok_html),
        "logits": lambda: _img(pngs, "logit_histogram", "logit histogram") + _img(pngs, "entropy", "entropy"),
        "lens": lambda: _lens(data),
        "tuned": lambda: tuned_section(data, lambda name, alt: _img(pngs, name, alt), tok_html),
        "trajectory": lambda: trajectory_section(data, lambda name, alt: _img(pngs, name, alt), tok_html),
        "softmax": lambda: _softmax(data),
        "nonfinite": lambda: _nonfinite(data),
        "training": lambda: _training(data, pngs),
    }[anchor]()


def _training(data: dict, pngs) -> str:
    tr = data["training"]
    rows = [[str(step), _num(loss) if loss is not None else "", _num(rms[0]), _num(rms[-1]),
             f"{_num(fin)} &rarr; {_num(fout)}", _num(zmax), _num(lse), _num(ent)]
            for step, loss, rms, fin, fout, zmax, lse, ent in zip(
                tr["steps"], tr["heldout_loss"], tr["residual_rms"], tr["final_norm_in"],
                tr["final_norm_out"], tr["logit_max"], tr["logsumexp"], tr["entropy"])]
    return (f"<p>Run: <code>{escape(tr['run'])}</code></p>" + _img(pngs, "training_valves", "valves over training")
            + _table(["step", "held-out loss (mean over tokens)", "x_0 RMS", "x_L RMS", "final norm in &rarr; out",
                      "max logit (last position)", "log Z (last position)", "entropy (last position)"], rows))


def render(data: dict, pngs: dict[str, Path]) -> str:
    """The whole report as one HTML string."""
    m = data["model"]
    title = f"sluice inspect: {m['name']}, {len(data['tokens']['ids'])} tokens"
    parts = [f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>sluice inspect</h1><p class=\"meta\">{escape(m['name'])}: {escape(m['architecture'])}, "
             f"{m['num_params'] / 1e6:.1f}M parameters, {m['num_layers']} layers, hidden {m['hidden_size']}, "
             f"vocab {m['vocab_size']:,}, context {m['max_position_embeddings']:,}, weights in {m['dtype']}.</p>"]
    parts += [f'<p class="finding"><b>Finding:</b> {escape(f["message"])}</p>' for f in data["findings"]]
    parts += [f'<p class="skipped"><b>Skipped {escape(k)}:</b> {escape(v)}</p>' for k, v in data["skipped"].items()]
    parts.append(_prompt_html(data))
    sections = [(a, t) for a, t in SECTIONS if a not in OPTIONAL or OPTIONAL[a](data)]
    parts.append("<nav>" + "".join(f'<a href="#{a}">{i + 1}. {t}</a><br>'
                                    for i, (a, t) in enumerate(sections)) + "</nav>")
    for i, (anchor, name) in enumerate(sections):
        parts.append(f'<section id="{anchor}"><h2>{i + 1}. {name}</h2><p class="how">{HOW[anchor]}</p>'
                     f"{_body(anchor, data, pngs)}</section>")
    parts.append("<p class=\"meta\">Written by <code>sluice inspect</code>; every number is in report.json "
                 "next to this file, the figures are the PNGs beside it.</p></body></html>")
    return "\n".join(parts)


def write(data: dict, pngs: dict[str, Path], path: Path) -> Path:
    Path(path).write_text(render(data, pngs), encoding="utf-8")
    return Path(path)


def prepare_out_dir(out) -> Path:
    """Make `out` a writable directory or refuse with the reason, before any (slow) measurement."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ObservatoryError(f"--out {out} is an existing file, not a directory: pass a directory "
                               "(it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".sluice-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ObservatoryError(f"--out {out} is not a writable directory: {e.strerror or e}") from e
    return out


def save(data: dict, out_dir) -> dict[str, Path]:
    """Write the PNGs, report.html and report.json into out_dir; return {name: path}."""
    from .analysis import to_json
    from .plots import write_all
    out_dir = prepare_out_dir(out_dir)
    paths = write_all(data, out_dir)
    paths["html"] = write(data, paths, out_dir / "report.html")
    paths["json"] = out_dir / "report.json"
    paths["json"].write_text(to_json(data, indent=1), encoding="utf-8")
    return paths
