"""The figures of what happens inside the blocks, from `analysis.inspect`'s dict: per-head attention
valves as layer x head heat maps beside the massive activations of the stream each layer reads,
and the attribution of the residual growth and of a logit to each block's attention and MLP.

Same conventions as plots.py (Agg backend, one PNG per function, NaN drawn as gaps)."""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .analysis import visible_token  # noqa: E402
from .internals_tables import largest_massive  # noqa: E402

DPI = 110  # as plots.py (which lists these figures, so it cannot be imported from here)

ANNOTATE_CELLS = 160  # write the value in each heat-map cell up to this many (layer, head) cells
HEAT = (("sink_mass", "sink mass: attention on position 0", "viridis", (0, 1)),
        ("entropy", "entropy of the attention (nats)", "magma", None),
        ("max_logit", "max attention logit (after scale, cap)", "inferno", None),
        ("q_norm", "|q| after q-norm and RoPE", "cividis", None))


def _arr(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _save(fig, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from")  # a box; the HTML has the text
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _block_ticks(ax, n: int, axis: str = "y") -> None:
    # 28 labels in 4 inches run together; along x a panel is ~3 inches wide for the heads
    step = (1 if n <= 24 else (2 if n <= 48 else 4)) if axis == "y" else -(-n // 8)
    ticks = list(range(0, n, step))
    (ax.set_yticks if axis == "y" else ax.set_xticks)(ticks, [str(t) for t in ticks])


def attention_heads(data: dict, path: Path) -> Path:
    means = data["attention"]["head_means"]
    L, H = np.asarray(means["entropy"]).shape
    fig, axes = plt.subplots(1, len(HEAT) + 1, figsize=(3.2 * len(HEAT) + 3, 1.8 + 0.3 * L),
                             gridspec_kw={"width_ratios": [1] * len(HEAT) + [0.8]}, sharey=True)
    for ax, (key, title, cmap, limits) in zip(axes, HEAT):
        v = _arr(means[key])
        vmin, vmax = limits or (np.nanmin(v) if np.isfinite(v).any() else 0, np.nanmax(v) if np.isfinite(v).any() else 1)
        if limits is None and vmax - vmin <= 1e-4 * max(abs(vmin), abs(vmax)):
            # a spread of float noise (unit-gain q/k norms make every |q| sqrt(head_dim)): one flat colour
            # over a +-1% scale, not rounding errors stretched over the whole colour map
            mid = (vmin + vmax) / 2
            vmin, vmax = mid - 0.01 * abs(mid) - 1e-12, mid + 0.01 * abs(mid) + 1e-12
        im = ax.imshow(np.ma.masked_invalid(v), aspect="auto", origin="lower", cmap=cmap, vmin=vmin, vmax=vmax,
                       interpolation="nearest")
        if L * H <= ANNOTATE_CELLS:
            for (i, j), x in np.ndenumerate(v):
                light = np.isfinite(x) and (x - vmin) > 0.6 * (vmax - vmin)
                ax.text(j, i, f"{x:.2g}", ha="center", va="center", fontsize=6, color="black" if light else "white")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("head")
        _block_ticks(ax, H, "x")
        bar = fig.colorbar(im, ax=ax, orientation="horizontal", pad=0.12 + 0.3 / L, fraction=0.05)
        bar.formatter.set_useOffset(False)  # "1e-6+1.131369e1" under the bar reads as nothing
    axes[0].set_ylabel("block (layer)")
    _block_ticks(axes[0], L)
    _massive_panel(axes[-1], data, L)
    fig.suptitle("Attention valves per head, mean over query positions 1.. (position 0 sees only itself)",
                 fontsize=10, y=1.02)
    return _save(fig, path)


def _massive_panel(ax, data: dict, L: int) -> None:
    """Beside the heat maps: the largest |x| / RMS in the stream x_l each block l reads, and its channel."""
    best = largest_massive(data, L)
    ratios = [best[i]["ratio_to_rms"] if i in best else np.nan for i in range(L)]
    if not best:  # an empty panel would read as a plotting bug: say what the rule found instead
        rule = data.get("massive_rule") or {}
        big = rule.get("largest")
        text = f"none at or above\n{rule.get('min_ratio_to_rms', 0):.0f}x the token RMS"
        if big:
            where = "x_L" if big["layer"] >= L else f"block {big['layer']}'s input"
            text += f"\n\nlargest: {big['ratio_to_rms']:.1f}x\n(ch {big['channel']}, {where})"
        ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=8, transform=ax.transAxes)
        ax.set_xticks([])
    ax.barh(range(L), ratios, color="C3", height=0.7)
    for i in best:
        ax.text(ratios[i], i, f" ch {best[i]['channel']}", va="center", fontsize=6)
    ax.set_xlabel("top |x| / token RMS")
    ax.set_title("massive activations in\nthe stream the block reads", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    ax.margins(x=0.25)


def attribution_bars(data: dict, path: Path) -> Path:
    a = data["attribution"]
    names, delta = a["growth"]["branches"], _arr(a["growth"]["mean_delta"])
    L = len(names) // 2
    blocks = np.arange(L)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(7, 0.32 * L + 4), 7.5))
    w = 0.4
    ax.bar(blocks - w / 2, delta[0::2], w, label="attention")
    ax.bar(blocks + w / 2, delta[1::2], w, label="MLP")
    ms0 = float(np.mean(a["growth"]["mean_square"][0]))
    ax.axhline(0, color="grey", lw=0.8)
    msL = float(np.mean(a["growth"]["mean_square"][-1]))
    ax.set(xlabel="block", ylabel="change of mean(x²), mean over positions",
           title="Who grows the residual stream: each branch's change of the mean square")
    _block_ticks(ax, L, "x")
    ax.legend(fontsize=8, title=f"mean(x²): embeddings {ms0:.3g}, x_L {msL:.3g}", title_fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    lg = a["logit"]
    contrib = _arr(lg["contribution"])[:, -1]  # (components,) at the last position
    comps = a["components"]
    ax2.bar([-1.0], [contrib[0]], w, color="C7", label="embeddings")
    ax2.bar(blocks - w / 2, contrib[1:1 + 2 * L:2], w, color="C0", label="attention")
    ax2.bar(blocks + w / 2, contrib[2:2 + 2 * L:2], w, color="C1", label="MLP")
    if len(comps) > 2 * L + 1:  # the final norm's bias (LayerNorm families)
        ax2.bar([L], [contrib[-1]], w, color="C2", label="final norm bias")
    ax2.axhline(0, color="grey", lw=0.8)
    T = len(lg["logit"])
    token = visible_token(lg["target_tokens"][-1], 16)
    ax2.set(xlabel="block", ylabel="share of the logit",
            title=f"Direct logit attribution of {token!r} at the last position ({T - 1}): logit "
                  f"{lg['logit'][-1]:.3g} = sum of the bars ({lg['sum'][-1]:.3g}); final norm's scale frozen")
    _block_ticks(ax2, L, "x")
    ax2.set_xticks([-1, *ax2.get_xticks()], ["emb", *(t.get_text() for t in ax2.get_xticklabels())])
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, path)
