"""The figures of `sluice inspect`, one function per PNG, drawn from the dict `analysis.inspect` makes.

matplotlib's Agg backend (no display needed). Every function takes that dict and a path, and
writes one PNG. Non-finite values are drawn as gaps, never passed to a colour scale (which would
fail on them): a model that produced NaN still gets its plots, with holes where the NaN are.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from .analysis import visible_token  # noqa: E402
from .internals_plots import attention_heads, attribution_bars  # noqa: E402
from .lens_views_plots import layer_xticks, lens_kl, trajectory  # noqa: E402

DPI = 110
LENS_POSITIONS = 32  # the lens grid shows at most the last this-many positions
TOKEN_LABELS = 48  # label the position axis with tokens up to this many positions


def _arr(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _fonts() -> list[str]:
    """DejaVu Sans, then any installed CJK font as a fallback (matplotlib >= 3.6 falls back per glyph):
    vocabularies of real models are full of Chinese and Japanese tokens."""
    from matplotlib import font_manager
    cjk = sorted({f.name for f in font_manager.fontManager.ttflist
                  if any(k in f.name for k in ("CJK", "WenQuanYi", "Droid Sans Fallback", "Unifont"))})
    return ["DejaVu Sans", *cjk]


STYLE = {"font.family": _fonts()}


def _save(fig, path: Path) -> Path:
    with warnings.catch_warnings():
        # a glyph no installed font has is drawn as a box; the HTML report shows the real text
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _layer_labels(n: int) -> list[str]:
    """x_0 is the first block's input (the embeddings); x_l for l >= 1 is the output of block l-1."""
    return ["emb"] + [str(i) for i in range(1, n)]


def _layer_xticks(ax, n: int) -> None:
    layer_xticks(ax, _layer_labels(n))


def _position_axis(ax, tokens: list[str], first: int = 0) -> None:
    """Token text under each position for short prompts, plain position numbers otherwise."""
    if len(tokens) <= TOKEN_LABELS:
        ax.set_xticks(range(len(tokens)))
        ax.set_xticklabels([f"{first + i} {visible_token(t, 10)}" for i, t in enumerate(tokens)],
                           rotation=70, ha="right", fontsize=8)
    ax.set_xlabel("position (token)")


def _log_if_wide(ax, values: np.ndarray, axis: str = "y") -> None:
    """A log scale when the values span more than 30x, so the small ones stay visible."""
    v = values[np.isfinite(values) & (values > 0)]
    if v.size and v.max() / v.min() > 30:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def residual_rms(data: dict, path: Path) -> Path:
    rms = _arr(data["residual"]["rms"])  # (L+1, T)
    layers = np.arange(rms.shape[0])
    fig, ax = plt.subplots(figsize=(7, 4))
    with np.errstate(all="ignore"):
        lo, hi = np.nanmin(rms, 1), np.nanmax(rms, 1)
    ax.fill_between(layers, lo, hi, alpha=0.2, label="min..max over positions")
    ax.plot(layers, np.nanmean(rms, 1), "o-", label="mean over positions")
    ax.plot(layers, np.nanmedian(rms, 1), "s--", ms=4, label="median over positions")
    bad = ~np.isfinite(rms).all(1)
    for i, layer in enumerate(np.flatnonzero(bad)):
        ax.axvspan(layer - 0.5, layer + 0.5, color="red", alpha=0.12, lw=0,
                   label="NaN/inf at some position" if i == 0 else None)
    _log_if_wide(ax, hi)
    _layer_xticks(ax, len(layers))
    ax.set(xlabel="residual stream x_l (after block l; emb = embeddings)", ylabel="RMS over hidden channels",
           title="Residual stream RMS per layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def residual_heatmap(data: dict, path: Path) -> Path:
    rms = _arr(data["residual"]["rms"])  # (L+1, T)
    tokens = data["tokens"]["text"]
    fig, ax = plt.subplots(figsize=(min(4 + 0.28 * len(tokens), 16), 1.6 + 0.35 * rms.shape[0]))
    shown = np.ma.masked_invalid(np.where(rms > 0, rms, np.nan))
    norm = LogNorm() if shown.count() and shown.max() / shown.min() > 30 else None
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="magma", norm=norm, origin="lower")
    ax.set_yticks(range(rms.shape[0]), _layer_labels(rms.shape[0]))
    ax.set_ylabel("layer (x_l)")
    _position_axis(ax, tokens)
    fig.colorbar(im, ax=ax, label="RMS of x_l" + (" (log scale)" if norm else ""))
    ax.set_title("Residual stream RMS, layer x position (grey = NaN/inf)")
    ax.set_facecolor("0.7")
    return _save(fig, path)


def norm_gains(data: dict, path: Path) -> Path:
    """Mean gain (RMS out / RMS in) of each kind of norm, per layer; the final norm as one point."""
    names, gain = data["norms"]["names"], _arr(data["norms"]["mean_gain"])
    L = data["model"]["num_layers"]
    fig, ax = plt.subplots(figsize=(7, 4))
    kinds: dict[str, list] = {}
    for name, g in zip(names, gain):
        if name.startswith("layers."):
            layer, kind = name.split(".", 2)[1:]
            kinds.setdefault(kind, []).append((int(layer), g))
    for kind, pts in kinds.items():
        x, y = zip(*pts)
        ax.plot(x, y, "o-", label=kind.replace("attn.", ""))
    if "final_norm" in names:
        ax.plot([L], [gain[names.index("final_norm")]], "k*", ms=14, label="final_norm (before LM head)")
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    _log_if_wide(ax, gain)
    ax.set(xlabel="block", ylabel="gain = RMS out / RMS in (mean over positions)",
           title="Norm gains: < 1 shrinks the stream, > 1 amplifies it")
    ax.set_xticks(range(L + 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def branch_ratios(data: dict, path: Path) -> Path:
    names, ratio = data["branches"]["names"], _arr(data["branches"]["mean_ratio"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in ("attn", "mlp"):
        pts = [(int(n.split(".")[1]), r) for n, r in zip(names, ratio) if n.endswith("." + kind)]
        if pts:
            ax.plot(*zip(*pts), "o-", label=f"{kind} branch / stream it is added to")
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    _log_if_wide(ax, ratio)
    ax.set(xlabel="block", ylabel="RMS(branch) / RMS(stream) (mean over positions)",
           title="How much each branch writes, relative to the residual stream")
    ax.set_xticks(range(data["model"]["num_layers"]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def logit_histogram(data: dict, path: Path) -> Path:
    h = data["logits"]["histogram"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if h["edges"]:
        edges = _arr(h["edges"])
        for key, label in (("with_final_norm", "with the final norm (real)"),
                           ("without_final_norm", "final norm bypassed")):
            ax.stairs(h[key], edges, fill=key == "with_final_norm", alpha=0.6, label=label)
        ax.set_yscale("log")
        # log(finfo.max): above it exp() is inf in that dtype (softmax.overflow_threshold)
        for (name, t), ls in zip((("fp16", math.log(65504.0)), ("fp32 and bf16", 88.72)), ("--", ":")):
            if edges[0] <= t <= edges[-1]:
                ax.axvline(t, color="red", ls=ls, lw=1.2, label=f"exp(z) overflows in {name} (z > {t:.1f})")
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no finite logits", ha="center", transform=ax.transAxes)
    ax.set(xlabel="logit value", ylabel="vocabulary entries (log scale)",
           title=f"Logits over the vocabulary at the last position ({h['position']})")
    return _save(fig, path)


def entropy(data: dict, path: Path) -> Path:
    per = data["logits"]["per_position"]
    tokens, V = data["tokens"]["text"], data["model"]["vocab_size"]
    fig, (ax, ax2) = plt.subplots(2, 1, sharex=True, figsize=(min(4 + 0.28 * len(tokens), 16), 5.5))
    pos = np.arange(len(tokens))
    style = "o-" if len(tokens) <= 200 else "-"  # markers would merge into a thick band
    ax.plot(pos, _arr(per["entropy"]), style, ms=3)
    ax.axhline(math.log(V), color="grey", ls="--", lw=1)
    ax.text(0, math.log(V) * 0.97, f"uniform over {V:,} tokens: {math.log(V):.2f} nats", fontsize=8,
            va="top", color="grey")
    ax.set(ylabel="entropy (nats)", title="Next-token softmax, per position")
    ax.set_ylim(0, math.log(V) * 1.08)
    ax2.plot(pos, _arr(per["top1_prob"]), style, ms=3, color="C1")
    ax2.set(ylabel="top-1 probability", ylim=(0, 1.05))
    if not np.isfinite(_arr(per["entropy"])).any():
        ax.text(0.5, 0.5, "no finite logits (see the non-finite check)", ha="center", transform=ax.transAxes)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    _position_axis(ax2, tokens)
    return _save(fig, path)


def lens_grid(data: dict, path: Path) -> Path:
    """Layer x position: colour = probability of the layer's top token, text = that token."""
    lens, tokens = data["lens"], data["tokens"]["text"]
    T = len(tokens)
    first = max(0, T - LENS_POSITIONS)
    probs = _arr([[p[0] for p in row[first:]] for row in lens["top_probs"]])  # (L+1, n)
    words = [row[first:] for row in lens["top1_token"]]
    n, rows = probs.shape[1], probs.shape[0]
    fig, ax = plt.subplots(figsize=(2 + 0.75 * n, 1.5 + 0.42 * rows))
    im = ax.imshow(np.ma.masked_invalid(probs), aspect="auto", cmap="viridis", vmin=0, vmax=1,
                   origin="lower")
    for layer in range(rows):
        for j in range(n):
            p = probs[layer, j]
            word = visible_token(words[layer][j], 7) if np.isfinite(p) else "nan"  # NaN: no real top token
            ax.text(j, layer, word, ha="center", va="center", fontsize=7,
                    color="black" if np.isfinite(p) and p > 0.6 else "white")
    ax.set_yticks(range(rows), _layer_labels(rows))
    ax.set_ylabel("layer (x_l through the final norm + LM head)")
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{first + j} {visible_token(t, 8)}" for j, t in enumerate(tokens[first:])],
                       rotation=70, ha="right", fontsize=8)
    ax.set_xlabel("input position (token); each cell predicts the NEXT token")
    fig.colorbar(im, ax=ax, label="probability of the top token")
    note = f", last {n} of {T} positions" if first else ""
    ax.set_title(f"Logit lens: each layer's top next-token guess{note}")
    return _save(fig, path)


def growth_fit(data: dict, path: Path) -> Path:
    """The mean square per layer with the three fits (all on l = 1..L), and beside it the per-layer
    increments, which show a bend that R^2 alone hides."""
    g = data["growth"]
    ms = _arr([np.mean(np.square(r)) for r in data["residual"]["rms"]])
    layers = np.arange(ms.size)
    fig, (ax, inc) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(3, 2))
    ax.plot(layers, ms, "ko", label="measured (mean over positions)")
    fine = np.linspace(1, layers[-1], 200)
    ax.plot(fine, g["slope"] * fine + g["intercept"], "-",
            label=f"linear: {g['slope']:.3g} l + {g['intercept']:.3g} (R² {g['linear_r2']:.3f})")
    if "quadratic" in g:
        quad = np.polyfit(layers[1:], ms[1:], 2)  # growth.py's fit, refitted for its two other terms
        ax.plot(fine, np.polyval(quad, fine), ":",
                label=f"quadratic: {g['quadratic']:.3g} l² + ... (R² {g['quadratic_r2']:.3f})")
    ax.plot(fine, g["coefficient"] * fine ** g["exponent"], "--",
            label=f"power law: {g['coefficient']:.3g} l^{g['exponent']:.2f} (R² {g['power_r2_linear']:.3f})")
    _layer_xticks(ax, len(layers))
    ax.set(xlabel="residual stream x_l (fits over l = 1..L)", ylabel="mean square of x_l (RMS²)",
           title="Does the residual variance grow linearly with depth?")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title=g["verdict"].replace("; ", ";\n").replace(" (", "\n("), title_fontsize=7)
    steps = np.diff(ms)
    inc.bar(layers[1:], steps, color=["0.7"] + ["C0"] * (steps.size - 1))
    _layer_xticks(inc, len(layers))
    inc.set_xlim(0.4, layers[-1] + 0.6)
    acc = g.get("acceleration")
    note = f"; last / first third after block 0: {acc:.2f}x" if acc is not None and np.isfinite(acc) else ""
    inc.set(xlabel="x_l", ylabel="x_l² - x_(l-1)² (mean square added)",
            title=f"Per-layer increments (grey: block 0){note}")
    inc.title.set_fontsize(9)
    inc.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def training_valves(data: dict, path: Path) -> Path:
    """How the valves formed over a `sluice train` run: one point per evaluation."""
    tr = data["training"]
    steps = _arr(tr["steps"])
    rms = _arr(tr["residual_rms"])  # (evaluations, L+1)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0, 0]
    colours = plt.cm.viridis(np.linspace(0, 1, rms.shape[1]))
    for layer in range(rms.shape[1]):
        ax.plot(steps, rms[:, layer], color=colours[layer], label=_layer_labels(rms.shape[1])[layer])
    ax.set(ylabel="RMS of x_l (mean over tokens)", title="valve 2: residual stream, per layer")
    ax.legend(fontsize=7, ncol=2, title="x_l", title_fontsize=7)
    ax = axes[0, 1]
    ax.plot(steps, tr["final_norm_in"], "o-", label="final norm in (= x_L)")
    ax.plot(steps, tr["final_norm_out"], "s-", label="final norm out")
    ax.set(ylabel="RMS", title="valve 3: final norm")
    ax.legend(fontsize=8)
    for ax in axes[0]:
        _log_if_wide(ax, rms)
    ax = axes[1, 0]
    ax.plot(steps, tr["logit_max"], "o-", label="max logit")
    ax.plot(steps, tr["logsumexp"], "s-", label="log Z (log-sum-exp)")
    ax.set(xlabel="training step", ylabel="logit", title="valve 4: LM head, last position")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    # Two different quantities, said as such: the loss is a mean over every held-out token, the
    # entropy is the one distribution at the window's last position (what the valves log records)
    loss = [v if v is not None else math.nan for v in tr["heldout_loss"]]
    ax.plot(steps, loss, "s-", label="held-out loss, mean over its tokens (nats/token)")
    ax.plot(steps, tr["entropy"], "o:", label="softmax entropy at the window's LAST position only (nats)")
    ax.set(xlabel="training step", ylabel="nats", title="held-out loss; one position's entropy (not a mean)")
    ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(f"The valves over training ({len(steps)} evaluations of one fixed held-out window)")
    fig.tight_layout()
    return _save(fig, path)


# name -> (function, the data keys it needs); report.py shows them in this order
FIGURES = {
    "residual_rms": (residual_rms, ("residual",)),
    "residual_heatmap": (residual_heatmap, ("residual",)),
    "growth_fit": (growth_fit, ("growth",)),
    "norm_gains": (norm_gains, ("norms",)),
    "branch_ratios": (branch_ratios, ("branches",)),
    "logit_histogram": (logit_histogram, ("logits",)),
    "entropy": (entropy, ("logits",)),
    "lens_grid": (lens_grid, ("lens",)),
    "lens_kl": (lens_kl, ("lens_views",)),
    "trajectory": (trajectory, ("lens_views",)),
    "attention_heads": (attention_heads, ("attention",)),
    "attribution": (attribution_bars, ("attribution",)),
    "training_valves": (training_valves, ("training",)),
}


def write_all(data: dict, out_dir: Path) -> dict[str, Path]:
    """Every figure whose data exists (an analysis skipped for NaN has none) -> {name: png path}."""
    out_dir = Path(out_dir)
    written = {}
    with plt.rc_context(STYLE), warnings.catch_warnings():
        # NaN rows (a non-finite forward) make numpy's nan-reductions warn; the plots show them as gaps
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        for name, (fn, needs) in FIGURES.items():
            if all(k in data for k in needs) and (name != "logit_histogram" or "histogram" in data["logits"]):
                written[name] = fn(data, out_dir / f"{name}.png")
    return written
