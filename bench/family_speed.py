"""Every family sluice loads, decoding against a Llama of the same size (issue 30: within 0.8x).

For each family a random checkpoint is built with transformers at one shared shape (hidden, layers,
heads, vocabulary; an ungated MLP, GPT-2's and GPT-NeoX's, gets 1.5x the intermediate width so its
two matrices hold as many weights as a gated MLP's three) and saved once into --workdir. Each family
is then loaded by sluice.LLM in --dtype and decodes greedily at batch 1: a random --prompt-token
prompt, then --gen tokens. Families run round by round in rotated order (one untimed warmup each), so
drift and background load hit all alike. A row gives decode tok/s (median over rounds), the weight
bytes one decode step reads, GB/s, and tok/s and GB/s relative to Llama's: the size match is close but
not exact (GPT-2 and GPT-NeoX have no grouped-query attention, so more attention weights), and GB/s
is the fairer ratio for a memory-bound step.

    .venv/bin/python bench/family_speed.py --json docs/results/bench-family-speed.json
    .venv/bin/python bench/family_speed.py --quick --json /tmp/family.json   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from sluice import LLM, SamplingParams
from sluice.benchmarks.common import environment, save_json
from sluice.benchmarks.speed_engines import _weight_bytes
from sluice.engine.gemv import cpu_flags

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import write_tokenizer  # noqa: E402  (a sibling script)

# family -> (config class, model class, config fields beyond the shared shape)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 64, "sliding_window": 4096}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"query_pre_attn_scalar": 64, "sliding_window": 4096}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"ungated": True}),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"ungated": True}),
}
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, vocab_size=32000, max_position_embeddings=2048)
QUICK = dict(SHAPE, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=512)


def build(family: str, shape: dict, out: Path) -> Path:
    """The family's random checkpoint at `shape`, saved once (reused when out already holds it)."""
    if (out / "config.json").is_file():
        return out
    import transformers as T
    cfg_name, model_name, extra = FAMILIES[family]
    extra = dict(extra)
    kw = dict(shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if extra.pop("ungated", False):
        kw["intermediate_size"] = shape["intermediate_size"] * 3 // 2
        kw["num_key_value_heads"] = None  # no grouped-query attention in these families
    if family == "gpt2":  # GPT-2 spells its sizes its own way
        kw.update(n_embd=kw.pop("hidden_size"), n_layer=kw.pop("num_hidden_layers"),
                  n_head=kw.pop("num_attention_heads"), n_inner=kw.pop("intermediate_size"),
                  n_positions=kw.pop("max_position_embeddings"))
    cfg = getattr(T, cfg_name)(**{k: v for k, v in {**kw, **extra}.items() if v is not None})
    cfg.architectures = [model_name]
    torch.manual_seed(0)
    model = getattr(T, model_name)(cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tokenizer(out, cfg.vocab_size, 2)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma list (llama is always included)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--gen", type=int, default=128, help="decode tokens (default 128)")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds per family, interleaved (default 3)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/sluice-family-speed"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one round: a smoke test, not a measurement")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    names = [f for f in args.families.split(",") if f]
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        print(f"family_speed.py: error: unknown families {unknown}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
        sys.exit(2)
    if "llama" not in names:
        names.insert(0, "llama")
    shape = QUICK if args.quick else SHAPE
    reps, gen = (1, min(args.gen, 8)) if args.quick else (args.reps, args.gen)
    env = environment()
    tag = "quick" if args.quick else "full"
    llms = {}
    for f in names:
        d = build(f, shape, args.workdir / f"{tag}-{f}")
        llms[f] = LLM(d, dtype=args.dtype)
    prompt = torch.randint(0, shape["vocab_size"], (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=gen + 1, temperature=0, ignore_eos=True)
    samples = {f: [] for f in names}
    paths = {}
    for f in names:  # untimed warmup: kernels built, weights paged in
        llms[f].generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for r in range(reps):
        for f in names[r % len(names):] + names[:r % len(names)]:
            llms[f].generate([prompt], params)
            s = llms[f].last_stats
            samples[f].append(gen / s.decode_seconds)
            print(f"family_speed: round {r + 1}/{reps} {f}: {samples[f][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    rows = []
    for f in names:
        llm = llms[f]
        fwd = llm.batch_engine().scheduler.forward  # which path the decode steps took
        paths[f] = "native step" if fwd.use_fast else f"torch ({fwd.native_reason})"
        wb = _weight_bytes(llm.model)
        tok_s = statistics.median(samples[f])
        rows.append({"family": f, "params": sum(p.numel() for p in llm.model.parameters()), "weight_bytes": wb,
                     "tok_s": tok_s, "samples": samples[f], "GB_s": wb * tok_s / 1e9,
                     "path": paths[f]})
    base = next(r for r in rows if r["family"] == "llama")
    for r in rows:
        r["tok_s_vs_llama"] = r["tok_s"] / base["tok_s"]
        r["GB_s_vs_llama"] = r["GB_s"] / base["GB_s"]
    result = {"benchmark": "family_speed", **env, "cpu_flags": sorted(cpu_flags()), "quick": args.quick,
              "shape": shape, "dtype": args.dtype, "prompt": args.prompt, "gen": gen, "reps": reps,
              "rows": rows, "loadavg_at_end": list(os.getloadavg()), "date_end": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    print(f"\n{args.dtype}, batch 1, greedy, prompt {args.prompt}, decode {gen}; CPU {env['cpu'].get('model')}, "
          f"{env['torch_threads']} threads; median of {reps} rounds\n")
    print("| family | params (M) | weight MB / token | decode tok/s | GB/s | tok/s vs llama | GB/s vs llama | path |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['family']} | {r['params'] / 1e6:.0f} | {r['weight_bytes'] / 1e6:.0f} | {r['tok_s']:.1f} | "
              f"{r['GB_s']:.1f} | {r['tok_s_vs_llama']:.2f}x | {r['GB_s_vs_llama']:.2f}x | {r['path']} |")
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
