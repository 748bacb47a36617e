"""The results-file values of bench/docs_numbers.py: one function per benchmark, each a dict of
name -> the text a doc shows. The tables come from the benchmark scripts' own renderers where they
have one (serve_load.markdown, speculative.markdown), so a doc shows what the script prints."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def commas(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


@cache
def commit_date(commit: str) -> str:
    """The day a commit was made, from git; the commit alone where git does not know it."""
    out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%cs", commit],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else commit


# --- sluice bench (bench/speed.py, bench/batch_decode.py): the newest result per machine kind and setting

NARROWED = "; AVX2 builds (sluice and llama.cpp built as for an AVX2-only CPU)"  # a machine kind's suffix


def machine_kind(cpu: dict, threads: int | None = None, isa_env: dict | None = None) -> str:
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if cpu.get(f)] or ["no AVX2"]
    n = cpu.get("logical_cpus") or cpu.get("cores")
    # a run whose kernels were built below the CPU's instruction sets (sluice's AVX2 build on an AVX-512 CPU) is a
    # machine kind of its own: its rows must not stand for what this CPU does with its own builds
    narrowed = "-mno-avx512f" in (isa_env or {}).get("SLUICE_KERNEL_FLAGS", "").split()
    # the family and model numbers where the file has them (since 2026-12-04): the Zen 4 and Zen 5 EPYCs have the
    # same model name and the same flags here, and must not stand for each other
    generation = f" (family {cpu['family']} model {cpu['model_number']})" if "family" in cpu else ""
    return (f"{cpu.get('model', '?')}{generation}, {n} logical CPUs, {' '.join(flags)}"
            + (f"; torch {threads} thread{'s' if threads > 1 else ''}" if threads else "")
            + (NARROWED if narrowed else ""))


# (layers, hidden, vocabulary) of the random checkpoints bench/random_checkpoint.py builds -> (name, key)
SHAPES = {(28, 1024, 151936): ("Qwen3-0.6B shape", "q06"), (32, 4096, 128256): ("Llama-3-8B shape", "llama3-8b")}


def model_name(m: dict) -> tuple[str, str]:
    """A results file's model as the table names it, and as a docs-number key names it."""
    if m["dir"].endswith("sluice-stdlib"):
        return "bundled", "bundled"
    name, key = SHAPES.get((m.get("layers"), m.get("hidden"), m.get("vocab")), ("random checkpoint", "other"))
    return f"{name} ({m['params_read_per_token'] / 1e6:,.0f} M)", key


def speed_setting(r: dict) -> str:
    s = r["settings"]
    model = model_name(r["model"])[0]
    weights = s["quantize"] or {"float32": "fp32", "bfloat16": "bf16"}.get(s["dtype"], s["dtype"])
    # the bf16-weight products (mixed.BF16_DOT): the dot mode, and the fp32 ones where the CPU could run the dot
    # (files from before the setting existed ran them too)
    fp32_products = s["dtype"] == "bfloat16" and not s["quantize"] and r["cpu"].get("avx512_bf16")
    dot = ", bf16 dot" if s.get("bf16_dot") == "bf16" else ", fp32 products" if fp32_products else ""
    return (model + ", " + weights + dot
            + (", --compile" if s.get("compile") else "") + (", bf16 KV" if s.get("kv_cache_dtype") == "bfloat16" else ""))


def _newest(found: dict, key: str, r: dict) -> None:
    """Keep r under key if it is newer than what is there, an undisturbed run always before a
    disturbed one (files from before the flag existed count as undisturbed: they cannot say)."""
    old = found.get(key)
    if old is None or (bool(r.get("disturbed")), old["date"]) < (bool(old.get("disturbed")), r["date"]):
        found[key] = r


@cache
def speed_current() -> dict[str, dict[str, dict]]:
    """machine kind -> setting -> the newest bench-speed-*.json (batch 1) or bench-batch-*.json
    (bench/batch_decode.py, its setting marked ", batched") result for it."""
    best: dict[str, dict[str, dict]] = {}
    for pattern, suffix in (("bench-speed-*.json", ""), ("bench-batch-*.json", ", batched")):
        for path in sorted(RESULTS.glob(pattern)):
            r = json.loads(path.read_text())
            r["file"] = path.name
            # one row set per prompt length too: a pp512 run does not hide the tg128-after-128 one
            prompt = f"|{r['settings'].get('prompt')}" if not suffix else ""
            _newest(best.setdefault(machine_kind(r["cpu"], r["torch_threads"], r.get("isa_env")), {}), speed_setting(r) + suffix + prompt, r)
    return best


def _table_rows(key: str, r: dict) -> list[tuple[str, str, dict]]:
    """(setting, test, {engine: tok/s}) of one results file: pp and tg of a speed run (tg first),
    tg at each batch size of a batch run."""
    if r.get("benchmark") == "batch_decode":
        setting = key.removesuffix(", batched")
        by = {}
        for row in r["rows"]:
            by.setdefault(f"{row['test']}, batch {row['batch']}", {})[row["engine"]] = row["tok_s"]["mean"]
        return [(setting, test, v) for test, v in sorted(by.items(), key=lambda kv: int(kv[0].rsplit(" ", 1)[1]))]
    by = {}
    for row in r["rows"]:
        by.setdefault(row["test"], {})[row["engine"]] = row["tok_s"]["mean"]
    return [(key.split("|")[0], t, by[t]) for t in sorted(by, key=lambda t: t.startswith("pp"))]


def speed_table() -> str:
    out = []
    for kind, settings in sorted(speed_current().items()):
        out += ["", f"**{kind}**", "",
                "| model, weights | test | sluice tok/s | llama.cpp | transformers | sluice / llama.cpp | measured | results file |",
                "|---|---|---:|---:|---:|---:|---|---|"]
        for key, r in sorted(settings.items()):
            mark = ", **disturbed**" if r.get("disturbed") else ""
            for setting, test, v in _table_rows(key, r):
                sl, lc, tf = (v.get(e) for e in ("sluice", "llama.cpp", "transformers"))
                # two decimals below 10 tok/s, where one would round 1.12 and 0.95 alike
                cell = (lambda x: commas(x, 1 if x >= 10 else 2) if x is not None else "")
                ratio = f"{sl / lc:.2f}x" if sl and lc else ""
                out.append(f"| {setting} | {test} | {cell(sl)} | {cell(lc)} | {cell(tf)} | {ratio} | "
                           f"{r['date'][:10]}, {r['code']['commit']}{mark} | [{r['file']}](results/{r['file']}) |")
    return "\n".join(out[1:])


def speed_values() -> dict[str, str]:
    v = {"speed.table": speed_table(), "speed.files": str(len(list(RESULTS.glob("bench-speed-*.json"))))}
    for kind, settings in speed_current().items():
        tag = "avx512" if "avx512f" in kind else "avx2"
        if kind.endswith(NARROWED):
            continue  # (the table shows it; prose numbers come from each CPU's own builds)
        for key, r in settings.items():
            if r.get("benchmark") == "batch_decode":
                continue  # in the table only
            model = model_name(r["model"])[1]
            w = (key.split("|")[0].split(", ")[1] + ("-dot" if ", bf16 dot" in key else "")
                 + ("-compile" if "--compile" in key else "") + ("-kv16" if ", bf16 KV" in key else ""))
            for row in r["rows"]:
                if row["engine"] == "sluice":
                    v[f"speed.{tag}.{model}.{w}.{row['test'][:2]}"] = commas(row["tok_s"]["mean"])
    return v


# --- the load test of sluice serve (bench/serve_load.py) --------------------------------------------

SERVE_FILES = ("serve-load.json", "serve-load-full.json")


def serve_values() -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "bench"))
    from serve_load import markdown  # the script's own table, so the doc shows what it prints
    v, tables = {}, []
    for name in SERVE_FILES:
        r = load(name)
        env = r["env"]
        cpu = {"model": env["cpu"]["model"], "cores": env["cpu"]["cores"], **{f: True for f in env["cpu"]["flags"]}}
        tag = "avx512" if "avx512f" in env["cpu"]["flags"] else "avx2"
        tables.append(f"**{machine_kind(cpu)}**: commit {env['commit']} ({commit_date(env['commit'])}), "
                      f"[{name}](results/{name})\n\n{markdown(r)}")
        for model, m in r["models"].items():
            s, lc = m["sluice"], m.get("llama.cpp") or {}
            v[f"serve.{tag}.{model}.ratio"] = f"{s['ratio_c_over_1']:.2f}x"
            v[f"serve.{tag}.{model}.c8"] = commas(s["c8"]["tok_s"], 1)
            v[f"serve.{tag}.{model}.c1"] = commas(s["c1"]["tok_s"], 1)
            v[f"serve.{tag}.{model}.errors"] = str(s["c8"]["errors"] + s["c1"]["errors"])
            v[f"serve.{tag}.{model}.requests"] = commas(s["c8"]["n"])
            for k, x in (m.get("sluice_over_llama") or {}).items():
                v[f"serve.{tag}.{model}.over_llama.{k}"] = f"{x:.2f}x"
            if lc:
                v[f"serve.{tag}.{model}.llama.ratio"] = f"{lc['ratio_c_over_1']:.2f}x"
        v[f"serve.{tag}.commit"] = env["commit"]
        v[f"serve.{tag}.date"] = commit_date(env["commit"])
    v["serve.tables"] = "\n\n".join(tables)
    return v


# --- sluice profile --json (docs/profile.md) ------------------------------------------------------

PROFILE_FILES = {"profile-bundled.json": "bundled (6.8M, fp32)", "profile-qwen3.json": "Qwen3-0.6B shape, fp32",
                 "profile-llama-8k.json": "Llama-3-8B shape, bf16"}


def pct(x: float, signed: bool = False, digits: int = 1) -> str:
    return f"{100 * x:+.{digits}f}%" if signed else f"{100 * x:.{digits}f}%"


def profile_values() -> dict[str, str]:
    """The table of docs/profile.md, one row per (model, context). profile-llama.json is the first
    Llama run, whose 8,192 row (disturbed: page faults under memory pressure) profile-llama-8k.json
    redid; the other rows are the first run's."""
    rows = ["| model | context | step ms | sum vs step | LM head + softmax | KV attention (time) | KV bytes | "
            "MB read | achieved GB/s | roofline ms | error |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    runs = [("profile-bundled.json", lambda c: True), ("profile-qwen3.json", lambda c: True),
            ("profile-llama.json", lambda c: c != 8192), ("profile-llama-8k.json", lambda c: c == 8192)]
    for name, keep in runs:
        label = PROFILE_FILES.get(name, PROFILE_FILES["profile-llama-8k.json"])
        for r in load(name)["rows"]:
            if not keep(r["context"]):
                continue
            rows.append(f"| {label} | {commas(r['context'])} | {commas(r['step_ms'], 1)} | {pct(r['sum_vs_step'], True)} | "
                        f"{pct(r['lm_head_softmax_share'])} | {pct(r['kv_time_share'])} | {pct(r['kv_bytes_share'])} | "
                        f"{commas(r['read_bytes'] / 1e6)} | {r['achieved_GB_s']:.2f} | {commas(r['predicted']['step_ms'], 1)} | "
                        f"{pct(r['prediction_error'], True, 0)} |")
    return {"profile.table": "\n".join(rows)}


# --- speculative decoding (bench/speculative.py, docs/speculative.md) -----------------------------

def spec_values() -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative import markdown  # the script's own tables (it imports torch: a few seconds)
    r = load("bench-speculative.json")
    results, _, cost = markdown(r).partition("**cost model:")
    return {"spec.results": results.strip(), "spec.cost": ("**cost model:" + cost).strip(),
            "spec.date": r["date"][:10], "spec.commit": r["code"]["commit"]}


# --- tensor parallelism (bench/tp_allreduce.py, bench/tp_memory.py; docs/parallel.md) -------------

def tp_values() -> dict[str, str]:
    r, mem = load("bench-tp-allreduce.json"), load("bench-tp-memory.json")
    rows = ["| ranks | shape | batch | bytes per all-reduce | us per all-reduce | all-reduces per token | "
            "sampler's 3 collectives (us) | per token, measured (us) | per token from the parts (us) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in r["collectives"]:
        rows.append(f"| {c['world']} | {c['shape']} (hidden {c['hidden_size']}, {c['num_layers']} layers) | {c['batch']} | "
                    f"{commas(c['all_reduce_bytes'])} | {commas(c['us_per_all_reduce'], 1)} | {c['all_reduces_per_token']} | "
                    f"{commas(c['us_sampler_collectives'], 1)} | **{commas(c['us_per_token'])}** | "
                    f"{commas(c['us_per_token_from_parts'])} |")
    dec = ["| batch | one process, kernels=False (tok/s) | 2 ranks, tensor_parallel=2 (tok/s) | ratio | tokens identical |",
           "|---:|---:|---:|---:|---|"]
    for key, d in r["decode"].items():
        one = max(x["decode_tok_s"] for x in d["single_process_kernels_false_2_threads"])
        two = max(x["decode_tok_s"] for x in d["tp2_1_thread_per_rank"])
        dec.append(f"| {key.removeprefix('batch_')} | {commas(one, 1)} | {commas(two, 1)} | **{two / one:.2f}x** | "
                   f"{'yes' if d['same_tokens'] else 'no'} |")
    mib = (lambda b: f"{b / 2**20:,.1f} MiB")
    v = {"tp.collectives": "\n".join(rows), "tp.decode": "\n".join(dec),
         "tp.mem.whole": mib(mem["whole"]["param_bytes"]), "tp.mem.whole_anon": f"{mem['whole']['rss_anon_growth'] / 2**20:.0f} MiB"}
    for n, ranks in mem["ranks"].items():
        v[f"tp.mem.{n}.params"] = mib(max(x["param_bytes"] for x in ranks))
        v[f"tp.mem.{n}.share"] = f"{max(x['param_share'] for x in ranks):.3f}"
        v[f"tp.mem.{n}.anon"] = f"{max(x['rss_anon_growth'] for x in ranks) / 2**20:.0f} MiB"
        if all("huge_pages" in x for x in ranks):  # (recorded since 2026-12-03)
            v[f"tp.mem.{n}.huge"] = mib(min(x["huge_pages"]["moved_bytes"] for x in ranks))
    if "huge_pages" in mem["whole"]:
        v["tp.mem.whole_huge"] = mib(mem["whole"]["huge_pages"]["moved_bytes"])
    return v


# --- the bundled model's card and training logs (docs/bundled-model.md) -----------------------------

CARD = ROOT / "src" / "sluice" / "assets" / "sluice-stdlib" / "training.json"


def heldout_curve(name: str) -> dict[int, float]:
    lines = (json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip())
    return {e["step"]: e["heldout_bpb"] for e in lines if "heldout_bpb" in e}


def card_values() -> dict[str, str]:
    """The shipped model's own card (training.json, written by `sluice train` and bench/bundled_quality.py)
    and the two editions' training logs."""
    c = json.loads(CARD.read_text())
    second, first = heldout_curve("bundled-model-log-2.jsonl"), heldout_curve("bundled-model-log.jsonl")
    steps = sorted(set(second) | set(first))
    cell = (lambda curve, s: f"{curve[s]:.3f}" if s in curve else "")
    curve = ["| step | " + " | ".join(str(s) for s in steps) + " |", "|---" * (len(steps) + 1) + "|",
             "| second edition | " + " | ".join(cell(second, s) for s in steps) + " |",
             f"| first edition (cosine over {max(first):,}) | " + " | ".join(cell(first, s) for s in steps) + " |"]
    q = c["quality"]
    return {"card.params": commas(c["params"]), "card.steps": commas(c["steps"]), "card.tokens": commas(c["tokens_seen"]),
            "card.epochs": f"{c['tokens_seen'] / c['corpus']['train_tokens']:.1f}",
            "card.train_tokens": f"{c['corpus']['train_tokens'] / 1e6:.2f} M",
            "card.minutes": f"{c['train_wall_seconds'] / 60:.1f} min",
            "card.tok_s": commas(c["tokens_seen"] / c["train_wall_seconds"]),
            "card.final_loss": f"{c['final_train_loss']:.2f}", "card.heldout_loss": f"{c['heldout']['loss']:.2f}",
            "card.bpb": f"{c['heldout']['bpb']:.3f}", "card.gzip": f"{c['baselines']['gzip-9']:.3f}",
            "card.xz": f"{c['baselines']['xz-9e']:.3f}", "card.baseline_bytes": commas(c["baselines"]["bytes"]),
            "card.heldout_files": str(c["corpus"]["heldout_files"]), "card.train_files": str(c["corpus"]["train_files"]),
            "card.outside.bpb": f"{q['outside_stdlib']['bpb']:.3f}", "card.outside.gzip": f"{q['outside_stdlib']['gzip-9']:.3f}",
            "card.outside.xz": f"{q['outside_stdlib']['xz-9e']:.3f}", "card.outside.files": str(q["outside_stdlib"]["files"]),
            "card.parse": f"{q['parse']['parsed']} of {q['parse']['prompts']}",
            "card.files": f"{c['corpus']['train_files'] + c['corpus']['heldout_files']:,} files, "
                          f"{(c['corpus']['train_bytes'] + c['corpus']['heldout_bytes']) / 1e6:.1f} MB",
            "card.heldout": f"{c['corpus']['heldout_files']} files, {c['corpus']['heldout_bytes'] / 1e3:.0f} KB",
            "card.bytes_per_token": f"{c['corpus']['train_bytes'] / c['corpus']['train_tokens']:.2f}",
            "card.curve": "\n".join(curve)}
