"""The terminal side of `sluice profile` and `sluice roofline`: rows of numbers, drawn as rich tables.

The row builders return plain strings, so the HTML page (profile_report.py) shows the same cells.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .costs import COMPONENTS, LABELS

LEGEND = ("norms: every norm in the blocks (input, post, q/k); attention (KV): RoPE, the KV-cache write and "
          "attention over every cache slot; softmax+sampling: the sampler over the fp32 logits; other: residual "
          "adds, RoPE tables, the mask, glue between modules.")
NATIVE_LEGEND = ("norms: every norm (input, post, final); q/k/v proj: with the q/k norms, RoPE and the KV-cache "
                 "write; attention (KV): attention over every cache slot; other: the rest of the native call "
                 "(Python, argument checks, scratch). Phases are timed by the step's first thread, so on a busy "
                 "machine a wait for the other threads may land in a neighbouring phase.")


def legend(d: dict) -> str:
    return NATIVE_LEGEND if d["settings"].get("path") == "native" else LEGEND


def ms(x: float) -> str:
    return f"{x:.4g}"


def us(milliseconds: float) -> str:
    return f"{milliseconds * 1e3:,.2f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def mb(x: float) -> str:
    return f"{x / 1e6:,.2f}"


def _path(d: dict) -> str:
    return "the native step" if d["settings"].get("path") == "native" else "eager torch modules"


def profile_header(d: dict) -> str:
    m, hw = d["model"], d["machine"]
    return (f"{m['name']}: {m['architecture']}, {m['num_params'] / 1e6:,.1f}M parameters "
            f"({m['param_bytes'] / 1e6:,.1f} MB in {m['dtype']}), {m['num_layers']} layers, vocab "
            f"{m['vocab_size']:,}; KV cache {m['kv_bytes_per_token'] / 1e3:,.1f} kB/token"
            f"{' in ' + m['kv_cache_dtype'] if 'kv_cache_dtype' in m else ''}. Batch 1, {_path(d)}, "
            f"{d['settings']['threads']} threads, median of {d['settings']['reps']} rounds, 1-min load average "
            f"{d['settings']['loadavg_at_start']:.2f} at the start. This machine: "
            f"stream copy {hw['stream_copy']['GB_s']:.1f} GB/s, matmul {hw['matmul']['GFLOP_s']:.1f} GFLOP/s "
            f"({m['dtype']}).")


def summary_rows(d: dict) -> tuple[list[str], list[list[str]]]:
    head = ["context", "step ms", "tokens/s", "components sum vs step", "MB read (KV)", "achieved GB/s",
            "of peak", "LM head + softmax", "KV attention (time)", "KV cache (bytes)", "roofline tok/s",
            "measured / bound", "CPU shared?"]
    rows = [[f"{r['context']:,}", f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.1f}", f"{100 * r['sum_vs_step']:+.1f}%",
             f"{mb(r['read_bytes'])} ({mb(r['kv_cache_bytes'])})", f"{r['achieved_GB_s']:.2f}",
             pct(r["fraction_of_peak_bandwidth"]), pct(r["lm_head_softmax_share"]), pct(r["kv_time_share"]),
             pct(r["kv_bytes_share"]), f"{r['predicted']['tokens_per_s']:,.1f}",
             pct(r["tokens_per_s"] / r["predicted"]["tokens_per_s"]),
             # marked where other work disturbed the round even after a repeat (notes: why)
             "DISTURBED" if r.get("disturbed") else "no"] for r in d["rows"]]
    return head, rows


def component_time_rows(d: dict) -> tuple[list[str], list[list[str]]]:
    head = ["component"] + [f"ctx {r['context']:,}" for r in d["rows"]]
    rows = [[LABELS[k]] + [f"{ms(r['components'][k]['ms'])} ({pct(r['components'][k]['share'])})" for r in d["rows"]]
            for k in COMPONENTS]
    rows.append(["sum of components"] + [f"{r['components_sum_ms']:.3f}" for r in d["rows"]])
    whole = "whole step, no hooks" if d["settings"].get("path") != "native" else "whole step (the same calls)"
    rows.append([whole] + [f"{r['step_ms']:.3f}" for r in d["rows"]])
    return head, rows


def component_bytes_rows(r: dict) -> tuple[list[str], list[list[str]]]:
    head = ["component", "MB read", "GFLOP", "measured ms", "achieved GB/s", "roofline ms", "bound"]
    rows = []
    for k in COMPONENTS:
        c, p = r["components"][k], r["predicted"]["components"][k]
        rows.append([LABELS[k], mb(c["read_bytes"]), f"{c['flops'] / 1e9:.4g}", ms(c["ms"]),
                     "-" if c["GB_s"] is None else f"{c['GB_s']:.2f}", ms(p["ms"]), p["bound"]])
    return head, rows


def roofline_header(d: dict) -> str:
    c, hw = d["config"], d["hardware"]
    return (f"{c['architecture']}: {c['num_params'] / 1e6:,.1f}M parameters, {c['num_layers']} layers, hidden "
            f"{c['hidden_size']}, {c['num_heads']} query / {c['num_kv_heads']} KV heads of {c['head_dim']}, vocab "
            f"{c['vocab_size']:,}{', tied embeddings' if c['tie_word_embeddings'] else ''}. Batch {d['batch']}, "
            f"context {d['context']:,}, {d['dtype']}. Hardware: {hw['label']}, {hw['GB_s']:,.1f} GB/s, "
            f"{hw['GFLOP_s'] / 1e3:,.2f} TFLOP/s ({hw['source']}).{tp_header(d)}")


def tp_header(d: dict) -> str:
    if "parallel" not in d:
        return ""
    t, link = d["parallel"], d["parallel"]["interconnect"]
    return (f" Tensor parallel over {t['tp']} ranks: the tables are ONE rank's step. Interconnect: {link['label']}, "
            f"{link['GB_s']:,.1f} GB/s per direction, {link['step_us']:g} us per ring step + {link['overhead_us']:g} "
            f"us per collective ({link['source']}).")


def tp_rows(d: dict) -> tuple[list[str], list[list[str]]]:
    """The per-token latency of one rank: reads, compute and communication, each in us."""
    p = d["parallel"]["per_token"]
    head = ["part", "MB (per rank)", "us", "share of step"]
    share = lambda x: pct(x / p["step_ms"]) if p["step_ms"] else "-"  # noqa: E731
    rows = [["weights read", mb(p["weights_bytes"]), us(p["weights_ms"]), share(p["weights_ms"])],
            ["KV cache read", mb(p["kv_bytes"]), us(p["kv_ms"]), share(p["kv_ms"])],
            ["logits read (sampler)", mb(p["logits_bytes"]), us(p["logits_ms"]), share(p["logits_ms"])],
            ["compute (its own roof)", f"{p['flops'] / 1e9:.4g} GFLOP", us(p["compute_ms"]), share(p["compute_ms"])],
            [f"max(memory, compute): {p['bound']}-bound", "-", us(max(p["memory_ms"], p["compute_ms"])),
             share(max(p["memory_ms"], p["compute_ms"]))],
            [f"communication: {p['collectives']} collectives", mb(p["communication_bytes"]),
             us(p["communication_ms"]), share(p["communication_ms"])],
            ["per-token step", "-", us(p["step_ms"]), "100.0%"]]
    return head, rows


def collective_rows(d: dict) -> tuple[list[str], list[list[str]]]:
    head = ["collective", "count", "bytes each", "ring steps", "bytes sent per rank", "us each", "us total"]
    rows = [[c["what"], str(c["count"]), f"{c['bytes']:,}", str(c["steps"]), f"{c['sent_bytes']:,.0f}",
             f"{c['us_each']:.2f}", f"{c['us']:,.1f}"] for c in d["parallel"]["collectives"]]
    return head, rows


def roofline_rows(d: dict) -> tuple[list[str], list[list[str]]]:
    head = ["component", "param MB", "MB read", "GFLOP", "FLOP/byte", "bound us", "share", "roof"]
    rows = []
    for k in COMPONENTS:
        c, p = d["costs"][k], d["predicted"]["components"][k]
        ai = f"{c['flops'] / c['read_bytes']:.2f}" if c["read_bytes"] else "-"
        rows.append([LABELS[k], mb(c["param_bytes"]), mb(c["read_bytes"]), f"{c['flops'] / 1e9:.4g}", ai,
                     us(p["ms"]), pct(p["share"]), p["bound"]])
    t, p = d["totals"], d["predicted"]
    rows.append(["total", mb(t["param_bytes"]), mb(t["read_bytes"]), f"{t['flops'] / 1e9:.4g}",
                 f"{p['arithmetic_intensity']:.2f}", us(p["step_ms"]), "100.0%", p["bound"]])
    return head, rows


def roofline_summary(d: dict) -> str:
    p = d["predicted"]
    return (f"{'One rank, without communication: b' if 'parallel' in d else 'B'}ound: {p['tokens_per_s']:,.1f} tokens/s = min(bandwidth bound {p['bandwidth_bound_tokens_per_s']:,.1f}, "
            f"compute bound {p['compute_bound_tokens_per_s']:,.1f}); {p['bound']}-bound. Each component under its "
            f"own roof: {p['component_tokens_per_s']:,.1f} tokens/s. KV cache {pct(d['kv_bytes_share'])} of the bytes "
            f"read, LM head + logits {pct(d['lm_head_softmax_bytes_share'])}.{tp_summary(d)}")


def tp_summary(d: dict) -> str:
    if "parallel" not in d:
        return ""
    t = d["parallel"]
    p = t["per_token"]
    return (f" With the collectives over {t['tp']} ranks ({t['interconnect']['name']}): {p['step_ms'] * 1e3:,.1f} us "
            f"per token = {max(p['memory_ms'], p['compute_ms']) * 1e3:,.1f} us {p['bound']} + "
            f"{p['communication_ms'] * 1e3:,.1f} us communication ({pct(p['communication_share'])}), "
            f"{t['tokens_per_s']:,.1f} tokens/s; one GPU: {t['single_gpu_step_ms'] * 1e3:,.1f} us, so "
            f"{t['speedup_vs_one_gpu']:.2f}x faster on {t['tp']}. Each rank holds "
            f"{t['rank_resident_bytes'] / 1e9:,.2f} GB of weights + KV cache.")


def _table(title: str, head: list[str], rows: list[list[str]]) -> Table:
    t = Table(title=escape(title), title_justify="left")
    for i, h in enumerate(head):
        t.add_column(escape(h), justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*(escape(c) for c in r))
    return t


def _console() -> Console:
    # piped into a file or a doc, the tables keep their columns instead of wrapping at 80
    return Console(width=None if sys.stdout.isatty() else 150)


def print_profile(d: dict, console: Console | None = None) -> None:
    con = console or _console()
    con.print(escape(profile_header(d)), highlight=False)
    for note in d["notes"]:
        con.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
    con.print(_table("decode step at each context length", *summary_rows(d)))
    con.print(_table("ms per component (share of the sum of components)", *component_time_rows(d)))
    last = d["rows"][-1]
    con.print(_table(f"bytes, FLOPs and bandwidth per component at context {last['context']:,}",
                     *component_bytes_rows(last)))
    con.print(escape(legend(d)), highlight=False)


def print_roofline(d: dict, console: Console | None = None) -> None:
    con = console or _console()
    con.print(escape(roofline_header(d)), highlight=False)
    for note in d["notes"]:
        con.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
    rank = " on one rank" if "parallel" in d else ""
    con.print(_table(f"predicted cost of one decode step{rank}", *roofline_rows(d)))
    if "parallel" in d:
        con.print(_table("collectives of one decode step (ring model)", *collective_rows(d)))
        con.print(_table("per-token latency of one rank", *tp_rows(d)))
    con.print(escape(roofline_summary(d)), highlight=False)
    con.print(escape(LEGEND), highlight=False)
