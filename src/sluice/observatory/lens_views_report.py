"""How the lens views (trajectories.py) are shown: two report sections (the tuned lens beside the logit
lens; the target's trajectory) around lens_views_plots.py's figures, and their terminal table."""

from __future__ import annotations

import math
from html import escape

from rich.markup import escape as rich_escape
from rich.table import Table

from .analysis import visible_token

TUNED_HOW = (
    "The tuned lens (Belrose et al. 2023) reads each layer's residual stream through a learned affine "
    "translator W<sub>l</sub> x + b<sub>l</sub> before the final norm and LM head, fitted on a corpus to "
    "minimise the KL to the model's final distribution. The logit lens reads x<sub>l</sub> as if it were "
    "already in the last layer's basis; where the two differ, the logit lens's KL measured that change of "
    "basis rather than what the layer does not know. Row x_0 is the first block's input.")
TRAJECTORY_HOW = (
    "The rank (1 = the most likely of the vocabulary) and probability of one token at every layer and "
    "position, through each lens: where in depth the model comes to predict it. Rank = 1 + the number of "
    "tokens with a larger logit at that layer. Each position predicts the token that follows it.")


def _f(x, spec: str = ".3g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else escape(str(x))


def _layer(l: int) -> str:
    return f"x_{l}"


def has_tuned(data: dict) -> bool:
    return "tuned" in data.get("lens_views", {}).get("lenses", {})


def has_trajectory(data: dict) -> bool:
    return data.get("lens_views", {}).get("target", {}).get("chosen", False)


def tuned_section(data: dict, img, tok) -> str:
    v = data["lens_views"]
    logit, tuned = v["lenses"]["logit"], v["lenses"]["tuned"]
    rows = "".join(
        f"<tr><td class=\"l\">{_layer(l)}</td><td>{_f(a)}</td><td>{_f(b)}</td>"
        f"<td class=\"l\">{tok(logit['top1_token'][l][-1])} {_f(logit['top1_prob'][l][-1], '.2f')}</td>"
        f"<td class=\"l\">{tok(tuned['top1_token'][l][-1])} {_f(tuned['top1_prob'][l][-1], '.2f')}</td></tr>"
        for l, (a, b) in enumerate(zip(logit["mean_kl"], tuned["mean_kl"])))
    meta = v.get("tuned_lens", {})
    fit, held = meta.get("fit") or {}, meta.get("heldout_kl") or {}
    prov = (f"<p class=\"meta\">Translators: <code>{escape(str(meta.get('source')))}</code>, fitted on "
            f"{escape(str(meta.get('corpus')))} ({_f(fit.get('steps'), 'd') if isinstance(fit.get('steps'), int) else '?'} "
            f"steps).")
    if held.get("tuned_lens"):
        prov += (" Held-out KL per layer when fitted: logit lens " + ", ".join(_f(x, ".2f") for x in held["logit_lens"])
                 + "; tuned lens " + ", ".join(_f(x, ".2f") for x in held["tuned_lens"]) + ".")
    return (img("lens_kl", "KL per layer, both lenses")
            + "<table><thead><tr><th class=\"l\">stream</th><th>logit lens KL</th><th>tuned lens KL</th>"
              "<th class=\"l\">logit lens top-1 at the last position</th>"
              "<th class=\"l\">tuned lens top-1 there</th></tr></thead>"
            f"<tbody>{rows}</tbody></table><p>KL(final || lens) in nats, mean over this prompt's positions.</p>"
            + prov + "</p>")


def trajectory_section(data: dict, img, tok) -> str:
    v = data["lens_views"]
    target = v["target"]
    names = list(v["lenses"])
    head = "".join(f"<th>{n} lens rank</th><th>{n} lens p</th>" for n in names)
    L1 = len(v["lenses"]["logit"]["target_rank"])
    rows = "".join(
        f"<tr><td class=\"l\">{_layer(l)}</td>"
        + "".join(f"<td>{v['lenses'][n]['target_rank'][l][-1]:,}</td><td>{_f(v['lenses'][n]['target_prob'][l][-1])}</td>"
                  for n in names) + "</tr>" for l in range(L1))
    return (f"<p>Target: {tok(target['tokens'][-1])} (id {target['ids'][-1]}), the same at every position.</p>"
            + img("trajectory", "target trajectory")
            + f"<p>At the last position:</p><table><thead><tr><th class=\"l\">stream</th>{head}</tr></thead>"
            f"<tbody>{rows}</tbody></table><p class=\"meta\">Every layer and position is in report.json "
            "(lens_views).</p>")


def lens_views_table(data: dict) -> Table:
    """Per layer: each lens's mean KL and, with a target, the target's rank and probability at the last position."""
    v = data["lens_views"]
    names = list(v["lenses"])
    chosen = v["target"]["chosen"]
    title = "logit lens" + (" and tuned lens" if "tuned" in names else "") + ": KL(final || lens) per layer"
    if chosen:
        title += f"; rank / p of {visible_token(v['target']['tokens'][-1], 16)!r} at the last position"
    caption = "KL in nats, mean over positions; rank 1 = top; x_0 = the first block's input"
    # as tables.titled_table: at least as wide as its title, so rich does not fold it into a column
    t = Table(title=rich_escape(title), title_justify="left", caption=rich_escape(caption), caption_justify="left",
              min_width=min(max(len(title), len(caption)) + 4, 120))
    t.add_column("stream")
    for n in names:
        t.add_column(f"{n} KL", justify="right")
        if chosen:
            t.add_column(f"{n} rank", justify="right")
            t.add_column(f"{n} p", justify="right")
    for l in range(len(v["lenses"]["logit"]["mean_kl"])):
        cells = []
        for n in names:
            lens = v["lenses"][n]
            cells.append(_f(lens["mean_kl"][l]))
            if chosen:
                cells += [f"{lens['target_rank'][l][-1]:,}", _f(lens["target_prob"][l][-1])]
        t.add_row(_layer(l), *cells)
    return t
