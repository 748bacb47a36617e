"""Speculative decoding measured: acceptance rate, tokens per target forward, decode tok/s, plain vs
speculation, on the bundled model (its shipped draft, and prompt lookup) and on random Qwen3-0.6B
shapes with a random small draft (acceptance ~0), plus the cost model that says when speculation pays.

    flock /tmp/sluice-bench.lock timeout 900 .venv/bin/python bench/speculative.py \
        --json docs/results/bench-speculative.json
    .venv/bin/python bench/speculative.py --quick --q06 '' --json /tmp/spec-quick.json   # a smoke run

Method: what ships, the continuous-batching scheduler's step with speculation as its option. One LLM
per mode (plain, draft, each --draft NAME, prompt lookup), each loading its own copy of the target;
each configuration's guess count is set on its LLM with batch_engine().scheduler.speculation.set_k(k)
(read when a request is added). Each prompt runs alone (batch 1). Configurations run interleaved, one
warm-up round then --reps timed rounds; each cell is the median over rounds of the set's decode
tok/s (its decode tokens / its decode seconds), with acceptance and tokens per forward summed over
the set. Greedy outputs of every configuration are compared with plain decoding's.

Cost model: with acceptance a and k guesses a round yields (1 - a^(k+1)) / (1 - a) tokens for one
draft pass (a 2-token catch-up forward and k-1 steps, proposers.py) plus one target verify of k+1
tokens; plain decoding yields 1 token per target step. Speculation pays when
tokens(a) / (t_draft_round + t_verify(k)) > 1 / t_step; the break-even a is found by bisection.
Its times are fixed-shape timings of the same native step (engine/runner.Runner over the draft-mode
LLM's model and draft_model, batch 1, a static cache), not of the scheduler's paged step: they price
the forwards alone, without the scheduler's per-step work.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from sluice import LLM, SamplingParams
from sluice.benchmarks.common import environment, provenance
from sluice.engine.gemv import cpu_flags
from sluice.engine.runner import Runner

CODE_PROMPTS = [
    "def merge_sort(items):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def read_config(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def fibonacci(n):\n",
    "def parse_args(argv=None):\n",
]

EDIT_FUNCTION = '''def summarize_orders(orders, currency="EUR"):
    """Return totals per customer, the largest order and the number of refunds."""
    totals = {}
    largest = None
    refunds = 0
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if order.get("currency", currency) != currency:
            rate = order.get("rate", 1.0)
            amount = amount * rate
        if amount < 0:
            refunds += 1
            continue
        if customer not in totals:
            totals[customer] = 0.0
        totals[customer] += amount
        if largest is None or amount > largest["amount"]:
            largest = {"customer": customer, "amount": amount}
    names = sorted(totals)
    lines = []
    for name in names:
        total = totals[name]
        if total > 1000:
            label = "large"
        elif total > 100:
            label = "medium"
        else:
            label = "small"
        lines.append(f"{name}: {total:.2f} {currency} ({label})")
    report = "\\n".join(lines)
    result = {
        "totals": totals,
        "largest": largest,
        "refunds": refunds,
        "report": report,
    }
    return result
'''
EDIT_PROMPT = (EDIT_FUNCTION + "\n\n# The same function again, with the variable `order` renamed to `item`:\n"
               + EDIT_FUNCTION.splitlines()[0] + "\n")

SETS = {"code": (CODE_PROMPTS, 128), "edit": ([EDIT_PROMPT], 256)}
CONFIGS = [("off", None), ("draft", 2), ("draft", 4), ("draft", "auto"), ("prompt-lookup", 4), ("prompt-lookup", "auto")]
TEMPS = {"greedy": 0.0, "sampled": 0.8}
SEED = 1234


def name_of(mode, k) -> str:
    return "plain" if mode == "off" else f"{mode} k={k}"


def make_llms(model, dtype: str, modes: set[str], drafts: dict[str, object]) -> dict[str, LLM]:
    """One LLM per mode: "off" plain, "prompt-lookup", and "draft" / "draft:NAME" with drafts[mode]."""
    def make(mode: str) -> LLM:
        if mode == "off":
            return LLM(model, dtype=dtype)
        if mode == "prompt-lookup":
            return LLM(model, dtype=dtype, speculative="prompt-lookup")
        return LLM(model, dtype=dtype, draft_model=drafts[mode])
    return {mode: make(mode) for mode in sorted(modes)}


def configure(llms: dict[str, LLM], mode: str, k) -> LLM:
    """The LLM of `mode`, its guess count set to k for the requests added from now on."""
    llm = llms[mode]
    if mode != "off":
        llm.batch_engine().scheduler.speculation.set_k(k)
    return llm


def run_set(llm: LLM, prompts: list[str], new: int, temp: float) -> dict:
    """Each prompt alone (batch 1); the set's totals and each prompt's tokens."""
    tot = {"tokens": 0, "seconds": 0.0, "proposed": 0, "accepted": 0, "row_forwards": 0}
    outs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=new, temperature=temp, seed=SEED + i, ignore_eos=True)
        outs.append(llm.generate([p], params)[0].token_ids)
        s = llm.last_stats
        tot["tokens"] += s.generated_tokens - s.rows
        tot["seconds"] += s.decode_seconds
        tot["proposed"] += s.proposed
        tot["accepted"] += s.accepted
        tot["row_forwards"] += s.row_forwards if s.speculative != "off" else s.generated_tokens - s.rows
    return {**tot, "outputs": outs}


def bench_target(llms: dict[str, LLM], sets: dict, configs: list, temps: dict, reps: int) -> list[dict]:
    cells = {}
    for rep in range(reps + 1):  # round 0 is the warm-up
        for set_name, (prompts, new) in sets.items():
            for tname, temp in temps.items():
                for mode, k in configs:
                    r = run_set(configure(llms, mode, k), prompts, new, temp)
                    label = f"{set_name} {tname} {name_of(mode, k)}"
                    print(f"  round {rep}: {label}: {r['tokens'] / r['seconds']:.1f} tok/s", file=sys.stderr, flush=True)
                    if rep:
                        cells.setdefault((set_name, tname, mode, k), []).append(r)
    rows = []
    for (set_name, tname, mode, k), rs in cells.items():
        plain = cells[(set_name, tname, "off", None)]
        last = rs[-1]
        row = {"set": set_name, "temperature": TEMPS[tname], "config": name_of(mode, k),
               "tok_s": statistics.median(r["tokens"] / r["seconds"] for r in rs),
               "tok_s_samples": [round(r["tokens"] / r["seconds"], 2) for r in rs],
               "acceptance_rate": last["accepted"] / last["proposed"] if last["proposed"] else None,
               "tokens_per_forward": last["tokens"] / last["row_forwards"] if last["row_forwards"] else None,
               # at most k: the guess count the configuration set (fewer where max_tokens or a lookup ends them)
               "guesses_per_forward": (last["proposed"] / last["row_forwards"]
                                       if mode != "off" and last["row_forwards"] else None)}
        row["speedup"] = row["tok_s"] / statistics.median(r["tokens"] / r["seconds"] for r in plain)
        if tname == "greedy":
            row["greedy_identical_to_plain"] = all(r["outputs"] == plain[0]["outputs"] for r in rs)
        rows.append(row)
    return rows


def _time(fn, n: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


@torch.inference_mode()
def cost_model(llm: LLM, ks=(1, 2, 4, 8), context: int = 64, n: int = 10) -> dict:
    """Per-forward times at `context` tokens of cache, batch 1: Runners over a draft-mode LLM's model and
    draft_model, on the native step where the engine runs it (a hooked or quantized model takes torch's)."""
    prompt = list(range(10, 10 + context))
    # A request first: the engine settles its kernels and compute mode on the model at the first one.
    llm.generate([prompt[:8]], SamplingParams(max_tokens=2, temperature=0.0))
    target, draft = Runner(llm.model, native=True), Runner(llm.draft_model, native=True)
    slots = Runner.slots_for(context + 64)
    target.prefill([prompt], slots)
    draft.prefill([prompt], slots)
    tok = torch.tensor([11])

    def step(r):  # one step, then back to the same position, so every sample sees the same context
        r.step(tok)
        r.advance(-1)

    t_step, t_draft = _time(lambda: step(target), n), _time(lambda: step(draft), n)
    t_draft2 = _time(lambda: draft.verify(torch.tensor([[11, 12]])), n)
    out = {"context": context, "t_step_ms": t_step * 1e3, "t_draft_step_ms": t_draft * 1e3,
           "t_draft_catchup2_ms": t_draft2 * 1e3, "step": {"target": target.native_reason or "native",
                                                          "draft": draft.native_reason or "native"}, "per_k": []}
    for k in ks:
        t_verify = _time(lambda: target.verify(torch.tensor([[11] * (k + 1)])), n)  # noqa: B023
        t_round = t_draft2 + (k - 1) * t_draft + t_verify
        out["per_k"].append({"k": k, "t_verify_ms": t_verify * 1e3, "t_round_draft_ms": t_round * 1e3,
                             "break_even_acceptance": break_even(k, t_round / t_step),
                             "break_even_acceptance_lookup": break_even(k, t_verify / t_step),
                             "speedup_at_a0": t_step / t_round})
    target.release()
    draft.release()
    return out


def expected_tokens(a: float, k: int) -> float:
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def break_even(k: int, cost_ratio: float) -> float | None:
    """The acceptance a at which expected_tokens(a, k) equals a round's cost in plain steps (None: never pays)."""
    if expected_tokens(1.0, k) < cost_ratio:
        return None
    if expected_tokens(0.0, k) >= cost_ratio:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost_ratio else (lo, mid)
    return hi


def make_random_draft(target: Path, out: Path) -> Path:
    """A 2-layer, hidden-256 Qwen3 with the target's vocabulary and tokenizer files, random weights."""
    if (out / "config.json").is_file():
        return out
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tcfg = json.loads((target / "config.json").read_text())
    cfg = Qwen3Config(vocab_size=tcfg["vocab_size"], hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                      max_position_embeddings=tcfg["max_position_embeddings"], bos_token_id=tcfg["bos_token_id"],
                      eos_token_id=tcfg["eos_token_id"])
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (target / f).is_file():  # ensure_q06's checkpoint has a tokenizer.json only
            shutil.copy(target / f, out / f)
    return out


def _f(x, fmt="{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def markdown(r: dict) -> str:
    """The tables of docs/speculative.md from a result."""
    out = []
    for title, rows in [("bundled model, fp32", r.get("bundled"))] + [
            (f"random Qwen3-0.6B shapes, {d}, random 2-layer draft", v.get("rows")) for d, v in r.get("q06", {}).items()]:
        if not rows:
            continue
        out += [f"**{title}**\n", "| prompts | temp | config | decode tok/s | vs plain | acceptance | tokens/forward "
                "| greedy = plain |", "|---|---:|---|---:|---:|---:|---:|---|"]
        for x in rows:
            same = {True: "yes", False: "**NO**"}.get(x.get("greedy_identical_to_plain"), "")
            out.append(f"| {x['set']} | {x['temperature']} | {x['config']} | {x['tok_s']:.1f} | {x['speedup']:.2f}x "
                       f"| {_f(x['acceptance_rate'], '{:.3f}')} | {_f(x['tokens_per_forward'])} | {same} |")
        out.append("")
    for title, c in [("bundled model, fp32", r.get("bundled_cost"))] + [
            (f"random Qwen3-0.6B shapes, {d}", v.get("cost")) for d, v in r.get("q06", {}).items()]:
        if not c:
            continue
        out += [f"**cost model: {title}** (context {c['context']}): t_step {c['t_step_ms']:.2f} ms, draft step "
                f"{c['t_draft_step_ms']:.2f} ms, draft 2-token catch-up {c['t_draft_catchup2_ms']:.2f} ms\n",
                "| k | t_verify(k) ms | verify / step | draft round ms | break-even a (draft) | break-even a (lookup) "
                "| speedup at a=0 (draft) |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for p in c["per_k"]:
            out.append(f"| {p['k']} | {p['t_verify_ms']:.2f} | {p['t_verify_ms'] / c['t_step_ms']:.2f} "
                       f"| {p['t_round_draft_ms']:.2f} | {_f(p['break_even_acceptance'], '{:.3f}') or 'never'} "
                       f"| {_f(p['break_even_acceptance_lookup'], '{:.3f}') or 'never'} | {p['speedup_at_a0']:.2f}x |")
        out.append("")
    return "\n".join(out)


def pick(ap, table: dict, names: str | None, flag: str) -> dict:
    """The entries of `table` named in a comma list (all when None)."""
    if names is None:
        return table
    wanted = names.split(",")
    unknown = [n for n in wanted if n not in table]
    if unknown:
        ap.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(table)}")
    return {n: table[n] for n in wanted}


def parse_configs(ap, text: str) -> list:
    """'plain,draft:2,draft:auto,prompt-lookup:4' -> [("off", None), ("draft", 2), ...], plain first."""
    configs = [("off", None)]
    for item in text.split(","):
        mode, _, k = item.partition(":")
        if mode == "plain" and not k:
            continue
        if mode not in ("draft", "prompt-lookup") or not (k == "auto" or k.isdigit()):
            ap.error(f"--configs: {item!r} is not plain, draft:K or prompt-lookup:K (K a number or auto)")
        configs.append((mode, k if k == "auto" else int(k)))
    return configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--q06", default="/tmp/sluice-speed-q06",
                    help="random Qwen3-0.6B-shape checkpoint, made if missing ('' skips)")
    ap.add_argument("--q06-draft", default="/tmp/sluice-speed-q06-draft")
    ap.add_argument("--q06-new", type=int, default=32)
    ap.add_argument("--only", default=None, help="comma list of parts: bundled,bundled-cost,q06 (default all)")
    ap.add_argument("--draft", action="append", default=None, metavar="NAME=DIR",
                    help="bundled part: compare these drafts (repeatable), interleaved in the same rounds, "
                         "instead of the shipped one")
    ap.add_argument("--quick", action="store_true", help="one prompt per set, 32 tokens, 1 rep (a smoke run)")
    ap.add_argument("--sets", default=None, help=f"bundled part: comma list of prompt sets ({','.join(SETS)})")
    ap.add_argument("--temps", default=None, help=f"bundled part: comma list of temperatures ({','.join(TEMPS)})")
    ap.add_argument("--configs", default=None, metavar="LIST",
                    help="bundled part: comma list of configurations, e.g. plain,draft:2,draft:auto,prompt-lookup:4 "
                         "(plain always runs: the others are measured against it)")
    ap.add_argument("--markdown", default=None, metavar="JSON", help="only print the tables of a saved result")
    a = ap.parse_args()
    if a.markdown:
        print(markdown(json.loads(Path(a.markdown).read_text())))
        return
    parts = set((a.only or "bundled,bundled-cost,q06").split(","))
    sets, reps = SETS, a.reps
    if a.quick:
        sets, reps = {"code": (CODE_PROMPTS[:1], 32), "edit": ([EDIT_PROMPT], 32)}, 1
    sets, temps = pick(ap, sets, a.sets, "--sets"), pick(ap, TEMPS, a.temps, "--temps")
    configs = CONFIGS if a.configs is None else parse_configs(ap, a.configs)
    result = {"benchmark": "speculative", **environment(), "cpu_flags": sorted(cpu_flags()),
              "threads": torch.get_num_threads(), "reps": reps, "seed": SEED}

    def save():
        if a.json:
            Path(a.json).write_text(json.dumps({**result, **provenance()}, indent=1, default=str) + "\n")

    if parts & {"bundled", "bundled-cost"}:
        drafts = {"draft": "bundled"}
        if a.draft:
            drafts = {}
            for spec in a.draft:
                name, eq, path = spec.partition("=")
                if not (name and eq and path):
                    ap.error(f"--draft takes NAME=DIR, got {spec!r}")
                drafts[f"draft:{name}"] = path
            configs = [(m, k) for m, k in configs if m != "draft"] + [
                (d, k) for d in drafts for m, k in configs if m == "draft"]
            result["drafts"] = dict(spec.partition("=")[::2] for spec in a.draft)
        # the cost model prices the shipped draft, or with --draft the first one named
        cost_mode = next(iter(drafts))
        modes = ({m for m, _ in configs} if "bundled" in parts else set()) | (
            {cost_mode} if "bundled-cost" in parts else set())
        llms = make_llms(None, "float32", modes, drafts)
        if "bundled" in parts:
            result["bundled"] = bench_target(llms, sets, configs, temps, reps)
            save()
        if "bundled-cost" in parts:
            result["bundled_cost"] = {**cost_model(llms[cost_mode]), "draft": drafts[cost_mode]}
            save()
        del llms
    if "q06" in parts and a.q06:
        from serve_servers import ensure_q06  # bench/: the checkpoint serve_load.py uses, made if missing
        ensure_q06(Path(a.q06))
        draft = make_random_draft(Path(a.q06), Path(a.q06_draft))
        q_sets = {"code": (CODE_PROMPTS[:1], a.q06_new)}
        q_configs = [("off", None), ("draft", 2), ("draft", 4)]
        result["q06"] = {}
        for dtype in ("float32", "bfloat16"):
            llms = make_llms(a.q06, dtype, {"off", "draft"}, {"draft": draft})
            # requests first: the engine settles its kernels / compute mode at the first request
            rows = bench_target(llms, q_sets, q_configs, {"greedy": 0.0}, 1 if a.quick else min(reps, 2))
            result["q06"][dtype] = {"rows": rows, "cost": cost_model(llms["draft"], ks=(2, 4), n=5)}
            save()
            del llms
    save()
    print(markdown(result))


if __name__ == "__main__":
    main()
