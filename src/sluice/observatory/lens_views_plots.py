"""The figures of the lens views (trajectories.py), from `analysis.inspect`'s dict: the KL of each lens to
the final layer per layer, and the target token's rank at every layer and position through each lens.

Same conventions as plots.py (Agg backend, one PNG per function, NaN drawn as gaps)."""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from .analysis import visible_token  # noqa: E402

DPI = 110  # as plots.py (which lists these figures, so it cannot be imported from here)
POSITIONS = 32  # the rank heat map shows at most the last this-many positions
ANNOTATE = 1000  # write the rank in each cell up to this many cells per panel
NAMES = {"logit": "logit lens", "tuned": "tuned lens"}


def _save(fig, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from")  # a box; the HTML has the text
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _layer_labels(n: int) -> list[str]:
    return ["x_0"] + [f"x_{i}" for i in range(1, n)]


MAX_LAYER_TICKS = 15  # more labels than this along a 7-inch axis run together


def layer_xticks(ax, labels: list[str], max_ticks: int = MAX_LAYER_TICKS) -> None:
    """Layer labels on the x axis, thinned to at most max_ticks (every 2nd at 28 layers), always keeping
    the first and the last layer."""
    n = len(labels)
    step = -(-n // max_ticks)
    ticks = list(range(0, n, step))
    if ticks[-1] != n - 1:
        ticks[-1:] = [n - 1] if n - 1 - ticks[-1] <= step / 2 else [ticks[-1], n - 1]
    ax.set_xticks(ticks, [labels[i] for i in ticks])


def _compact(rank: float) -> str:
    return f"{rank:.0f}" if rank < 1000 else (f"{rank / 1000:.1f}k" if rank < 10_000 else f"{rank / 1000:.0f}k")


def lens_kl(data: dict, path: Path) -> Path:
    """Mean KL(final || lens) per layer, one line per lens, on a log scale (it spans decades)."""
    lenses = data["lens_views"]["lenses"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, view in lenses.items():
        kl = np.asarray(view["mean_kl"], dtype=np.float64)[:-1]  # x_L's is 0 by definition
        ax.plot(np.arange(kl.size), np.where(kl > 0, kl, np.nan), "o-", label=NAMES[name])
    n = len(next(iter(lenses.values()))["mean_kl"]) - 1
    layer_xticks(ax, _layer_labels(n))
    ax.set_yscale("log")
    ax.set(xlabel="residual stream read (x_L, the model's output, has KL 0)",
           ylabel="KL(final || lens), nats, mean over positions",
           title="How far each layer's reading is from the model's final distribution")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def trajectory(data: dict, path: Path) -> Path:
    """Layer x position heat map of the target's rank (log colour scale, 1 = top), one panel per lens."""
    views, tokens = data["lens_views"], data["tokens"]["text"]
    lenses, target = views["lenses"], views["target"]
    T = len(tokens)
    first = max(0, T - POSITIONS)
    V = data["model"]["vocab_size"]
    n, rows = T - first, len(next(iter(lenses.values()))["target_rank"])
    # ~0.3 in per column and row: enough for a compact rank ("678", "1.2k") in each cell
    fig, axes = plt.subplots(1, len(lenses), figsize=(1.5 + len(lenses) * (1 + 0.3 * n), 1.6 + 0.3 * rows),
                             squeeze=False, sharey=True)
    norm = LogNorm(vmin=1, vmax=V)
    for ax, (name, view) in zip(axes[0], lenses.items()):
        rank = np.asarray(view["target_rank"], dtype=np.float64)[:, first:]  # (L+1, n)
        im = ax.imshow(rank, aspect="auto", origin="lower", cmap="viridis_r", norm=norm, interpolation="nearest")
        if rank.size <= ANNOTATE:
            for (i, j), r in np.ndenumerate(rank):
                ax.text(j, i, _compact(r), ha="center", va="center", fontsize=6,
                        color="white" if r > V ** 0.5 else "black")
        ax.set_title(f"{NAMES[name]}: rank of the target (1 = top)", fontsize=10)
        ax.set_xticks(range(T - first))
        ax.set_xticklabels([f"{first + j} {visible_token(t, 8)}" for j, t in enumerate(tokens[first:])],
                           rotation=70, ha="right", fontsize=7)
        ax.set_xlabel("input position (token); each cell ranks the NEXT token")
    axes[0][0].set_yticks(range(rows), _layer_labels(rows))
    axes[0][0].set_ylabel("residual stream read")
    fig.colorbar(im, ax=axes[0].tolist(), label=f"rank among {V:,} tokens (log scale)")
    ids = set(target["ids"][first:])
    what = (f"target {visible_token(target['tokens'][-1], 16)!r} (id {target['ids'][-1]})" if len(ids) == 1
            else "target: " + target["what"])
    note = f", last {T - first} of {T} positions" if first else ""
    fig.suptitle(f"Trajectory of the {what} through the layers{note}", fontsize=11)
    return _save(fig, path)
