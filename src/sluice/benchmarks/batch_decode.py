"""`sluice bench batch` (bench/batch_decode.py): batched greedy decode, sluice against llama.cpp's own
batched decode (llama-batched-bench, benchmarks/batched_bench.py).

For each batch size B it times, on one checkpoint and precision:
  sluice     LLM.generate of B different random prompts of P tokens, greedy, G + 1 new tokens
             each. The step budget (max_num_batched_tokens) holds all B prompts, so one step
             prefills them all and G steps of B rows follow, as in llama-batched-bench. tg = B * G
             decode tokens / the time after the last row's first token; pp = B * P / the time to it.
  llama.cpp  llama-batched-bench on the same checkpoint as GGUF (sluice's export, cached), the same
             thread count, prompts not shared: its S_TG (B * TG / T_TG) and S_PP at PP = P, TG = G.
Both decode B sequences of P..P+G tokens of context. llama.cpp feeds random tokens rather than
the greedy pick (it samples nothing); sluice picks each row's argmax, a small cost it carries.
Rounds alternate the engines (sluice first on even rounds), with a read-bandwidth probe between
rounds; rows give mean and standard deviation over rounds. The results also record the CPU flags,
the load and whether the run was disturbed (observatory/disturbance.py).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from ..engine.gemv import cpu_flags
from ..errors import BenchmarkError
from ..observatory.disturbance import LoadWatch
from .common import environment, summary

QUICK = {"prompt": 16, "gen": 8, "batch": "1,4", "reps": 1, "probe_mib": 16}
PROMPT_SEED = 0


def settings(args) -> dict:
    from .speed import DTYPES, QUANTS, recorded_bf16_dot
    s = {"model": args.model, "dtype": args.dtype, "quantize": args.quantize, "prompt": args.prompt,
         "gen": args.gen, "reps": args.reps, "batch": args.batch, "threads": args.threads,
         "probe_mib": args.probe_mib, "vs": list(dict.fromkeys(args.vs or [])), "gguf": args.gguf,
         "batched_bench": args.batched_bench, "quick": args.quick, "prompt_seed": PROMPT_SEED,
         "bf16_dot": recorded_bf16_dot(args.dtype, args.quantize)}
    if args.quick:  # the smoke test's sizes, unless a flag was given
        s.update({k: v for k, v in QUICK.items() if getattr(args, k) is None})
    for k, default in (("prompt", 128), ("gen", 128), ("batch", "8"), ("reps", 3), ("probe_mib", 2048)):
        if s[k] is None:
            s[k] = default
    for v in s["vs"]:
        if v != "llama.cpp":
            raise BenchmarkError(f"--vs {v}: the batched peer is llama.cpp (llama-batched-bench)")
    if s["dtype"] not in DTYPES:
        raise BenchmarkError(f"--dtype {s['dtype']}: choose float32 or bfloat16")
    if s["quantize"] is not None and s["quantize"] not in QUANTS:
        raise BenchmarkError(f"--quantize {s['quantize']}: choose int8 or int4")
    try:
        s["batch"] = sorted({int(b) for b in str(s["batch"]).split(",")})
    except ValueError:
        raise BenchmarkError(f"--batch {s['batch']}: comma-separated integers, e.g. 8 or 1,8") from None
    for name in ("prompt", "gen", "reps"):
        if s[name] < 1:
            raise BenchmarkError(f"--{name} must be >= 1, got {s[name]}")
    if s["batch"][0] < 1 or (s["threads"] is not None and s["threads"] < 1) or s["probe_mib"] < 0:
        raise BenchmarkError("--batch and --threads must be >= 1, --probe-mib >= 0")
    if (s["gguf"] or s["batched_bench"]) and "llama.cpp" not in s["vs"]:
        raise BenchmarkError("--gguf and --batched-bench are for --vs llama.cpp, which was not asked for")
    return s


def _gguf_precision(path: Path) -> str:
    """The file's type as llama.cpp names it (q4_0, bf16, ...), from its general.file_type."""
    import gguf
    field = gguf.GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return path.stem
    name = gguf.LlamaFileType(int(field.contents())).name  # e.g. MOSTLY_Q4_0, ALL_F32
    return name.split("_", 1)[1].lower()


def _sluice_round(llm, prompts: list[list[int]], gen: int) -> dict:
    from ..engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=gen + 1, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    s = llm.last_stats
    if any(len(o.token_ids) != gen + 1 for o in outs):
        raise BenchmarkError("sluice: a row ended before its max_tokens (ignore_eos was not honoured)")
    return {"pp_s": s.prefill_seconds, "tg_s": s.decode_seconds, "decode_tokens": s.generated_tokens - s.rows,
            "first_tokens": [o.token_ids[0] for o in outs]}


def run(args) -> dict:
    from ..llm import LLM
    from ..model.hub import resolve_model_dir
    from ..model.loading import bundled_model_dir
    from .batched_bench import command, find_batched_bench, run_batched_bench
    from .speed import params_read_per_token, read_bandwidth
    from .speed_engines import gguf_for

    s = settings(args)
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    watch, env = LoadWatch(), environment()
    P, G, batches = s["prompt"], s["gen"], s["batch"]
    model_dir = resolve_model_dir(s["model"]) if s["model"] else bundled_model_dir()
    peer = None
    if "llama.cpp" in s["vs"]:  # found (and the GGUF written) before the sluice load, so a refusal comes at once
        binary = find_batched_bench(s["batched_bench"])
        gguf = gguf_for(model_dir, s["quantize"] or s["dtype"], s["gguf"])
        peer = {"binary": str(binary), "gguf": str(gguf), "precision": _gguf_precision(gguf),
                "command": command(binary, gguf, torch.get_num_threads(), P, G, batches)}
    llm = LLM(model_dir, dtype=s["dtype"], quantize=s["quantize"], max_num_seqs=max(batches),
              max_num_batched_tokens=max(batches) * P)
    cfg = llm.config
    if P + G + 1 > llm.max_model_len:
        raise BenchmarkError(f"--prompt {P} + --gen {G} does not fit the model's context of {llm.max_model_len} tokens")
    limit = min(cfg.vocab_size, llm.tokenizer.vocab_size)
    # New prompts for every call: sluice's prefix cache would serve a prompt it has seen, and time no prefill.
    gen_ids = torch.Generator().manual_seed(PROMPT_SEED)

    def fresh(b: int) -> list[list[int]]:
        return torch.randint(0, limit, (b, P), generator=gen_ids).tolist()
    precision = s["quantize"] or {"float32": "f32", "bfloat16": "bf16"}[s["dtype"]]
    print("sluice bench batch: warmup sluice", file=sys.stderr, flush=True)
    for b in batches:  # untimed: pages in the weights, builds or loads the kernels for b rows
        _sluice_round(llm, fresh(b), min(G, 4))
    samples = {(e, b): {"pp": [], "tg": []} for e in ("sluice", "llama.cpp") for b in batches}
    machine, peer_runs, engines = {"read": []}, [], ["sluice"] + (["llama.cpp"] if peer else [])
    timeout = 600 + 10 * max(batches) * (P + G)  # a hang-stopper for the peer, far past its run
    for r in range(s["reps"]):
        for name in engines[r % len(engines):] + engines[:r % len(engines)]:
            if name == "sluice":
                for b in batches:
                    out = _sluice_round(llm, fresh(b), G)
                    samples[(name, b)]["pp"].append(b * P / out["pp_s"])
                    samples[(name, b)]["tg"].append(out["decode_tokens"] / out["tg_s"])
            else:
                ran = run_batched_bench(peer["command"], timeout, [(P, G, b) for b in batches])
                peer_runs.append(ran)
                for b in batches:
                    row = next(x for x in ran["rows"] if (x["pp"], x["tg"], x["pl"]) == (P, G, b))
                    samples[(name, b)]["pp"].append(row["speed_pp"])
                    samples[(name, b)]["tg"].append(row["speed_tg"])
            print(f"sluice bench batch: round {r + 1}/{s['reps']} {name}: tg " + ", ".join(
                f"B={b} {samples[(name, b)]['tg'][-1]:.1f} tok/s" for b in batches), file=sys.stderr, flush=True)
        if s["probe_mib"]:
            machine["read"].append(read_bandwidth(s["probe_mib"] << 20))
    rows = []
    for b in batches:
        for name in engines:
            rows.append({"engine": name, "precision": precision if name == "sluice" else peer["precision"],
                         "batch": b, "test": f"tg{G}", "tok_s": summary(samples[(name, b)]["tg"]),
                         "pp_tok_s": summary(samples[(name, b)]["pp"])})
    base = {r["batch"]: r["tok_s"]["mean"] for r in rows if r["engine"] == "sluice"}
    for row in rows:
        row["vs_sluice"] = row["tok_s"]["mean"] / base[row["batch"]]
    load = watch.result()
    return {"benchmark": "batch_decode", "settings": s, **env, "cpu_flags": sorted(cpu_flags()),
            "model": {"dir": str(model_dir), "params_read_per_token": params_read_per_token(model_dir),
                      "layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size},
            "sluice": {"max_num_batched_tokens": llm.max_num_batched_tokens, "max_num_seqs": llm.max_num_seqs},
            "llama.cpp": peer and {**peer, "settings": peer_runs[-1]["settings"] if peer_runs else {},
                                   "outputs": [x["output"] for x in peer_runs], "runs": [x["runs"] for x in peer_runs]},
            "machine": machine, "read_GB_s": statistics.median(p["GB_s"] for p in machine["read"]) if machine["read"] else None,
            "rows": rows, "loadavg_at_end": load["loadavg_at_end"], "disturbed": load["disturbed"], "load": load}


def print_tables(r: dict) -> None:
    s, cpu = r["settings"], r["cpu"]
    print(f"\nmodel: {r['model']['dir']}; CPU: {cpu.get('model', '?')}, {r['torch_threads']} threads; "
          f"prompt {s['prompt']} tokens per row, {s['gen']} decode steps; {s['reps']} rounds\n")
    if r["disturbed"]:
        print("DISTURBED RUN (keep these numbers out of the docs): " + "; ".join(r["load"]["disturbed_reasons"]) + "\n")
    print("| engine | precision | batch | test | decode t/s, all rows | vs sluice | prefill t/s |")
    print("|---|---|---:|---|---:|---:|---:|")
    for row in r["rows"]:
        t, p = row["tok_s"], row["pp_tok_s"]
        print(f"| {row['engine']} | {row['precision']} | {row['batch']} | {row['test']} | {t['mean']:.2f} ± {t['std']:.2f} "
              f"| {row['vs_sluice']:.2f}x | {p['mean']:.1f} |")
