"""What a bf16 KV cache (LLM(kv_cache_dtype="bfloat16")) does to a model's numbers, against the fp32 cache.

    python bench/kv_cache_dtype.py --json docs/results/kv-cache-bf16-bundled.json   # the bundled model, fp32

The prompt is the first --tokens tokens of the bundled corpus's held-out files (bench/inspect_scale.py's
corpus_prompt). With the fp32 cache the model continues it greedily for --gen tokens; then that whole sequence
is fed again through both caches, teacher-forced (the prompt as one prefill, each continuation token as a decode
step, as the engine runs them), and the logits at every position compared: the largest difference relative to
the position's largest fp32 logit, the KL divergence of the bf16 cache's next-token distribution from the fp32
one's, and whether the argmax agrees. Then the bf16 cache continues the prompt greedily on its own: how many of
its tokens equal the fp32 run's before the first difference. The step is the engine's, the native one
(fast_step.py) where it runs the model, else the torch forward; both caches are static (kv_cache.KVCache), which
holds the same slots as the engine's paged pool. Also written: the cache's bytes per token in each dtype.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from common import cpu_info, save_json
from inspect_scale import corpus_prompt

from sluice.benchmarks.common import code_version
from sluice.engine import fast_step
from sluice.engine.kv_cache import KVCache
from sluice.model import load
from sluice.model.loading import bundled_model_dir
from sluice.text.tokenizer import Tokenizer


def stepper(model):
    """(forward(tokens (1, T), positions (1, T), cache) -> fp32 logits (1, T, V), which path)."""
    if fast_step.kernel() is not None and fast_step.unsupported(model) is None:
        step = fast_step.FastStep(model)
        return (lambda t, p, c: step(t, p, c.k, c.v)), "native"
    return (lambda t, p, c: model(t, p, c).float()), "torch"


@torch.inference_mode()
def teacher_forced(forward, cfg, ids: list[int], n_prompt: int, dtype: torch.dtype) -> torch.Tensor:
    """Logits (len(ids), V) at every position: the prompt as one chunk, then one token a step."""
    cache = KVCache(cfg, 1, len(ids), dtype)
    t = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    outs = [forward(t[:, :n_prompt], pos[:, :n_prompt], cache)[0]]
    outs += [forward(t[:, i:i + 1], pos[:, i:i + 1], cache)[0] for i in range(n_prompt, len(ids))]
    return torch.cat(outs)


@torch.inference_mode()
def greedy(forward, cfg, prompt: list[int], gen: int, dtype: torch.dtype) -> list[int]:
    cache = KVCache(cfg, 1, len(prompt) + gen, dtype)
    logits = forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)[0, -1]
    out = []
    for i in range(gen):
        out.append(int(logits.argmax()))
        if i + 1 < gen:
            logits = forward(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + i]]), cache)[0, -1]
    return out


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Per position: |got - ref| max over the vocabulary / max |ref|, KL(ref || got) of the softmaxes, argmax equal."""
    rel = ((got - ref).abs().amax(-1) / ref.abs().amax(-1)).tolist()
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0).tolist()
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    return {"positions": len(rel), "rel_max": max(rel), "rel_median": statistics.median(rel),
            "kl_max": max(kl), "kl_median": statistics.median(kl), "argmax_agree": agree}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--dtype", default="float32", help="the weights: float32 (default) or bfloat16")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--gen", type=int, default=128, help="greedy continuation tokens (default 128)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    model_dir = Path(args.model) if args.model else bundled_model_dir()
    model = load(model_dir, dtype=args.dtype)
    if args.dtype == "bfloat16":
        from sluice.engine import mixed
        mixed.use_fp32_compute(model)  # what LLM(dtype="bfloat16") runs on the native step: fp32 activations
    tok = Tokenizer.from_pretrained(model_dir)
    cfg = model.config
    prompt = tok.encode(corpus_prompt(tok, args.tokens))
    if len(prompt) + args.gen > cfg.max_position_embeddings:
        print(f"kv_cache_dtype: {len(prompt)} + {args.gen} tokens exceed the model's context", file=sys.stderr)
        return 2
    forward, path = stepper(model)
    cont32 = greedy(forward, cfg, prompt, args.gen, torch.float32)
    ids = prompt + cont32
    ref = teacher_forced(forward, cfg, ids, len(prompt), torch.float32)
    got = teacher_forced(forward, cfg, ids, len(prompt), torch.bfloat16)
    n = len(prompt)
    cont16 = greedy(forward, cfg, prompt, args.gen, torch.bfloat16)
    same = next((i for i, (a, b) in enumerate(zip(cont32, cont16, strict=True)) if a != b), args.gen)
    result = {"benchmark": "kv_cache_dtype", "cpu": cpu_info(), "code": code_version(),
              "model": "bundled" if args.model is None else str(model_dir), "weights": args.dtype, "path": path,
              "prompt_tokens": n, "gen": args.gen,
              "kv_bytes_per_token": {"float32": KVCache.nbytes_for(cfg, 1, 1, torch.float32),
                                     "bfloat16": KVCache.nbytes_for(cfg, 1, 1, torch.bfloat16)},
              # position i's logits predict token i + 1: the prompt's last position is the first generated token's
              "prompt": compare(ref[:n - 1], got[:n - 1]), "generated": compare(ref[n - 1:], got[n - 1:]),
              "greedy_same_prefix": same}
    for part in ("prompt", "generated"):
        r = result[part]
        print(f"{part:9s} {r['positions']:4d} positions: logits differ by up to {r['rel_max']:.2e} of their scale "
              f"(median {r['rel_median']:.2e}); KL up to {r['kl_max']:.2e} (median {r['kl_median']:.2e}); "
              f"argmax agrees at {r['argmax_agree']:.1%}")
    print(f"greedy with the bf16 cache: its first {same} of {args.gen} tokens equal the fp32 cache's ({path} step); "
          f"{result['kv_bytes_per_token']['bfloat16']:,} bytes a token against "
          f"{result['kv_bytes_per_token']['float32']:,}")
    save_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
