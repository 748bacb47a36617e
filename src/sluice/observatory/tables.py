"""The terminal side of `sluice inspect`: rich tables drawn from the dict `analysis.inspect` makes.

Same numbers as the HTML report and the JSON, fewer of them: the terminal is narrow, so the lens
shows the last few positions and massive activations the largest channel per layer.
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .analysis import visible_token
from .internals_tables import attention_table, attribution_table
from .lens_views_report import lens_views_table

LENS_COLUMNS = 8  # positions of the lens that fit an 80-120 column terminal (print_all adapts it)


def cell_text(x, spec: str = ".3g") -> str:
    """A number for a cell; NaN and inf (which JSON-ish data may hold) printed as such."""
    if isinstance(x, str):
        return x
    if x is None:  # a valve this family does not have (OLMo 2 has no pre-norms)
        return "none"
    return format(x, spec) if math.isfinite(x) else str(x)


def _tok(text: str, width: int = 10) -> str:
    return escape(visible_token(text, width))


def titled_table(title: str, caption: str | None = None) -> Table:
    # rich wraps a title and caption to the table's width; a narrow table with a long caption
    # would turn it into a column of words, so the table is at least as wide as its text (up to
    # the terminal's width, which rich enforces).
    # both escaped: "[nan, nan]" or "layers [2, 3]" would otherwise be read as rich markup
    return Table(title=escape(title), title_justify="left", caption=escape(caption) if caption else None,
                 caption_justify="left",
                 min_width=min(max(len(title), len(caption or "")) + 4, 120))


def valves_table(s: dict, num_tokens: int, vocab_size: int) -> Table:
    """The four valves per block (RMS over the hidden size, mean over tokens), with the LM-head
    softmax of the last position as the caption. s: Observation.summary(); `sluice demo` uses it too."""
    rms = s["residual_rms"]
    t = titled_table(f"the four valves, {num_tokens} tokens (RMS over the hidden size, mean over tokens)")
    # the norms this family has: pre (Llama), pre + post (Gemma's sandwich), post only (OLMo 2)
    kinds = [k for k in ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")
             if any(v is not None for v in s.get(k + "_in", ()))]
    heads = {"attn_norm": "1. attn norm in -> out", "attn_post_norm": "attn post-norm",
             "mlp_norm": "1. mlp norm in -> out", "mlp_post_norm": "mlp post-norm"}
    for name in ("", *(heads[k] for k in kinds), "2. residual stream"):
        t.add_column(name, justify="right" if name else "left")
    t.add_row("embeddings", *[""] * len(kinds), f"x_0 {cell_text(rms[0], '.3f')}")
    for i in range(len(s["attn_norm_in"])):
        t.add_row(f"block {i}", *(f"{cell_text(s[k + '_in'][i], '.2f')} -> {cell_text(s[k + '_out'][i], '.2f')}" for k in kinds),
                  f"x_{i + 1} {cell_text(rms[i + 1], '.2f')}")
    if s["final_norm_in"] is not None:
        t.add_row("3. final norm", f"{cell_text(s['final_norm_in'], '.2f')} -> {cell_text(s['final_norm_out'], '.2f')}",
                  *[""] * max(len(kinds) - 1, 0),
                  f"grew {cell_text(rms[-1] / max(rms[0], 1e-12), '.0f')}x" if math.isfinite(rms[-1]) else "")
    V = vocab_size
    t.caption = caption = (f"4. LM head, last position: logits in [{cell_text(s['logit_min'], '.2f')}, {cell_text(s['logit_max'], '.2f')}], "
                 f"log-sum-exp {cell_text(s['logsumexp'], '.2f')}; softmax over {V:,} tokens: entropy "
                 f"{cell_text(s['entropy'], '.2f')} nats (uniform {math.log(V):.2f}), top-1 p {cell_text(s['top1_prob'], '.3f')}")
    t.caption = escape(caption)  # "[nan, nan]" would otherwise be read as rich markup
    t.min_width = min(len(caption) + 4, 120)
    return t


def lens_table(data: dict, columns: int = LENS_COLUMNS) -> Table:
    """Rows = layers, columns = the last `columns` positions: top-1 token and its probability."""
    lens, tokens = data["lens"], data["tokens"]["text"]
    first = max(0, len(tokens) - columns)
    cut = f", the last {len(tokens) - first} of {len(tokens)} positions (all in the HTML report)" if first else ""
    t = titled_table(f"logit lens: each layer's top next-token guess and its probability{cut}",
                     caption="row x_l = the residual stream after block l read through the final norm + LM head; "
                       "the last row is the model's own prediction")
    t.add_column("layer", no_wrap=True, min_width=5)
    for pos in range(first, len(tokens)):
        t.add_column(f"{pos} {_tok(tokens[pos], 6)}", justify="center", no_wrap=True)
    for layer, (words, probs) in enumerate(zip(lens["top1_token"], lens["top_probs"])):
        t.add_row("emb" if layer == 0 else f"x_{layer}",
                  *[f"{_tok(words[p], 6) if math.isfinite(probs[p][0]) else '-'} {cell_text(probs[p][0], '.2f')}" for p in range(first, len(tokens))])
    return t


SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def softmax_table(data: dict) -> Table:
    """Both cases in one table: the real logits, and the LM head on x_L with the final norm skipped."""
    sets = data["softmax_safety"]
    limits = {SHORT_DTYPE.get(r["dtype"], r["dtype"]): r["threshold"] for r in sets["with_final_norm"]}
    t = titled_table("softmax safety: each method in each dtype vs an fp64 reference, over all positions",
                     caption=f"max logit {cell_text(sets['with_final_norm'][0]['logit_max'], '.2f')} with the final norm, "
                       f"{cell_text(sets['without_final_norm'][0]['logit_max'], '.2f')} without; exp() overflows above "
                       + ", ".join(f"{v:.2f} in {k}" for k, v in limits.items())
                       + ". sum inf/0 = positions whose denominator overflowed or underflowed; broken = positions "
                         "with a NaN/inf probability or such a denominator; "
                         "error = max |p - p_fp64| (nan: some position broke)")
    for name in ("final norm", "method", "dtype", "exp() inf", "sum inf/0", "NaN probs", "broken", "max abs err"):
        t.add_column(name, justify="left" if name in ("final norm", "method", "dtype") else "right")
    for key, label in (("with_final_norm", "applied"), ("without_final_norm", "bypassed")):
        for i, r in enumerate(sets[key]):
            broken = f"{r['rows_broken']}/{r['rows']}"
            t.add_row(label if i == 0 else "", r["method"], SHORT_DTYPE.get(r["dtype"], r["dtype"]),
                      str(r["overflow"]), str(r["denom_overflow"] + r["denom_underflow"]), str(r["nan"]),
                      f"[red]{broken}[/red]" if r["rows_broken"] else broken,
                      cell_text(r["max_abs_err"], ".1e"), end_section=i == len(sets[key]) - 1)
    return t


def growth_table(data: dict) -> Table:
    g = data["growth"]
    acc = g.get("acceleration")
    bend = (f"; increments after block 0 grow {acc:.2f}x (last third / first)"
            if acc is not None and math.isfinite(acc) else "")
    t = titled_table("growth of the residual stream's mean square (RMS²) with depth, fitted on x_1..x_L",
                     caption=f"verdict: {g['verdict']}{bend}")
    for name in ("fit", "formula", "R² (linear space)"):
        t.add_column(name)
    t.add_row("linear", f"{cell_text(g['slope'])} * l + {cell_text(g['intercept'])}", cell_text(g["linear_r2"], ".3f"))
    if "quadratic" in g:
        t.add_row("quadratic", f"{cell_text(g['quadratic'])} * l² + ...", cell_text(g["quadratic_r2"], ".3f"))
    t.add_row("power law", f"{cell_text(g['coefficient'])} * l ^ {cell_text(g['exponent'], '.2f')}",
              cell_text(g["power_r2_linear"], ".3f"))
    return t


def massive_table(data: dict) -> Table:
    """The single largest-magnitude massive channel per layer (the HTML report lists more)."""
    rule = data.get("massive_rule") or {}
    big = rule.get("largest")
    note = (f"; none here. Largest seen: channel {big['channel']} at {big['ratio_to_rms']:.1f}x (layer {big['layer']})"
            if big and not data["massive_activations"] else "")
    t = titled_table("massive activations: the largest |x| channel of each layer's residual stream",
                     caption=f"|x| / RMS: how many times the token's RMS this one channel holds; listed from "
                             f"{rule.get('min_ratio_to_rms', 0):.0f}x{note}")
    for name in ("layer", "channel", "value", "position", "token", "|x| / RMS", "tokens with it in top-k"):
        t.add_column(name, justify="left" if name == "token" else "right")
    seen = set()
    for r in data["massive_activations"]:
        if r["layer"] in seen:
            continue
        seen.add(r["layer"])
        t.add_row("emb" if r["layer"] == 0 else f"x_{r['layer']}", str(r["channel"]), cell_text(r["value"], ".2f"),
                  str(r["position"]), _tok(r["token"], 12), cell_text(r["ratio_to_rms"], ".1f"),
                  str(r["tokens_in_topk"]))
    return t


def training_table(data: dict, rows: int = 8) -> Table:
    """The valves at (up to) `rows` evaluations of a training run, first and last included."""
    tr = data["training"]
    n = len(tr["steps"])
    picks = sorted({round(i * (n - 1) / max(rows - 1, 1)) for i in range(min(rows, n))})
    t = titled_table(f"the valves over training: {tr['run']} ({n} evaluations)",
                     caption="one fixed held-out window; loss: held-out, mean nats/token; RMS over the hidden "
                       "size, mean over tokens; final norm: RMS in->out; max logit, log Z, entropy: the "
                       "window's last position only")
    for name in ("step", "loss", "x_0 RMS", "x_L RMS", "final norm", "max logit", "log Z", "entropy (last pos.)"):
        t.add_column(name, justify="right")
    for i in picks:
        loss = tr["heldout_loss"][i]
        t.add_row(str(tr["steps"][i]), cell_text(loss, ".3f") if loss is not None else "",
                  cell_text(tr["residual_rms"][i][0]), cell_text(tr["residual_rms"][i][-1]),
                  f"{cell_text(tr['final_norm_in'][i])}->{cell_text(tr['final_norm_out'][i])}",
                  cell_text(tr["logit_max"][i]), cell_text(tr["logsumexp"][i]), cell_text(tr["entropy"][i]))
    return t


def print_all(data: dict, console: Console | None = None) -> None:
    """Findings first (a NaN explains every odd number after it), then each table that has data."""
    console = console or Console(highlight=False)
    m = data["model"]
    console.print(f"[bold]sluice inspect[/bold]: {escape(m['name'])} ({m['architecture']}, "
                  f"{m['num_params'] / 1e6:.1f}M parameters, {m['num_layers']} layers, {m['dtype']}), "
                  f"{len(data['tokens']['ids'])} tokens")
    for f in data["findings"]:
        console.print(f"[bold red]finding:[/bold red] {escape(f['message'])}")
    for name, why in data["skipped"].items():
        console.print(f"[yellow]skipped {name}:[/yellow] {escape(why)}")
    console.print(valves_table(data["valves"], len(data["tokens"]["ids"]), data["model"]["vocab_size"]))
    for key, fn in (("lens", lens_table), ("lens_views", lens_views_table), ("softmax_safety", softmax_table),
                    ("growth", growth_table),
                    ("massive_activations", massive_table), ("attention", attention_table),
                    ("attribution", attribution_table), ("training", training_table)):
        if key in data:
            console.print()
            # the lens gets as many positions as the terminal has room for (~12 columns each)
            console.print(fn(data) if key != "lens" else fn(data, max(3, (console.width - 10) // 13)))
