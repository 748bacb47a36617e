"""The report's sections on what happens inside the blocks: per-head attention valves and attribution
(the HTML around internals_plots.py's figures; report.py places them)."""

from __future__ import annotations

import math
from html import escape

ATTENTION_HOW = (
    "Per layer and head, from the attention's own inputs (q and k after their norms and RoPE, the causal "
    "mask and any sliding window, the scale and soft-cap; grouped-query heads share their KV head). "
    "Sink mass: the share of attention on position 0. Entropy: how spread the attention is (0 = one key). "
    "Max logit: the largest score the softmax receives. |q|: the query norm after q-norm and RoPE. Means "
    "over query positions 1.. (position 0 can only attend to itself). On the right, the largest "
    "massive activation (|x| over the token's RMS) in the stream each block reads: a head that parks "
    "its attention on the first token often sits on top of one.")
ATTRIBUTION_HOW = (
    "Top: each branch's change of the residual's mean square, mean(|s + b|&sup2;) &minus; mean(|s|&sup2;) for "
    "the output b it adds to the stream s (under a parallel residual the cross term is split equally); "
    "with the embeddings' mean square they add up to the last layer's, the growth fit's points. Bottom: "
    "direct logit attribution of the target token at the last position: the final norm's scale is frozen at "
    "its value for the full residual (as TransformerLens does), which makes the logit a sum over the "
    "embeddings and every branch (and the final norm's bias where it has one), before any final soft-cap.")


def _f(x, spec: str = ".3g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else escape(str(x))


def attention_section(data: dict, img) -> str:
    a = data["attention"]
    m = a["head_means"]
    L, H = len(m["entropy"]), a["num_heads"]
    cells = [(m["sink_mass"][i][h], i, h) for i in range(L) for h in range(H)]
    cells.sort(reverse=True)
    rows = "".join(f"<tr><td>{i}</td><td>{h}</td><td>{_f(s)}</td><td>{_f(m['top_is_first'][i][h])}</td>"
                   f"<td>{_f(m['entropy'][i][h])}</td><td>{_f(m['max_logit_peak'][i][h])}</td></tr>"
                   for s, i, h in cells[:5])
    kv = f"{H} query heads sharing {a['num_kv_heads']} KV heads" if a["num_kv_heads"] != H else f"{H} heads"
    extras = []
    if any(a["sliding"]):
        extras.append(f"sliding-window layers: {', '.join(str(i) for i, s in enumerate(a['sliding']) if s)}")
    if a["softcap"] is not None:
        extras.append(f"scores soft-capped at {_f(a['softcap'])} (max logit is after the cap)")
    note = f"<p>{kv}{'; ' + '; '.join(extras) if extras else ''}.</p>"
    table = ("<p>The heads with the most sink mass:</p><table><thead><tr><th>block</th><th>head</th>"
             "<th>sink mass</th><th>queries whose top key is position 0</th><th>entropy</th>"
             f"<th>max logit (peak)</th></tr></thead><tbody>{rows}</tbody></table>")
    return note + img("attention_heads", "attention heat maps") + table


def attribution_section(data: dict, img, tok) -> str:
    a = data["attribution"]
    lg, names = a["logit"], a["components"]
    last = [row[-1] for row in lg["contribution"]]
    order = sorted(range(len(names)), key=lambda j: -abs(last[j]))[:6]
    rows = "".join(f"<tr><td class=\"l\">{escape(names[j])}</td><td>{_f(last[j])}</td></tr>" for j in order)
    delta = a["growth"]["mean_delta"]
    grow = sorted(range(len(delta)), key=lambda j: -delta[j])[:3]
    top_growth = ", ".join(f"{escape(a['growth']['branches'][j])} ({_f(delta[j])})" for j in grow)
    return (img("attribution", "attribution by block")
            + f"<p>The mean square grows most in {top_growth}.</p>"
            f"<p>Largest parts of the logit of {tok(lg['target_tokens'][-1])} (id {lg['target_ids'][-1]}; "
            f"{'given with --target' if lg['target'] == 'given' else 'the model&#39;s top-1 prediction there'}) "
            f"at the last position (logit {_f(lg['logit'][-1])}, parts sum to {_f(lg['sum'][-1])}); every "
            "position is in report.json:</p>"
            "<table><thead><tr><th class=\"l\">component</th><th>share of the logit</th></tr></thead>"
            f"<tbody>{rows}</tbody></table><p class=\"meta\">{escape(a['note'])}.</p>")
