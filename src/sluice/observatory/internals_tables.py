"""The terminal side of the attention valves and the attribution: one row per block, the same numbers
as the report's heat maps and bars (internals_report.py), condensed over heads and positions.
"""

from __future__ import annotations

import math

from rich.markup import escape
from rich.table import Table

from .analysis import visible_token


def _f(x, spec: str = ".3g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else str(x)


def _table(title: str, caption: str) -> Table:
    # as tables.titled_table (which imports this module's functions, so it cannot be imported here)
    return Table(title=escape(title), title_justify="left", caption=escape(caption), caption_justify="left",
                 min_width=min(max(len(title), len(caption)) + 4, 120))


def largest_massive(data: dict, L: int) -> dict[int, dict]:
    """Per block, the largest |x| / RMS channel in the stream x_l the block reads (l < L): the heat maps'
    side panel, the attention table's last column and bench/inspect_scale.py's summary."""
    best: dict[int, dict] = {}
    for r in data.get("massive_activations") or []:
        if r["layer"] < L and r["ratio_to_rms"] > best.get(r["layer"], {"ratio_to_rms": -1.0})["ratio_to_rms"]:
            best[r["layer"]] = r
    return best


def attention_table(data: dict) -> Table:
    """Per block: the sink mass (mean over heads, and the head with the most), the entropy range, the peak
    pre-softmax score, mean q/k norms, and the largest massive activation of the stream it reads."""
    a = data["attention"]
    m = a["head_means"]
    L, H = len(m["entropy"]), a["num_heads"]
    big = largest_massive(data, L)
    kv = f"{H} heads" if a["num_kv_heads"] == H else f"{H} query heads on {a['num_kv_heads']} KV heads"
    t = _table(f"attention valves per block ({kv})",
               f"sink: attention on position 0; entropy in nats; means over {a['means_over']}; massive: "
               "the largest |x| / token RMS in the stream the block reads (listed from the report's threshold)")
    for name in ("block", "sink mean", "sink max (head)", "entropy min-max", "max logit", "|q|", "|k|", "massive"):
        t.add_column(name, justify="right")
    for i in range(L):
        sink = m["sink_mass"][i]
        h = max(range(H), key=lambda j: sink[j])
        ent = m["entropy"][i]
        r = big.get(i)
        t.add_row(str(i), _f(sum(sink) / H), f"{_f(sink[h])} ({h})", f"{_f(min(ent))}-{_f(max(ent))}",
                  _f(max(m["max_logit_peak"][i])), _f(sum(m["q_norm"][i]) / H),
                  _f(sum(m["k_norm"][i]) / len(m["k_norm"][i])),
                  f"{r['ratio_to_rms']:.1f}x ch {r['channel']}" if r else "-")
    return t


def attribution_table(data: dict) -> Table:
    """Per branch: its change of the residual's mean square (mean over positions) and its share of the
    attributed token's logit at the last position; the embeddings' row carries x_0's part."""
    a = data["attribution"]
    g, lg = a["growth"], a["logit"]
    last = {name: row[-1] for name, row in zip(a["components"], lg["contribution"])}
    tok = escape(visible_token(lg["target_tokens"][-1], 16))
    who = "given with --target" if lg["target"] == "given" else "the top-1 prediction"
    t = _table(f"attribution per branch: residual growth, and the logit of {tok!r} ({who}) at the last position",
               "growth: mean over positions of mean(|s + b|^2) - mean(|s|^2) for the branch output b added to the "
               f"stream s; logit: direct attribution with the final norm's scale frozen (sum "
               f"{_f(lg['sum'][-1])}, logit {_f(lg['logit'][-1])})")
    for name in ("branch", "growth of mean square", "logit share"):
        t.add_column(name, justify="left" if name == "branch" else "right")
    for name in a["components"]:
        if name in g["branches"]:
            t.add_row(escape(name), _f(g["mean_delta"][g["branches"].index(name)]), _f(last[name]))
        elif name == "embed":  # no growth step: the stream starts at x_0's mean square
            t.add_row(escape(name), f"x_0: {_f(g['mean_square'][0])}", _f(last[name]))
        else:  # a final-norm bias: a logit share only
            t.add_row(escape(name), "", _f(last[name]))
    return t
