"""The numbers the prose of docs/profile.md, docs/speculative.md and docs/parallel.md reads off
their results files (bench/docs_numbers.py): ranges, ratios and single cells that the tables of
bench/docs_results.py do not show as such. Each function adds to the group of the same name."""

from __future__ import annotations

from docs_results import load, pct


def span(xs, fmt: str = "{:.1f}", sep: str = "-") -> str:
    """'a-b' of the smallest and largest value as shown; one value when both show alike."""
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def pspan(xs, digits: int = 0, signed: bool = False) -> str:
    """A range of shares as percentages: '15-17%', or '+65% to +130%' when signed."""
    lo, hi = (pct(x, signed, digits) for x in (min(xs), max(xs)))
    if lo == hi:
        return lo
    return f"{lo} to {hi}" if signed else f"{lo[:-1]}-{hi}"


# --- docs/profile.md -----------------------------------------------------------------------------

PROFILE_RUNS = {"bundled": [("profile-bundled.json", None)], "qwen3": [("profile-qwen3.json", None)],
                # the first Llama run, its 8,192 row redone alone (docs_results.profile_values)
                "llama": [("profile-llama.json", lambda c: c != 8192), ("profile-llama-8k.json", lambda c: c == 8192)]}


def profile_rows() -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for model, runs in PROFILE_RUNS.items():
        for name, keep in runs:
            for r in load(name)["rows"]:
                if keep is None or keep(r["context"]):
                    out.setdefault(model, {})[r["context"]] = r
    return out


def profile_prose() -> dict[str, str]:
    rows = profile_rows()
    v: dict[str, str] = {}
    for model, by_ctx in rows.items():
        for c, r in by_ctx.items():
            p = f"profile.{model}.{c}"
            v[f"{p}.lm"] = pct(r["lm_head_softmax_share"])
            v[f"{p}.kv_time"] = pct(r["kv_time_share"], digits=0)
            v[f"{p}.kv_bytes"] = pct(r["kv_bytes_share"])
            v[f"{p}.step_ms"] = f"{r['step_ms']:,.1f}"
            v[f"{p}.step_ms0"] = f"{r['step_ms']:,.0f}"
            v[f"{p}.pred_ms"] = f"{r['predicted']['step_ms']:,.0f}"
            v[f"{p}.gbs"] = f"{r['achieved_GB_s']:.1f}"
            v[f"{p}.peak"] = pct(r["fraction_of_peak_bandwidth"], digits=0)
            v[f"{p}.mb"] = f"{r['read_bytes'] / 1e6:,.0f}"
        v[f"profile.{model}.lm_range"] = pspan([r["lm_head_softmax_share"] for r in by_ctx.values()])
    big = [r for m in ("qwen3", "llama") for r in rows[m].values()]
    short = [r for r in big if r["context"] <= 1024]
    long = [r for r in big if r["context"] >= 4096]
    machines = [load(n)["machine"] for n in ("profile-bundled.json", "profile-qwen3.json", "profile-llama.json",
                                             "profile-llama-8k.json")]
    llama_first = {r["context"]: r for r in load("profile-llama.json")["rows"]}[8192]
    bf16 = load("profile-llama.json")["machine"]["matmul"]["shapes"]
    v.update({
        "profile.sampling.share": pspan([r["components"]["sampling"]["share"] for r in big], 1),
        "profile.qwen3.sampling_ms": span([r["components"]["sampling"]["ms"] for r in rows["qwen3"].values()], "{:.0f}"),
        "profile.llama.sampling_ms": span([r["components"]["sampling"]["ms"] for r in rows["llama"].values()], "{:.0f}"),
        "profile.llama.kv_time_long": pspan([r["kv_time_share"] for r in rows["llama"].values() if r["context"] >= 4096]),
        "profile.attention_gbs": span([r["components"]["attention"]["GB_s"] for r in big]),
        "profile.short_gbs": span([r["achieved_GB_s"] for r in big if r["context"] == 128], "{:.0f}"),
        "profile.short_peak": pspan([r["fraction_of_peak_bandwidth"] for r in big if r["context"] == 128]),
        "profile.copy_gbs": span([m["stream_copy"]["GB_s"] for m in machines]),
        "profile.copy_gbs0": span([m["stream_copy"]["GB_s"] for m in machines], "{:.0f}"),
        "profile.fp32_gflops": span([m["matmul"]["GFLOP_s"] for m in machines[:2]], "{:.0f}"),
        "profile.bf16_gflops": span([m["matmul"]["GFLOP_s"] for m in machines[2:]], "{:.0f}"),
        "profile.bf16_gemv": f"{bf16[0]['GFLOP_s']:.0f}", "profile.bf16_gemm": f"{bf16[3]['GFLOP_s']:.0f}",
        "profile.err.short": pspan([r["prediction_error"] for r in short], signed=True),
        "profile.err.long": pspan([r["prediction_error"] for r in long], signed=True),
        "profile.err.bundled": span([1 + r["prediction_error"] for r in rows["bundled"].values()], "{:.0f}") + "x",
        "profile.reached": pspan([1 / (1 + r["prediction_error"]) for r in big]),
        "profile.llama.128.pred_s": f"{rows['llama'][128]['predicted']['step_ms'] / 1e3:.1f} s",
        "profile.llama.first8k.sum": pct(llama_first["sum_vs_step"], True, 0),
        "profile.llama.first8k.other": f"{llama_first['components']['other']['ms'] / 1e3:.0f} s",
        "profile.llama.8k.sum": pct(rows["llama"][8192]["sum_vs_step"], True),
    })
    return v


# --- docs/speculative.md, "Where it helps" -------------------------------------------------------

def spec_prose() -> dict[str, str]:
    r = load("bench-speculative.json")
    rows = r["bundled"]
    cell = {(x["set"], x["temperature"], x["config"]): x for x in rows}
    greedy_draft = [x for x in rows if x["temperature"] == 0 and x["config"].startswith("draft")]
    sampled = [x for x in rows if x["temperature"] > 0 and x["config"] != "plain"]
    cost = r["bundled_cost"]
    k = {p["k"]: p for p in cost["per_k"]}
    t_step = cost["t_step_ms"]
    d2 = cell[("code", 0.0, "draft k=2")]
    round_ms = d2["tokens_per_forward"] / d2["tok_s"] * 1e3
    plain_ms = 1e3 / cell[("code", 0.0, "plain")]["tok_s"]
    overhead = round_ms - k[2]["t_round_draft_ms"]
    slower = [cell[(s, 0.0, "plain")]["tok_s"] / cell[(s, 0.8, "plain")]["tok_s"] for s in ("code", "edit")]
    draw = [1e3 / cell[(s, 0.8, "plain")]["tok_s"] - 1e3 / cell[(s, 0.0, "plain")]["tok_s"] for s in ("code", "edit")]
    v = {
        "spec.draft.acceptance": pspan([x["acceptance_rate"] for x in greedy_draft]),
        "spec.draft.tpf": span([x["tokens_per_forward"] for x in greedy_draft]),
        "spec.draft.speedup": span([x["speedup"] for x in greedy_draft], "{:.2f}") + "x",
        "spec.t_step": f"{t_step:.1f} ms",
        "spec.verify_ratio": span([p["t_verify_ms"] / t_step for p in k.values()]) + "x",
        "spec.break_even.2": f"{k[2]['break_even_acceptance']:.2f}",
        "spec.break_even.4_8": span([k[4]["break_even_acceptance"], k[8]["break_even_acceptance"]], "{:.2f}"),
        "spec.d2.tpf": f"{d2['tokens_per_forward']:.2f}", "spec.d2.tok_s": f"{d2['tok_s']:.1f}",
        "spec.d2.round_ms": f"{round_ms:.1f}", "spec.d2.forwards_ms": f"{k[2]['t_round_draft_ms']:.1f}",
        "spec.d2.overhead_ms": f"{overhead:.1f}", "spec.plain.overhead_ms": f"{plain_ms - t_step:.1f}",
        "spec.plain.ms": f"{plain_ms:.2f}", "spec.t_step2": f"{t_step:.2f}",
        "spec.overhead_steps": f"{overhead / t_step:.1f}",
        "spec.sampled.slower": span(slower) + "x", "spec.sampled.draw_ms": span(draw),
        "spec.sampled.lookup_acceptance": pspan([x["acceptance_rate"] for x in sampled
                                                 if x["config"].startswith("prompt-lookup")]),
        "spec.sampled.speedup": span([x["speedup"] for x in sampled], "{:.2f}") + "x",
    }
    for dtype, tag in (("float32", "f32"), ("bfloat16", "bf16")):
        q = r["q06"][dtype]
        c, qk = q["cost"], {p["k"]: p for p in q["cost"]["per_k"]}
        qrow = {x["config"]: x for x in q["rows"]}
        v.update({f"spec.q06.{tag}.t_step": f"{c['t_step_ms']:.0f} ms",
                  f"spec.q06.{tag}.draft_share": pct(c["t_draft_step_ms"] / c["t_step_ms"], digits=0)})
        for n in (2, 4):
            v[f"spec.q06.{tag}.verify{n}"] = f"{qk[n]['t_verify_ms'] / c['t_step_ms']:.2f}x"
            v[f"spec.q06.{tag}.k{n}.measured"] = f"{qrow[f'draft k={n}']['speedup']:.2f}x"
            v[f"spec.q06.{tag}.k{n}.predicted"] = f"{qk[n]['speedup_at_a0']:.2f}x"
            v[f"spec.q06.{tag}.k{n}.break_even"] = f"{qk[n]['break_even_acceptance']:.2f}"
    f32 = r["q06"]["float32"]["cost"]
    f32k = {p["k"]: p for p in f32["per_k"]}
    steps = f32k[2]["t_round_draft_ms"] / f32["t_step_ms"]
    tokens = 1 + 0.7 + 0.7 ** 2  # what a draft keeping 70% at k=2 yields per round: arithmetic, not a measurement
    v["spec.q06.example.steps"] = f"{steps:.2f}"
    v["spec.q06.example.speedup"] = f"{tokens / steps:.1f}x"
    v["spec.q06.verify5"] = span([r["q06"][d]["cost"]["per_k"][1]["t_verify_ms"] / r["q06"][d]["cost"]["t_step_ms"]
                                  for d in ("float32", "bfloat16")]) + "x"
    first = r["q06_first_run_disturbed"]
    a, b = first["float32"]["cost"]["per_k"][1]["t_verify_ms"], f32k[4]["t_verify_ms"]
    v.update({"spec.q06.first.bf16_step": f"{first['bfloat16']['cost']['t_step_ms']:.0f} ms",
              "spec.q06.first.verify4": f"{a:.0f}", "spec.q06.verify4": f"{b:.0f}",
              "spec.q06.verify4.moved": f"{abs(b / a - 1) * 100:.0f}%"})
    return v


# --- docs/parallel.md, "Measured here" -----------------------------------------------------------

def tp_prose() -> dict[str, str]:
    r = load("bench-tp-allreduce.json")
    cs = r["collectives"]
    two, four = [c for c in cs if c["world"] == 2], [c for c in cs if c["world"] == 4]
    small2 = [c for c in two if c["all_reduce_bytes"] <= 8192]
    err = (lambda group: max(abs(c["us_per_token_from_parts"] / c["us_per_token"] - 1) for c in group))
    b1 = {key: d for key, d in r["decode"].items()}["batch_1"]
    tp2_ms = 1e3 / max(x["decode_tok_s"] for x in b1["tp2_1_thread_per_rank"])
    one_ms = 1e3 / max(x["decode_tok_s"] for x in b1["single_process_kernels_false_2_threads"])
    bundled2 = [c for c in two if c["shape"] == "bundled"]
    return {
        "tp.ar2.small_ms": span([c["us_per_all_reduce"] / 1e3 for c in small2], "{:.2f}") + " ms",
        "tp.ar2.large_ms": span([c["us_per_all_reduce"] / 1e3 for c in two if c["all_reduce_bytes"] > 8192]) + " ms",
        "tp.tok2.bundled_ms": span([c["us_per_token"] / 1e3 for c in bundled2], "{:.0f}") + " ms",
        "tp.tok2.q06_b1_ms": f"{next(c for c in two if c['shape'] != 'bundled' and c['batch'] == 1)['us_per_token'] / 1e3:.0f} ms",
        "tp.parts.err2": pct(err(two), digits=0), "tp.parts.err4": pct(err(four), digits=0),
        "tp.ar4_ms": span([c["us_per_all_reduce"] / 1e3 for c in four], "{:.0f}") + " ms",
        "tp.tok4.bundled_ms": span([c["us_per_token"] / 1e3 for c in four if c["shape"] == "bundled"], "{:.0f}") + " ms",
        "tp.tok4.q06_s": span([c["us_per_token"] / 1e6 for c in four if c["shape"] != "bundled"]) + " s",
        "tp.sampler2_ms": span([c["us_sampler_collectives"] / 1e3 for c in two]) + " ms",
        "tp.sampler4_ms": span([c["us_sampler_collectives"] / 1e3 for c in four], "{:.0f}") + " ms",
        "tp.decode.tp2_ms": f"{tp2_ms:.1f} ms", "tp.decode.one_ms": f"{one_ms:.1f} ms",
        "tp.decode.collectives_ms": f"{bundled2[0]['us_per_token'] / 1e3:.0f} ms",
    }


# --- docs/quantization.md, the kernels' table (bench/quant.py) ------------------------------------

QUANT_COLUMNS = [("linear float32", "linear fp32"), ("int8 float32", "int8, fp32 act"),
                 ("int4 g32 float32", "int4 g32, fp32 act"), ("linear bfloat16", "linear bf16"),
                 ("int8 bfloat16", "int8, bf16 act"), ("int4 g32 bfloat16", "int4 g32, bf16 act"),
                 ("int4 g128 bfloat16", "int4 g128, bf16 act")]
QUANT_ROWS = {(3072, 1024): "gate/up", (1024, 3072): "down", (151936, 1024): "LM head"}


def quant_values() -> dict[str, str]:
    rows = load("bench-quant.json")["kernels_ms"]
    table = ["| N x K | " + " | ".join(t for _, t in QUANT_COLUMNS) + " |", "|---" * (len(QUANT_COLUMNS) + 1) + "|"]
    for r in rows:
        name = QUANT_ROWS.get((r["N"], r["K"]), "")
        cells = [f"{r[k]:.1f}" if r[k] >= 10 else f"{r[k]:.2f}" for k, _ in QUANT_COLUMNS]
        table.append(f"| {r['N']} x {r['K']}" + (f" ({name})" if name else "") + " | " + " | ".join(cells) + " |")
    gbs = (lambda key, bytes_per_weight: span([r["N"] * r["K"] * bytes_per_weight / r[key] / 1e6 for r in rows], "{:.0f}"))
    return {"quant.kernels": "\n".join(table),
            "quant.fp32_slower": span([r[k] / r["linear float32"] for r in rows for k in ("int8 float32", "int4 g32 float32")],
                                      "{:.0f}") + "x",
            "quant.int8_gbs": gbs("int8 bfloat16", 1), "quant.int4_gbs": gbs("int4 g32 bfloat16", 0.5),
            "quant.bf16_gbs": gbs("linear bfloat16", 2)}
