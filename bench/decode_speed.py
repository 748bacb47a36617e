"""Decode speed: sluice vs transformers on a random checkpoint with Qwen3-0.6B's shapes (CPU).

    python bench/decode_speed.py --json bench/decode_speed.json        # full run
    python bench/decode_speed.py --quick --workdir /tmp/x --json o.json  # seconds-long smoke test

Batch 1, greedy, a fixed random prompt, every token generated (ignore_eos / min_new_tokens), so
both engines do exactly the same work. Engines are interleaved within each repetition (A, B, A,
B, ...) so a background load or thermal drift hits all of them alike; medians are reported.
bf16 rows are measured and printed as they are: on a CPU without AVX-512/AMX they are slower.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import environment, save_json

# Qwen3-0.6B's shapes (its config.json); weights are random, speed does not depend on them.
FULL = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
            max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
QUICK = dict(FULL, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=256, vocab_size=4096, max_position_embeddings=512)


def build_checkpoint(workdir: Path, shape: dict, name: str) -> Path:
    """A random Qwen3 checkpoint (fp32 safetensors) + a tokenizer covering every id; cached."""
    out = workdir / name
    if (out / "done").is_file():
        return out
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    cfg = T.Qwen3Config(**shape, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    # One fp32 copy (~2.4 GB at full size) lives only while it is written; nothing else is kept.
    model = T.Qwen3ForCausalLM(cfg)
    model.save_pretrained(out)
    del model
    # Prompts are token ids, so the tokenizer only has to *decode* (sluice streams text while it
    # generates). A word-level vocab "t0".."tN" covers every id and loads in a fraction of a second.
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "done").write_text("ok\n")
    return out


def memcpy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a large tensor copy, counting read + write (a decode step only reads weights,
    so this is the memory system's rate for streaming bytes, which is what bounds decode)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first so page faults are not timed
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied embeddings are one
    tensor, read whole by the LM head). An untied embedding contributes one row only."""
    total = sum(p.nbytes for p in model.parameters())  # parameters() lists a tied tensor once
    cfg = model.config
    if not cfg.tie_word_embeddings:
        total -= model.embed.weight.nbytes - model.embed.weight[0].nbytes
    return total


def forward_path(llm) -> str:
    """Which forward the engine's last busy period ran: the native step, or torch's and why."""
    fwd = llm.batch_engine().scheduler.forward
    return "native step" if fwd.use_fast else f"torch forward: {fwd.native_reason}"


def sluice_run(llm, prompt: list[int], new: int):
    import sluice
    out = llm.generate([prompt], sluice.SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == new, f"sluice generated {len(out.token_ids)} tokens, not {new}"
    s = llm.last_stats
    return s.prefill_tok_s, s.decode_tok_s, out.token_ids


@torch.inference_mode()
def hf_run(model, prompt: list[int], new: int):
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    # Prefill = a 1-token generate: the prompt forward plus picking the first token, which is what
    # sluice's prefill_seconds covers too.
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    t_total = time.perf_counter() - t0
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == new, f"transformers generated {len(tokens)} tokens, not {new}"
    # The first token comes out of prefill; the remaining new - 1 are decode steps.
    decode_s = max(t_total - t_prefill, 1e-9)
    return len(prompt) / t_prefill, (new - 1) / decode_s, tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/sluice-bench"), help="checkpoint cache")
    ap.add_argument("--json", type=Path, default=None, help="write results here as JSON")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-compile", action="store_true", help="skip the sluice compile=True rows")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shape, 16-token prompt, 8 new tokens, 1 rep: a smoke test, not a benchmark")
    args = ap.parse_args(argv)
    shape, name = FULL, "qwen3-0.6b-random"
    copy_bytes = 1 << 30  # far above any last-level cache, so this measures DRAM
    if args.quick:
        shape, name, copy_bytes = QUICK, "quick-random", 64 << 20
        args.reps, args.prompt_tokens, args.new_tokens = 1, 16, 8

    import transformers as T

    import sluice

    t0 = time.perf_counter()
    model_dir = build_checkpoint(args.workdir, shape, name)
    print(f"checkpoint {model_dir} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    bandwidth = memcpy_bandwidth(copy_bytes)
    prompt = torch.randint(1, shape["vocab_size"], (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    max_len = args.prompt_tokens + args.new_tokens

    # (engine, dtype) -> a callable returning (prefill tok/s, decode tok/s, token ids).
    engines, llms = {}, {}
    bound, wbytes, errors = {}, {}, {}
    for dtype in args.dtypes.split(","):
        llm = sluice.LLM(model_dir, dtype=dtype, max_model_len=max_len)
        wbytes[dtype] = weight_bytes_per_token(llm.model)
        bound[dtype] = bandwidth / wbytes[dtype]
        engines[("sluice", dtype)] = lambda m=llm: sluice_run(m, prompt, args.new_tokens)
        llms[("sluice", dtype)] = llm
        if not args.no_compile:
            # compile is an option of the engine's step, fixed when the LLM is made: a second LLM, a
            # second copy of the weights (the compiled torch forward replaces the native step there).
            compiled = sluice.LLM(model_dir, dtype=dtype, max_model_len=max_len, compile=True)
            engines[("sluice compile", dtype)] = lambda m=compiled: sluice_run(m, prompt, args.new_tokens)
            llms[("sluice compile", dtype)] = compiled
        hf = T.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                attn_implementation="sdpa").eval()
        engines[("transformers", dtype)] = lambda m=hf: hf_run(m, prompt, args.new_tokens)

    # Warmup (untimed): first calls pay for compilation, allocator growth and lazy init.
    tokens = {}
    for key, fn in list(engines.items()):
        t0 = time.perf_counter()
        try:
            tokens[key] = fn()[2]
        except Exception as e:  # a compile failure is a result to report, not a crash
            errors[" ".join(key)] = f"{type(e).__name__}: {e}"[:500]
            del engines[key]
        print(f"warmup {' '.join(key)}: {time.perf_counter() - t0:.1f} s", flush=True)

    samples = {key: ([], []) for key in engines}
    for rep in range(args.reps):
        for key, fn in engines.items():  # interleaved: every engine once per repetition
            prefill, decode, _ = fn()
            samples[key][0].append(prefill)
            samples[key][1].append(decode)
        print(f"rep {rep + 1}/{args.reps} done", flush=True)

    rows = []
    for (engine, dtype), (pre, dec) in samples.items():
        path = forward_path(llms[(engine, dtype)]) if (engine, dtype) in llms else None
        rows.append({"engine": engine, "dtype": dtype, "forward": path,
                     "prefill_tok_s": statistics.median(pre), "decode_tok_s": statistics.median(dec),
                     "prefill_samples": pre, "decode_samples": dec,
                     "decode_bound_fraction": statistics.median(dec) / bound[dtype]})
    ref = {r["dtype"]: r for r in rows if r["engine"] == "transformers"}
    for r in rows:
        base = ref.get(r["dtype"])
        r["prefill_vs_transformers"] = r["prefill_tok_s"] / base["prefill_tok_s"] if base else None
        r["decode_vs_transformers"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
    agree = {d: common_prefix(tokens[("sluice", d)], tokens[("transformers", d)])
             for d in wbytes if ("sluice", d) in tokens and ("transformers", d) in tokens}

    result = {"benchmark": "decode_speed", "quick": args.quick, "checkpoint": str(model_dir),
              "shape": shape, "batch_size": 1, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "reps": args.reps, **environment(),
              "memcpy_bytes": copy_bytes, "memcpy_GB_s": bandwidth / 1e9,
              "weight_bytes_per_token": wbytes, "decode_bound_tok_s": bound,
              "greedy_agreement_prefix": agree, "errors": errors, "rows": rows}
    print_table(result)
    save_json(args.json, result)
    return result


def print_table(r: dict) -> None:
    cpu = r["cpu"]
    print(f"\n### Decode speed: batch 1, {r['prompt_tokens']}-token prompt, {r['new_tokens']} new "
          f"tokens, greedy, median of {r['reps']}{' (QUICK: smoke test only)' if r['quick'] else ''}\n")
    print(f"CPU: {cpu.get('model', '?')}, {cpu.get('torch_threads')} torch threads, "
          f"AVX-512 bf16: {cpu.get('avx512_bf16')}, AMX bf16: {cpu.get('amx_bf16')}; "
          f"memcpy {r['memcpy_GB_s']:.1f} GB/s (read + write)\n")
    print("| engine | dtype | sluice's forward | prefill tok/s | decode tok/s | prefill vs transformers "
          "| decode vs transformers | decode / bandwidth bound |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    ratio = lambda x: f"{x:.2f}x" if x is not None else "-"  # noqa: E731
    for row in r["rows"]:
        print(f"| {row['engine']} | {row['dtype']} | {row.get('forward') or '-'} "
              f"| {row['prefill_tok_s']:.1f} | {row['decode_tok_s']:.2f} "
              f"| {ratio(row['prefill_vs_transformers'])} | {ratio(row['decode_vs_transformers'])} "
              f"| {100 * row['decode_bound_fraction']:.0f}% |")
    print("\nBandwidth bound (weight bytes per token / memcpy rate): " + ", ".join(
        f"{d}: {r['weight_bytes_per_token'][d] / 1e6:.1f} MB/token -> {b:.1f} tok/s"
        for d, b in r["decode_bound_tok_s"].items()))
    by = {(x["engine"], x["dtype"]): x for x in r["rows"]}
    if ("sluice", "float32") in by and ("sluice", "bfloat16") in by:
        f32, b16 = by[("sluice", "float32")], by[("sluice", "bfloat16")]
        print(f"bf16 / fp32 (sluice): prefill {b16['prefill_tok_s'] / f32['prefill_tok_s']:.2f}x, "
              f"decode {b16['decode_tok_s'] / f32['decode_tok_s']:.2f}x")
    print("Greedy tokens identical to transformers for the first N: "
          + ", ".join(f"{d}: {n}/{r['new_tokens']}" for d, n in r["greedy_agreement_prefix"].items()))
    for key, err in r["errors"].items():
        print(f"FAILED {key}: {err}")


if __name__ == "__main__":
    main()
