"""The --out DIR of `sluice profile` and `sluice roofline`: PNGs, the JSON, and one self-contained HTML
page (PNGs inlined as data: URIs, inline CSS, no scripts, no external links), like `sluice inspect`'s."""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path

from .analysis import to_json
from .profile_plots import write_all
from .profile_tables import (LEGEND, component_bytes_rows, legend, component_time_rows, profile_header, roofline_header,
                             roofline_rows, roofline_summary, summary_rows, collective_rows, tp_rows)
from .report import CSS, prepare_out_dir

PROFILE_HOW = (
    "One decode step of the engine (Runner.step, eager, batch 1) against a KV cache holding exactly the "
    "context length, then the sampler. Each component's time is measured with forward hooks registered from "
    "outside the model, one level of the module tree per pass (hooks are never nested), the passes "
    "interleaved round-robin; a parent's own work is its time minus its children's. 'attention' is RoPE, the "
    "KV-cache write and attention over every slot; 'other' is residual adds, RoPE tables, the mask and glue. "
    "The whole step is timed separately without hooks: the components must add up to it. Bytes read are what "
    "a step must stream from memory (every weight matrix, one embedding row, the whole KV cache); the "
    "achieved bandwidth is those bytes over the step time, against this machine's stream-copy rate. The "
    "roofline columns are `sluice roofline --hardware cpu-this-machine` for the same step.")
NATIVE_HOW = (
    "One decode step of the native step the engine runs (engine/fast_step.py over step.cpp, batch 1) against "
    "a KV cache holding exactly the context length, then the sampler. The step calls no module, so it times "
    "itself: its first thread adds the time since its last mark to a phase at each phase boundary (most are "
    "barriers: a phase's wall time). 'q/k/v proj' includes the qk-norms, RoPE and the KV-cache write; "
    "'attention' is attention over every slot; 'other' is the rest of the call (Python, checks, scratch), so "
    "the components add up to the step by construction. Bytes read and the roofline columns as for the torch "
    "path (`sluice profile --path torch`).")
ROOFLINE_HOW = (
    "Predicted from config.json alone: bytes every decode step must read and FLOPs it must do, by component, "
    "and the bound time = max(bytes / peak bandwidth, FLOPs / peak FLOP/s). A real step is slower: kernels "
    "reach a fraction of the peaks and a small model pays per-op overhead the roofline does not see.")


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f'<th class="l">{escape(h)}</th>' if j == 0 else f"<th>{escape(h)}</th>" for j, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="l">{escape(c)}</td>' if j == 0 else f"<td>{escape(c)}</td>"
                                    for j, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _img(path: Path, alt: str) -> str:
    b64 = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{b64}" alt="{escape(alt)}">'


def _page(title: str, sections: list[tuple[str, str]]) -> str:
    nav = "".join(f'<a href="#s{i}">{i + 1}. {escape(t)}</a><br>' for i, (t, _) in enumerate(sections[1:]))
    parts = [f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
             f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1>", sections[0][1], f"<nav>{nav}</nav>"]
    parts += [f'<section id="s{i}"><h2>{i + 1}. {escape(t)}</h2>{body}</section>'
              for i, (t, body) in enumerate(sections[1:])]
    parts.append('<p class="meta">Every number is in the JSON file next to this page.</p></body></html>')
    return "\n".join(parts)


def render_profile(d: dict, pngs: dict[str, Path]) -> str:
    native = d["settings"].get("path") == "native"
    how = NATIVE_HOW if native else PROFILE_HOW
    intro = f'<p class="meta">{escape(profile_header(d))}</p><p class="how">{escape(how)}</p>'
    intro += "".join(f'<p class="skipped">{escape(n)}</p>' for n in d["notes"])
    last = d["rows"][-1]
    sections = [("intro", intro),
                ("Summary per context length", _table(*summary_rows(d))),
                ("Share of the step by component", _img(pngs["shares"], "component shares")
                 + _table(*component_time_rows(d)) + f"<p>{escape(legend(d))}</p>"),
                ("Time per component", _img(pngs["times"], "time per component")),
                ("Bytes and bandwidth", _img(pngs["traffic"], "bytes read and bandwidth")
                 + f"<h3>Per component at context {last['context']:,}</h3>" + _table(*component_bytes_rows(last))),
                ("Measured against the roofline", _img(pngs["predicted"], "measured vs predicted")
                 + "<p>Measured tokens/s over the roofline bound, per context: "
                 + ", ".join(f"{r['context']:,}: {r['tokens_per_s'] / r['predicted']['tokens_per_s']:.0%}"
                             for r in d["rows"]) + ".</p>")]
    return _page(f"sluice profile: {d['model']['architecture']} ({d['model']['dtype']})", sections)


def render_roofline(d: dict, pngs: dict[str, Path]) -> str:
    intro = f'<p class="meta">{escape(roofline_header(d))}</p><p class="how">{escape(ROOFLINE_HOW)}</p>'
    intro += "".join(f'<p class="skipped">{escape(n)}</p>' for n in d["notes"])
    hw_rows = [[k, v["label"], f"{v['GB_s']:,.0f}", f"{v['TFLOP_s']['bfloat16']:,.1f}", f"{v['TFLOP_s']['float32']:,.1f}",
                v["source"]] for k, v in d["hardware_table"].items()]
    sections = [("intro", intro),
                ("Predicted cost by component", _table(*roofline_rows(d)) + f"<p>{escape(roofline_summary(d))}</p>"
                 + f"<p>{escape(LEGEND)}</p>"
                 + _img(pngs["roofline_bytes"], "bytes and FLOPs per component")),
                ("Roofline", _img(pngs["roofline"], "roofline chart"))]
    if "parallel" in d:  # one rank's step plus the collectives: the per-token latency under --tp
        sections.append(("Tensor parallel: per-token latency of one rank",
                         _table(*tp_rows(d)) + _table(*collective_rows(d))))
    sections += [("Hardware table", _table(["name", "part", "GB/s", "bf16 TFLOP/s (dense)", "fp32 TFLOP/s", "source"],
                                          hw_rows))]
    return _page(f"sluice roofline: {d['config']['architecture']} on {d['hardware']['name']}", sections)


def save(data: dict, out_dir) -> dict[str, Path]:
    """Write the PNGs, <kind>.json and <kind>.html into out_dir; return {name: path}."""
    out_dir = prepare_out_dir(out_dir)
    pngs = write_all(data, out_dir)
    kind = data["kind"]
    render = render_profile if kind == "profile" else render_roofline
    paths = dict(pngs)
    paths["html"] = out_dir / f"{kind}.html"
    paths["html"].write_text(render(data, pngs), encoding="utf-8")
    paths["json"] = out_dir / f"{kind}.json"
    paths["json"].write_text(to_json(data, indent=1), encoding="utf-8")
    return paths

