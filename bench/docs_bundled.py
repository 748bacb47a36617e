"""The `bundled.` numbers of docs/bundled-model.md's second-edition and draft sections
(bench/docs_numbers.py): the shape sweep and the test-data experiment
(bundled-model-2-experiments.json), both editions side by side (bundled-quality.json, written by
bench/bundled_quality.py), and the draft's agreement and speed (draft-agreement.json,
bundled-draft-2-agreement-before.json, bench-speculative-draft2.json), with the two cards."""

from __future__ import annotations

import json

from docs_prose import span
from docs_results import CARD, ROOT, heldout_curve, load

DRAFT_CARD = ROOT / "src" / "sluice" / "assets" / "sluice-stdlib-draft" / "training.json"
BUDGET_S = 2 * 3600  # the second edition's training budget, a choice (docs/bundled-model.md)


def shape_table(sweep: dict, kept_params: int) -> str:
    rows = ["| shape (hidden x layers, SwiGLU) | parameters | tokens/s | tokens in 2 hours |", "|---|---|---|---|"]
    for s in sweep.values():
        m, row = s["model"], s["row"]
        cells = [f"{m['hidden_size']} x {m['num_layers']}, {m['intermediate_size']}", f"{row['params'] / 1e6:.2f} M",
                 f"{row['tok_s']:,.0f}", f"{row['tok_s'] * BUDGET_S / 1e6:.1f} M"]
        if row["params"] == kept_params:
            cells = [f"**{cells[0]} (kept)**", *(f"**{c}**" for c in cells[1:])]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def speed_table(r: dict) -> str:
    """bench-speculative-draft2.json as one row per (set, temperature): plain tok/s, then each config's speedup."""
    cell = {(x["set"], x["temperature"], x["config"]): x for x in r["bundled"]}
    groups = [("draft:old", ("2", "4", "auto")), ("draft:new", ("2", "4", "auto")), ("prompt-lookup", ("4", "auto"))]
    rows = ["| set, temperature | plain | old draft k=2 / 4 / auto | new draft k=2 / 4 / auto | prompt lookup k=4 / auto |",
            "|---|---|---|---|---|"]
    for temp in (0.0, 0.8):
        for s in ("code", "edit"):
            best = max((cell[(s, temp, f"draft:new k={k}")]["speedup"], k) for k in ("2", "4", "auto"))
            parts = []
            for name, ks in groups:
                xs = []
                for k in ks:
                    x = f"{cell[(s, temp, f'{name} k={k}')]['speedup']:.2f}x"
                    xs.append(f"**{x}**" if name == "draft:new" and k == best[1] and best[0] > 1.25 else x)
                parts.append(" / ".join(xs))
            rows.append(f"| {s}, {temp:g} | {cell[(s, temp, 'plain')]['tok_s']:,.0f} | " + " | ".join(parts) + " |")
    return "\n".join(rows)


def met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def bundled_values() -> dict[str, str]:
    exp, q = load("bundled-model-2-experiments.json"), load("bundled-quality.json")
    card, draft = json.loads(CARD.read_text()), json.loads(DRAFT_CARD.read_text())
    new, old = q["models"]  # the second edition, then the first
    out = q["outside_set"]
    sweep = exp["shape_sweep"]
    smallest = min(sweep.values(), key=lambda s: s["row"]["params"])["row"]
    kept = next(s["row"] for s in sweep.values() if s["row"]["params"] == card["params"])
    t = exp["tests_data_experiment"]
    tests_bytes = t["tests"]["card"]["corpus"]["train_bytes"] - t["notests"]["card"]["corpus"]["train_bytes"]
    outside_target = out["xz-9e"] * 0.95  # the target: 5% below xz -9e on the same files
    curve = heldout_curve("bundled-model-log-2.jsonl")
    last = sorted(curve)[-3:]  # the last 400 steps: evaluations every 200
    after, before = load("draft-agreement.json"), load("bundled-draft-2-agreement-before.json")
    sp = load("bench-speculative-draft2.json")
    cell = {(x["set"], x["temperature"], x["config"]): x for x in sp["bundled"]}
    cost = sp["bundled_cost"]
    v = {
        "bundled.longer": f"{new['tokens_seen'] / old['tokens_seen']:.1f}x",
        "bundled.first.params": f"{old['params'] / 1e6:.1f} M", "bundled.first.tokens": f"{old['tokens_seen'] / 1e6:.1f} M",
        "bundled.first.minutes": f"{old['train_wall_seconds'] / 60:.0f} minutes",
        "bundled.shapes": shape_table(sweep, card["params"]),
        "bundled.smallest.tokens": f"{smallest['tok_s'] / kept['tok_s']:.2f}x",
        "bundled.tests.mb": f"{tests_bytes / 1e6:.1f} MB",
        "bundled.tests.epochs": f"{card['tokens_seen'] / t['tests']['card']['corpus']['train_tokens']:.1f}",
        "bundled.tests.tokens": f"{t['notests']['card']['tokens_seen'] / 1e6:.1f} M",
        "bundled.outside.files": str(out["files"]), "bundled.outside.bytes": f"{out['bytes']:,}",
        "bundled.outside.mb": f"{out['bytes'] / 1e6:.1f} MB",
        "bundled.outside.gzip": f"{out['gzip-9']:.3f}", "bundled.outside.xz": f"{out['xz-9e']:.3f}",
        "bundled.target.outside": f"{outside_target:.3f}",
        "bundled.met.heldout": met(new["heldout_bpb"] <= 1.35),
        "bundled.met.outside": met(new["outside_bpb"] <= outside_target),
        "bundled.met.parse": met(new["parse"]["parsed"] > old["parse"]["parsed"]),
        "bundled.outside.gain": f"{(1 - new['outside_bpb'] / old['outside_bpb']) * 100:.0f}%",
        "bundled.outside.gap": span([m["outside_bpb"] - m["heldout_bpb"] for m in (new, old)], "{:.2f}"),
        "bundled.outside.remaining": f"{(new['outside_bpb'] / outside_target - 1) * 100:.0f}%",
        "bundled.curve.from": f"{curve[last[0]]:.3f}", "bundled.curve.to": f"{curve[last[-1]]:.3f}",
        "bundled.tokenizer_s": f"{card['tokenizer_and_data_seconds']:.0f} s",
        "bundled.draft.ratio": f"{card['params'] / draft['params']:.1f}x",
        "bundled.draft.mb": f"{draft['params'] * 2 / 1e6:.2f} MB",
        "bundled.draft.minutes": f"{draft['train_wall_seconds'] / 60:.1f} minutes",
        "bundled.draft.tok_s": f"{draft['tokens_seen'] / draft['train_wall_seconds']:,.0f}",
        "bundled.draft.speed": speed_table(sp),
        "bundled.draft.commit": sp["code"]["commit"],
        "bundled.draft.step_ms": f"{cost['t_step_ms']:.2f} ms", "bundled.draft.draft_ms": f"{cost['t_draft_step_ms']:.2f} ms",
        "bundled.draft.verify": span([p["t_verify_ms"] / cost["t_step_ms"] for p in cost["per_k"]]),
        "bundled.draft.break_even2": f"{next(p for p in cost['per_k'] if p['k'] == 2)['break_even_acceptance']:.2f}",
        "bundled.draft.edit_k2": f"{cell[('edit', 0.0, 'draft:new k=2')]['speedup']:.1f}x",
        "bundled.draft.sampled": span([x["speedup"] for x in sp["bundled"]
                                        if x["temperature"] > 0 and x["config"].startswith("draft:new")], "{:.2f}") + "x",
    }
    for tag, m in (("new", new), ("old", old)):
        v[f"bundled.{tag}.heldout"] = f"{m['heldout_bpb']:.3f}"
        v[f"bundled.{tag}.outside"] = f"{m['outside_bpb']:.3f}"
        v[f"bundled.{tag}.vs_xz"] = f"{(m['outside_bpb'] / out['xz-9e'] - 1) * 100:+.1f}%"
        v[f"bundled.{tag}.parsed"] = str(m["parse"]["parsed"])
        v[f"bundled.{tag}.parsed_eot"] = str(m["parse_file_start"]["parsed"])
    for tag, run in (("notests", t["notests"]), ("tests", t["tests"])):
        v[f"bundled.tests.{tag}.heldout"] = f"{run['quality']['heldout_bpb']:.3f}"
        v[f"bundled.tests.{tag}.outside"] = f"{run['quality']['outside_bpb']:.3f}"
        v[f"bundled.tests.{tag}.parsed"] = str(run["quality"]["parsed"])
    for tag, a in (("before", before), ("after", after)):
        per = a["agreement_per_prompt"]
        tpf = a["tokens_per_target_forward"]
        v[f"bundled.agree.{tag}.bpb"] = f"{a['heldout_bpb']['draft']:.3f}"
        v[f"bundled.agree.{tag}"] = f"{a['greedy_agreement'] * 100:.1f}%"
        v[f"bundled.agree.{tag}.per_prompt"] = " / ".join(f"{per[k] * 100:.0f}%" for k in ("min", "median", "max"))
        v[f"bundled.agree.{tag}.tpf"] = " / ".join(f"{tpf[k]:.2f}" for k in ("2", "4", "8"))
    for key, (s, k) in {"code4": ("code", "4"), "edit2": ("edit", "2")}.items():
        v[f"bundled.draft.accept.{key}"] = " -> ".join(
            f"{cell[(s, 0.0, f'draft:{d} k={k}')]['acceptance_rate']:.3f}" for d in ("old", "new"))
    return v
