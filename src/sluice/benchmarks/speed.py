"""`sluice bench` (no sub-benchmark): a llama-bench-style speed table, sluice against its peers.

For one checkpoint and precision it times, at batch 1 and greedy, with the same random prompt
token ids for every engine (a new prompt each round, so that no engine's prefix cache serves it):
  pp<P>  prefill tokens/s of a P-token prompt (the forward pass and the first token's pick);
  tg<G>  decode tokens/s of G more tokens after that prompt (one forward + pick per token).
Engines (sluice; transformers and llama.cpp with --vs) load once, get one untimed warmup each,
then run round by round in rotated order, so drift and background load hit all of them alike;
between rounds a 2-thread read of a large array measures what the memory moves at that moment.
Each row gives the mean and standard deviation over rounds, the ratio of the peer's mean to
sluice's, and for decode the bytes a token must read (weights + the KV cache at the mean context)
times tokens/s, as GB/s and as a share of the read bandwidth measured between rounds.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from ..engine import mixed
from ..engine.gemv import cpu_flags
from ..errors import BenchmarkError
from ..model.hugepages import mem_available
from ..observatory.disturbance import LoadWatch
from .common import environment, summary

PEERS = ("transformers", "llama.cpp")
DTYPES = ("float32", "bfloat16")
QUANTS = ("int8", "int4")
PROMPT_SEED = 0


def settings(args) -> dict:
    vs = []
    for v in args.vs or []:
        if v not in PEERS:
            raise BenchmarkError(f"--vs {v}: unknown engine (choose from {', '.join(PEERS)})")
        if v not in vs:
            vs.append(v)
    if args.dtype not in DTYPES:
        raise BenchmarkError(f"--dtype {args.dtype}: choose float32 or bfloat16")
    if args.quantize is not None and args.quantize not in QUANTS:
        raise BenchmarkError(f"--quantize {args.quantize}: choose int8 or int4")
    for name in ("prompt", "gen", "reps", "passes"):
        if getattr(args, name, 1) < 1:
            raise BenchmarkError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise BenchmarkError(f"--threads must be >= 1, got {args.threads}")
    if args.probe_mib < 0:
        raise BenchmarkError(f"--probe-mib must be >= 0, got {args.probe_mib}")
    if getattr(args, "passes", 1) > 1 and not getattr(args, "sequential", False):
        raise BenchmarkError("--passes is for --sequential (rotated rounds already alternate the engines)")
    if args.gguf and "llama.cpp" not in vs:
        raise BenchmarkError("--gguf is for --vs llama.cpp, which was not asked for")
    spec = _speculation(getattr(args, "draft_model", None), getattr(args, "prompt_lookup", False),
                        getattr(args, "speculative_tokens", None))
    return {"model": args.model, "dtype": args.dtype, "quantize": args.quantize, "prompt": args.prompt,
            "gen": args.gen, "reps": args.reps, "vs": vs, "threads": args.threads, "compile": args.compile,
            "gguf": args.gguf, "llama_python": args.llama_python, "probe_mib": args.probe_mib,
            "prompt_seed": PROMPT_SEED, "speculation": spec, "sequential": bool(getattr(args, "sequential", False)),
            "passes": getattr(args, "passes", 1), "bf16_dot": recorded_bf16_dot(args.dtype, args.quantize),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto")}


def recorded_bf16_dot(dtype: str, quantize: str | None) -> str | None:
    """What a results file records as its bf16-weight products (docs tables label rows by it): the mode resolved
    here (mixed.bf16_dot(): SLUICE_BF16_DOT, "auto" by the CPU and build) for bf16 weights, else None."""
    return mixed.bf16_dot() if dtype == "bfloat16" and quantize is None else None


def _speculation(draft_model, prompt_lookup: bool, tokens) -> dict | None:
    """The bench flags -> LLM keyword arguments (None: plain decoding). LLM checks k's range itself."""
    if draft_model is not None and prompt_lookup:
        raise BenchmarkError("--draft-model and --prompt-lookup are two proposers: choose one")
    if draft_model is None and not prompt_lookup:
        if tokens is not None:
            raise BenchmarkError("--speculative-tokens needs a proposer: --draft-model PATH|bundled or --prompt-lookup")
        return None
    if tokens is not None and tokens != "auto":
        try:
            tokens = int(tokens)
        except ValueError:
            raise BenchmarkError(f"--speculative-tokens {tokens}: an integer or 'auto'") from None
    return {"speculative": "prompt-lookup" if prompt_lookup else "draft", "draft_model": draft_model,
            "num_speculative_tokens": tokens}


def read_bandwidth(nbytes: int, reps: int = 3) -> dict:
    """What torch's threads can read from DRAM right now: sum() over an array far larger than any
    cache (one add per 4 bytes is far below the cores' rate, so the memory sets the time)."""
    x = torch.ones(max(nbytes // 4, 1))  # writing the ones faults every page in before timing
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return {"GB_s": x.nbytes / min(times) / 1e9, "GB_s_median": x.nbytes / statistics.median(times) / 1e9}


def params_read_per_token(model_dir: Path) -> int:
    """Parameters one decode step reads: every matrix whole, the embedding one row unless tied."""
    from ..model.config import ModelConfig
    from ..observatory.costs import step_costs
    fp32 = step_costs(ModelConfig.from_hf(model_dir), 1, 1, torch.float32)
    return sum(c["read_bytes"] for k, c in fp32.items() if k not in ("attention", "sampling")) // 4


def _makers(s: dict, model_dir: Path, params_read: int) -> dict:
    """Every engine asked for, in order (sluice first), as a function that loads it."""
    from .speed_engines import LlamaCppEngine, SluiceEngine, TransformersEngine, find_llama_python, gguf_for
    makers = {"sluice": lambda: SluiceEngine(model_dir, s["dtype"], s["quantize"], s["compile"], s["speculation"],
                                             s.get("kv_cache_dtype", "auto"))}
    if "transformers" in s["vs"]:
        makers["transformers"] = lambda: TransformersEngine(model_dir, s["dtype"], params_read)
    if "llama.cpp" in s["vs"]:
        # Found (and the GGUF exported) before the minutes of loading, so a refusal comes at once.
        llama_python = find_llama_python(s["llama_python"])
        gguf = gguf_for(model_dir, s["quantize"] or s["dtype"], s["gguf"])
        n_ctx = s["prompt"] + s["gen"] + 8
        makers["llama.cpp"] = lambda: LlamaCppEngine(llama_python, gguf, torch.get_num_threads(), n_ctx,
                                                     n_batch=min(s["prompt"], 2048), params_read=params_read)
    return makers


def _check_memory(s: dict, params: int, available: int | None) -> None:
    """Refuse, before loading anything, engines that would not fit in memory side by side: a
    Llama-3-8B in bf16 is 16 GB per engine, and a llama.cpp whose mapped GGUF is pushed out of the
    page cache reads its weights from disk every token, which times the disk, not the engine."""
    if s["sequential"] or available is None:
        return
    itemsize = 1 if s["quantize"] else torch.empty((), dtype=getattr(torch, s["dtype"])).element_size()
    need = params * itemsize * (1 + len(s["vs"]))
    if need > 0.9 * available:
        raise BenchmarkError(f"{1 + len(s['vs'])} engines side by side need about {need / 1e9:.1f} GB of weights, "
                             f"and {available / 1e9:.1f} GB of memory is available: add --sequential to load "
                             f"one engine at a time")


def run(args) -> dict:
    s = settings(args)
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    watch = LoadWatch()
    env = environment()
    from ..model.hub import resolve_model_dir
    from ..model.loading import bundled_model_dir
    from ..observatory.machine import stream_copy
    model_dir = resolve_model_dir(s["model"]) if s["model"] else bundled_model_dir()
    params_read = params_read_per_token(model_dir)
    from ..model.config import ModelConfig
    cfg = ModelConfig.from_hf(model_dir)
    P, G = s["prompt"], s["gen"]
    if P + G + 1 > cfg.max_position_embeddings:
        raise BenchmarkError(f"--prompt {P} + --gen {G} does not fit the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
    _check_memory(s, params_read + cfg.vocab_size * cfg.hidden_size, mem_available())
    makers = _makers(s, model_dir, params_read)
    engines, load_s, spec_k = {}, {}, None
    probe_bytes = s["probe_mib"] << 20
    machine = {"stream_copy": stream_copy(min(probe_bytes, 512 << 20) or (64 << 20), reps=5), "read": []}
    names = list(makers)
    samples, tokens = {n: {"pp_s": [], "tg_s": []} for n in names}, {}
    perf, spec_rounds = {n: [] for n in names}, []

    def load(name: str):
        t0 = time.perf_counter()
        engines[name] = makers[name]()
        load_s[name] = time.perf_counter() - t0
        return engines[name]

    def warmup(name: str) -> None:  # untimed: page the weights in, build kernels, compile
        print(f"sluice bench: warmup {name}", file=sys.stderr, flush=True)
        # a compiled step is traced per cache size, which the request's length decides
        engines[name].round(prompts[0], G if name == "sluice" and s["compile"] else min(G, 4))

    def timed(name: str, r: int) -> None:
        out = engines[name].round(prompts[r + 1], G)
        samples[name]["pp_s"].append(out["pp_s"])
        samples[name]["tg_s"].append(out["tg_s"])
        tokens[name] = out["tokens"]
        if out.get("perf"):
            perf[name].append(out["perf"])
        if out.get("speculation"):
            spec_rounds.append(out["speculation"])
        print(f"sluice bench: round {r + 1}/{s['reps'] * s['passes']} {name}: pp {P / out['pp_s']:.1f} tok/s, "
              f"tg {G / out['tg_s']:.2f} tok/s", file=sys.stderr, flush=True)

    def probe() -> None:
        if probe_bytes:
            machine["read"].append(read_bandwidth(probe_bytes))

    # One prompt per round (and one for the warmup), the same for every engine in a round: sluice keeps
    # the prompts' KV blocks in its prefix cache, so a prompt seen before would not be prefilled again.
    gen_ids = torch.Generator().manual_seed(PROMPT_SEED)
    try:
        spec_k = load("sluice").llm.num_speculative_tokens
        limit = engines["sluice"].vocab_limit
        if not s["sequential"]:
            for name in names[1:]:
                limit = min(limit, getattr(load(name), "vocab_limit", limit))
        rounds = s["reps"] * s["passes"]
        prompts = [torch.randint(0, limit, (P,), generator=gen_ids).tolist() for _ in range(rounds + 1)]
        if s["sequential"]:
            # One engine in memory at a time: its warmup and its rounds, then it closes. A probe follows every
            # round. Drift between the engines' blocks is not averaged out as rotated rounds do; with several
            # passes the order reverses every other pass (A B B A ...), which cancels a steady drift. Each pass
            # has its own prompts, the same for every engine.
            for p in range(s["passes"]):
                for name in names if p % 2 == 0 else names[::-1]:
                    e = engines[name] if name in engines else load(name)
                    if getattr(e, "vocab_limit", limit) < limit:
                        raise BenchmarkError(f"--sequential: {name} knows {e.vocab_limit} token ids, "
                                             f"sluice {limit}: the prompts would not fit it")
                    warmup(name)
                    for r in range(p * s["reps"], (p + 1) * s["reps"]):
                        timed(name, r)
                        probe()
                    e.close()
                    if p + 1 < s["passes"]:
                        del engines[name]  # the next pass loads it anew (its load time is the last one's)
                    gc.collect()
        else:
            for name in names:
                warmup(name)
            for r in range(s["reps"]):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    timed(name, r)
                probe()
        # Bytes per decode token: the weights it reads and the KV cache up to the mean context of
        # the decode steps, each in the engine's own storage (llama.cpp keeps its KV cache in f16).
        kv_elems_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # keys + values
        mean_context = P + (G + 1) / 2
        read_bw = statistics.median(p["GB_s"] for p in machine["read"]) if machine["read"] else None
        engine_info, rows = {}, []
        for name in names:  # (a later pass reloads an engine: engines' own order is the loads')
            e = engines[name]
            step_bytes = e.weight_bytes + kv_elems_per_token * e.kv_itemsize * mean_context
            engine_info[name] = {"precision": e.precision, "load_s": load_s[name],
                                 "weight_bytes": e.weight_bytes, "kv_itemsize": e.kv_itemsize,
                                 "decode_bytes_per_token": step_bytes,
                                 "tokens": tokens[name][:32],
                                 "tokens_agree_with_sluice": _agree(tokens[name], tokens["sluice"]),
                                 **({"info": e.info, "gguf": str(e.gguf), "perf": perf[name]}
                                    if name == "llama.cpp" else {}),
                                 # sluice: what of its weights sit in 2 MiB pages, or why none (model/hugepages.py)
                                 **({"huge_pages": e.huge_pages} if name == "sluice" else {})}
            pp = summary([P / t for t in samples[name]["pp_s"]])
            tg = summary([G / t for t in samples[name]["tg_s"]])
            rows.append({"engine": name, "precision": e.precision, "test": f"pp{P}", "tok_s": pp})
            gbs = step_bytes * tg["mean"] / 1e9
            rows.append({"engine": name, "precision": e.precision, "test": f"tg{G}", "tok_s": tg,
                         "GB_s": gbs, "bandwidth_share": gbs / read_bw if read_bw else None})
        base = {r["test"]: r["tok_s"]["mean"] for r in rows if r["engine"] == "sluice"}
        for r in rows:
            r["vs_sluice"] = r["tok_s"]["mean"] / base[r["test"]]
    finally:
        for e in engines.values():
            e.close()
    return {"benchmark": "speed", "settings": s, **env, "cpu_flags": sorted(cpu_flags()),
            "model": {"dir": str(model_dir), "params_read_per_token": params_read,
                      "layers": cfg.num_layers, "kv_per_layer": cfg.num_kv_heads * cfg.head_dim, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size},
            "prompt_head": prompts[-1][:16], "machine": machine, "read_GB_s": read_bw, "engines": engine_info,
            "rows": rows, "speculation": _spec_summary(s["speculation"], spec_rounds, spec_k),
            **_load_record(watch.result())}


def _load_record(load: dict) -> dict:
    """What a results file says of the machine's load: the two load averages at the top level (as
    every results file has them), whether the run was disturbed, and the whole record under "load"."""
    return {"loadavg_at_end": load["loadavg_at_end"], "disturbed": load["disturbed"], "load": load}


def _spec_summary(spec: dict | None, rounds: list[dict], k) -> dict | None:
    """sluice's speculation over all timed rounds: guesses kept / made, decode tokens per target forward."""
    if spec is None:
        return None
    tot = {k: sum(r[k] for r in rounds) for k in ("proposed", "accepted", "target_forwards", "decode_tokens")}
    return {"mode": spec["speculative"], "draft_model": spec["draft_model"], "k": k, **tot,
            "acceptance_rate": tot["accepted"] / tot["proposed"] if tot["proposed"] else 0.0,
            "tokens_per_forward": tot["decode_tokens"] / tot["target_forwards"] if tot["target_forwards"] else 0.0}


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading greedy tokens two engines share (random weights in bf16 may part early)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def print_tables(r: dict) -> None:
    s, cpu = r["settings"], r["cpu"]
    bw = f"{r['read_GB_s']:.1f} GB/s" if r["read_GB_s"] else "not measured"
    print(f"\nmodel: {r['model']['dir']} ({r['model']['params_read_per_token'] / 1e6:.1f} M parameters read "
          f"per token); CPU: {cpu.get('model', '?')}, {r['torch_threads']} threads; avx512_bf16 "
          f"{cpu.get('avx512_bf16')}, amx_bf16 {cpu.get('amx_bf16')}; torch {r['versions']['torch']}; "
          f"read bandwidth between rounds (median) {bw}; {s['reps'] * s.get('passes', 1)} rounds"
          + (f", one engine in memory at a time (--sequential, {s.get('passes', 1)} passes)"
             if s.get("sequential") else ", rotated") + "\n")
    load = r.get("load")
    if load and load["disturbed"]:
        print("DISTURBED RUN (keep these numbers out of the docs): " + "; ".join(load["disturbed_reasons"]) + "\n")
    print("| engine | precision | test | t/s | vs sluice | GB/s | of read bw |")
    print("|---|---|---|---:|---:|---:|---:|")
    for row in r["rows"]:
        t = row["tok_s"]
        gb = f"{row['GB_s']:.1f}" if "GB_s" in row else ""
        share = f"{100 * row['bandwidth_share']:.0f}%" if row.get("bandwidth_share") else ""
        print(f"| {row['engine']} | {row['precision']} | {row['test']} | {t['mean']:.2f} ± {t['std']:.2f} "
              f"| {row['vs_sluice']:.2f}x | {gb} | {share} |")
    sp = r.get("speculation")
    if sp:
        print(f"\nsluice speculates ({sp['mode']}{', draft ' + str(sp['draft_model']) if sp['draft_model'] else ''}, "
              f"k={sp['k']}; tg t/s and GB/s count emitted tokens, not target forwards): acceptance rate {sp['acceptance_rate']:.3f} "
              f"({sp['accepted']}/{sp['proposed']} guesses kept), {sp['tokens_per_forward']:.2f} tokens per "
              f"target forward ({sp['decode_tokens']} tokens / {sp['target_forwards']} forwards over {s['reps'] * s.get('passes', 1)} rounds)")
    agree = {n: e["tokens_agree_with_sluice"] for n, e in r["engines"].items() if n != "sluice"}
    if agree:
        print("\nleading greedy tokens equal to sluice's: "
              + ", ".join(f"{n} {k}/{s['gen'] + 1}" for n, k in agree.items()))
