"""The figures of `sluice profile` and `sluice roofline`, one function per PNG (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .costs import COMPONENTS, LABELS  # noqa: E402

DPI = 110
COLORS = dict(zip(COMPONENTS, plt.get_cmap("tab10").colors, strict=True))


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _contexts(data: dict) -> list[str]:
    return [f"{r['context']:,}" for r in data["rows"]]


def shares(data: dict, path: Path) -> Path:
    """Stacked bars: each component's share of the measured step, one bar per context length."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = np.arange(len(data["rows"]))
    bottom = np.zeros(len(x))
    for k in COMPONENTS:
        v = np.array([max(r["components"][k]["share"], 0.0) * 100 for r in data["rows"]])
        ax.bar(x, v, bottom=bottom, color=COLORS[k], label=LABELS[k], width=0.6)
        bottom += v
    ax.set_xticks(x, _contexts(data))
    ax.set_xlabel("context length (tokens in the KV cache)")
    ax.set_ylabel("% of the decode step (sum of components)")
    ax.set_title(f"Decode step by component: {data['model']['architecture']}, {data['model']['dtype']}")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _save(fig, path)


def times(data: dict, path: Path) -> Path:
    """Milliseconds per component against context length (log-log)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ctx = [r["context"] for r in data["rows"]]
    for k in COMPONENTS:
        v = [r["components"][k]["ms"] for r in data["rows"]]
        ax.plot(ctx, [max(t, 1e-4) for t in v], marker="o", color=COLORS[k], label=LABELS[k])
    ax.plot(ctx, [r["step_ms"] for r in data["rows"]], "k--", marker="s", label="whole step (no hooks)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context length")
    ax.set_ylabel("ms per decode step")
    ax.set_title("Time per component (median)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _save(fig, path)


def traffic(data: dict, path: Path) -> Path:
    """Bytes one step reads (weights vs KV cache), and the achieved bandwidth against the peak."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(data["rows"]))
    kv = np.array([r["kv_cache_bytes"] for r in data["rows"]]) / 1e6
    weights = np.array([r["read_bytes"] for r in data["rows"]]) / 1e6 - kv
    a.bar(x, weights, color="#4c72b0", label="weights (+ logits)", width=0.6)
    a.bar(x, kv, bottom=weights, color=COLORS["attention"], label="KV cache", width=0.6)
    a.set_xticks(x, _contexts(data))
    a.set_xlabel("context length")
    a.set_ylabel("MB read per decode step")
    a.set_title("Bytes each step must read")
    a.legend(fontsize=8)
    peak = data["machine"]["stream_copy"]["GB_s"]
    b.plot(x, [r["achieved_GB_s"] for r in data["rows"]], marker="o", label="achieved (bytes read / step time)")
    b.axhline(peak, color="k", linestyle="--", label=f"stream copy peak {peak:.1f} GB/s")
    b.set_xticks(x, _contexts(data))
    b.set_ylim(0, peak * 1.15)
    b.set_xlabel("context length")
    b.set_ylabel("GB/s")
    b.set_title("Achieved memory bandwidth")
    b.legend(fontsize=8)
    return _save(fig, path)


def predicted(data: dict, path: Path) -> Path:
    """Measured ms per component next to the roofline prediction on this machine, longest context."""
    row = data["rows"][-1]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(COMPONENTS))
    ax.bar(x - 0.2, [row["components"][k]["ms"] for k in COMPONENTS], width=0.4, label="measured")
    ax.bar(x + 0.2, [row["predicted"]["components"][k]["ms"] for k in COMPONENTS], width=0.4,
           label="roofline bound (this machine)")
    ax.set_xticks(x, [LABELS[k] for k in COMPONENTS], rotation=30, ha="right")
    # log: the bounds are often 10-1000x below the measured times, invisible on a linear axis
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (log scale)")
    ax.set_title(f"Measured vs predicted at context {row['context']:,}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def roofline_bytes(data: dict, path: Path) -> Path:
    """Predicted MB read and GFLOPs per component (roofline)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    y = np.arange(len(COMPONENTS))
    names = [LABELS[k] for k in COMPONENTS]
    a.barh(y, [data["costs"][k]["read_bytes"] / 1e6 for k in COMPONENTS], color=[COLORS[k] for k in COMPONENTS])
    a.set_yticks(y, names)
    a.invert_yaxis()
    a.set_xlabel("MB read per step")
    b.barh(y, [data["costs"][k]["flops"] / 1e9 for k in COMPONENTS], color=[COLORS[k] for k in COMPONENTS])
    b.set_xlabel("GFLOP per step")
    fig.suptitle(f"{data['config']['architecture']}, batch {data['batch']}, context {data['context']:,}, "
                 f"{data['dtype']}")
    return _save(fig, path)


def roofline_chart(data: dict, path: Path) -> Path:
    """The roofline: attainable FLOP/s against arithmetic intensity, with this step's point."""
    hw, pred = data["hardware"], data["predicted"]
    bw, peak = hw["GB_s"] * 1e9, hw["GFLOP_s"] * 1e9
    ai = np.logspace(-1, 4, 200)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ai, np.minimum(ai * bw, peak) / 1e12, "k-", label=hw["label"])
    x = pred["arithmetic_intensity"]
    ax.plot([x], [min(x * bw, peak) / 1e12], "o", color="C3", markersize=9,
            label=f"decode step: {x:.2f} FLOP/byte")
    ax.axvline(peak / bw, color="grey", linestyle=":", label=f"ridge {peak / bw:.0f} FLOP/byte")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"Roofline, batch {data['batch']}: {pred['tokens_per_s']:,.1f} tokens/s bound ({pred['bound']})")
    ax.legend(fontsize=8)
    return _save(fig, path)


PROFILE_FIGURES = {"shares": shares, "times": times, "traffic": traffic, "predicted": predicted}
ROOFLINE_FIGURES = {"roofline_bytes": roofline_bytes, "roofline": roofline_chart}


def write_all(data: dict, out_dir: Path) -> dict[str, Path]:
    figs = PROFILE_FIGURES if data["kind"] == "profile" else ROOFLINE_FIGURES
    return {name: fn(data, Path(out_dir) / f"{name}.png") for name, fn in figs.items()}
