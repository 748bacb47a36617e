"""Every measured number in the docs, computed from docs/results/ and from the bundled model.

    python bench/docs_numbers.py            # rewrite every marked span in README.md, ARCHITECTURE.md, docs/*.md
    python bench/docs_numbers.py --check    # exit 1, naming each span whose text is not what it computes
    python bench/docs_numbers.py --list     # every value's name and text

A number in the prose is a marked span, `<!-- n:NAME -->text<!-- /n -->` (a table may span lines);
the script owns the text between the two comments and the prose around it is ours. NAME's first
part says where the value comes from: `model.` from the model that ships (bench/docs_model_numbers.py;
about a minute of CPU), `speed.` and `serve.` from the results files of bench/speed.py and
bench/serve_load.py, and `r:FILE:PATH:FORMAT` is one field of docs/results/FILE.json: PATH is a JSON
Pointer without its leading slash (keys and list indices joined by `/`, a `/` inside a key written
`~1`), FORMAT a Python format spec, e.g.
`r:bench-quant:bits_per_byte/float32/bits_per_byte:.4f`. The scripts in bench/ write those files. A results file is never edited by hand: to change a number, rerun its benchmark.
tests/test_docs_numbers.py fails when a doc's span differs from what this computes, or names a value
that does not exist.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
SPAN = re.compile(r"<!-- n:(.+?) -->(.*?)<!-- /n -->", re.S)


def doc_files() -> list[Path]:
    return [p for p in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
            if p.is_file()]


def spans(text: str) -> list[tuple[str, str]]:
    """(name, current text) of every marked span, in order."""
    return [(m.group(1), m.group(2)) for m in SPAN.finditer(text)]


def render(text: str, values: dict[str, str]) -> str:
    """text with every span's contents replaced by its value; an unknown name is a KeyError naming it."""
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise KeyError(f"unknown docs number {name!r} (bench/docs_numbers.py --list names them)")
        return f"<!-- n:{name} -->{values[name]}<!-- /n -->"
    return SPAN.sub(one, text)


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


# --- sluice bench (bench/speed.py): the newest result per machine kind and setting ---------------

def machine_kind(cpu: dict, threads: int | None = None) -> str:
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if cpu.get(f)] or ["no AVX2"]
    n = cpu.get("logical_cpus") or cpu.get("cores")
    return f"{cpu.get('model', '?')}, {n} logical CPUs, {' '.join(flags)}" + (f"; torch {threads} thread{'s' if threads > 1 else ''}" if threads else "")


def speed_setting(r: dict) -> str:
    s, m = r["settings"], r["model"]
    model = "bundled" if m["dir"].endswith("sluice-stdlib") else f"Qwen3-0.6B shape ({m['params_read_per_token'] / 1e6:.0f} M)"
    weights = s["quantize"] or {"float32": "fp32", "bfloat16": "bf16"}.get(s["dtype"], s["dtype"])
    return model + ", " + weights + (", --compile" if s["compile"] else "")


@cache
def speed_current() -> dict[str, dict[str, dict]]:
    """machine kind -> setting -> the newest bench-speed-*.json result for it."""
    best: dict[str, dict[str, dict]] = {}
    for path in sorted(RESULTS.glob("bench-speed-*.json")):
        r = json.loads(path.read_text())
        r["file"] = path.name
        kind = best.setdefault(machine_kind(r["cpu"], r["torch_threads"]), {})
        key = speed_setting(r)
        if key not in kind or r["date"] > kind[key]["date"]:
            kind[key] = r
    return best


def speed_table() -> str:
    out = []
    for kind, settings in sorted(speed_current().items()):
        out += ["", f"**{kind}**", "",
                "| model, weights | test | sluice tok/s | llama.cpp | transformers | sluice / llama.cpp | measured | results file |",
                "|---|---|---:|---:|---:|---:|---|---|"]
        for key, r in sorted(settings.items()):
            rows = {(row["engine"], row["test"]): row["tok_s"]["mean"] for row in r["rows"]}
            for test in sorted({t for _, t in rows}, key=lambda t: t.startswith("pp")):
                sl, lc, tf = (rows.get((e, test)) for e in ("sluice", "llama.cpp", "transformers"))
                cell = (lambda v: commas(v, 1) if v is not None else "")
                ratio = f"{sl / lc:.2f}x" if sl and lc else ""
                out.append(f"| {key} | {test} | {cell(sl)} | {cell(lc)} | {cell(tf)} | {ratio} | "
                           f"{r['date'][:10]}, {r['code']['commit']} | [{r['file']}](results/{r['file']}) |")
    return "\n".join(out[1:])


def speed_values() -> dict[str, str]:
    v = {"speed.table": speed_table(), "speed.files": str(len(list(RESULTS.glob("bench-speed-*.json"))))}
    for kind, settings in speed_current().items():
        tag = "avx512" if "avx512f" in kind else "avx2"
        for key, r in settings.items():
            model = "bundled" if key.startswith("bundled") else "q06"
            w = key.split(", ")[1] + ("-compile" if "--compile" in key else "")
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


# --- the registry -------------------------------------------------------------------------------

def model_values() -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "bench"))
    from docs_model_numbers import values
    return values()


GROUPS = {"speed": speed_values, "serve": serve_values, "profile": profile_values, "spec": spec_values,
          "tp": tp_values, "card": card_values, "model": model_values}


def field(name: str) -> str | None:
    """The text of an `r:FILE:PATH:FORMAT` value, or None when the file or the path is not there."""
    try:
        _, file, path, spec = name.split(":", 3)
        value = load(file + ".json")
        for key in path.split("/"):  # a JSON Pointer (RFC 6901) without its leading slash
            key = key.replace("~1", "/").replace("~0", "~")
            value = value[int(key)] if isinstance(value, list) else value[key]
        return format(value, spec)
    except (ValueError, KeyError, IndexError, TypeError, OSError):
        return None


def group(name: str) -> str:
    return "r" if name.startswith("r:") else name.split(".")[0]


def compute(names: set[str] | None = None) -> dict[str, str]:
    """Every value of each group that `names` touches (all groups when None), and the `r:` fields named."""
    wanted = {group(n) for n in names} if names is not None else set(GROUPS)
    out: dict[str, str] = {}
    for g, fn in GROUPS.items():
        if g in wanted:
            out.update(fn())
    for n in names or ():
        if group(n) == "r" and (text := field(n)) is not None:
            out[n] = text
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a span is stale")
    ap.add_argument("--list", action="store_true", help="print every value's name and text")
    ap.add_argument("--only", action="append", choices=[*GROUPS, "r"],
                    help="only the spans of this group (repeatable); e.g. skip the model's minute")
    args = ap.parse_args(argv)
    if args.list:
        for name, text in sorted(compute().items()):
            print(f"{name}: {text}")
        return 0
    docs = {p: p.read_text() for p in doc_files()}
    names = {n for t in docs.values() for n, _ in spans(t) if not args.only or group(n) in args.only}
    values = compute(names)
    values.update({n: old for t in docs.values() for n, old in spans(t) if n not in names})  # left as they are
    stale = 0
    for path, text in docs.items():
        new = render(text, values)
        if new == text:
            continue
        if args.check:
            for (name, old), (_, now) in zip(spans(text), spans(new)):
                if old != now:
                    stale += 1
                    print(f"{path.relative_to(ROOT)}: {name}: {old!r} should be {now!r}")
        else:
            path.write_text(new)
            print(f"rewrote {path.relative_to(ROOT)}")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
