"""Training speed: tokens/s of one optimizer step, sluice vs transformers, on the bundled model's shape.

    python bench/train_speed.py --json bench/train_speed.json   # full run
    python bench/train_speed.py --quick --json o.json            # seconds-long smoke test

A step is what src/sluice/training/train.py does: forward, cross-entropy on fp32 logits, backward, gradient
clipping, fused AdamW step. Every configuration sees the same random token batches, configurations
are interleaved step by step (A, B, A, B, ...) so background load hits them alike, warmup steps
(which also pay for torch.compile) are excluded, and medians are reported. bf16 autocast rows are
measured and printed as they are: on a CPU without AVX-512/AMX bf16 matmuls are slow.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import environment, save_json

RECIPE = Path(__file__).resolve().parents[1] / "src" / "sluice" / "training" / "recipes" / "stdlib.toml"
CONFIGS = ("transformers fp32", "transformers bf16-autocast", "sluice fp32", "sluice bf16-autocast",
           "sluice compile fp32")


def model_config(recipe_path: Path, quick: bool):
    """sluice's ModelConfig exactly as `sluice train` builds it from the recipe."""
    from sluice.training.recipe import Recipe
    from sluice.training.train import model_config as train_model_config

    recipe = Recipe.load(recipe_path)
    cfg = train_model_config(recipe, recipe.tokenizer.vocab_size, sep_id=0)
    if quick:
        cfg = dataclasses.replace(cfg, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                  head_dim=32, intermediate_size=128, vocab_size=512)
    return recipe, cfg


def hf_model(cfg):
    """The same shape as a transformers Qwen3ForCausalLM (random init, sdpa attention)."""
    import transformers as T
    hf_cfg = T.Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                           num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                           rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
                           tie_word_embeddings=cfg.tie_word_embeddings, attention_dropout=0.0,
                           use_cache=False, attn_implementation="sdpa")
    model = T.Qwen3ForCausalLM(hf_cfg)
    # transformers returns an output object; the loss is computed outside, identically for all.
    return model, lambda x: model(input_ids=x, use_cache=False).logits


def sluice_model(cfg, init_std: float):
    from sluice.model import Transformer
    model = Transformer(cfg)
    model.init_weights(init_std, torch.Generator().manual_seed(0))
    return model, model


class Config:
    """One row of the table: a model, its optimizer, and how its forward runs."""

    def __init__(self, name: str, cfg, t):
        self.name = name
        torch.manual_seed(0)
        model, fwd = hf_model(cfg) if name.startswith("transformers") else sluice_model(cfg, t.init_std)
        self.model = model.train()
        # Compiled exactly as train.py does: torch.compile of the whole module, default mode.
        self.forward = torch.compile(fwd) if "compile" in name else fwd
        self.autocast = "bf16-autocast" in name
        self.grad_clip = t.grad_clip
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=t.lr, betas=tuple(t.betas), fused=True)
        self.params = sum(p.numel() for p in model.parameters())  # tied weights counted once

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.forward(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="the model shape comes from its [model]")
    ap.add_argument("--json", type=Path, default=None, help="write results here as JSON")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--quick", action="store_true",
                    help="tiny shape, batch 2 x 32 tokens, 1 warmup + 1 timed step: a smoke test")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    if args.quick:
        args.micro_batch, args.seq_len, args.reps, args.warmup = 2, 32, 1, 1



    recipe, cfg = model_config(args.recipe, args.quick)
    t = recipe.train
    configs, errors = [Config(name, cfg, t) for name in names], {}
    # Random tokens: speed does not depend on the data, and every configuration gets the same ones.
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=gen)
               for _ in range(args.warmup + args.reps)]

    times = {c.name: [] for c in configs}
    losses = {c.name: [] for c in configs}
    for i, window in enumerate(batches):
        x, y = window[:, :-1], window[:, 1:]
        for c in list(configs):  # interleaved: every configuration takes step i before step i + 1
            t0 = time.perf_counter()
            try:
                loss = c.step(x, y)
            except Exception as e:  # e.g. a compile failure: report it, keep measuring the rest
                errors[c.name] = f"{type(e).__name__}: {e}"[:500]
                configs.remove(c)
                continue
            dt = time.perf_counter() - t0
            losses[c.name].append(loss)
            if i >= args.warmup:
                times[c.name].append(dt)
            print(f"step {i + 1}/{len(batches)} {c.name}: {dt:.2f} s, loss {loss:.3f}"
                  f"{' (warmup)' if i < args.warmup else ''}", flush=True)

    tokens = args.micro_batch * args.seq_len
    rows = []
    for c in configs:
        sec = statistics.median(times[c.name])
        rows.append({"config": c.name, "step_seconds": sec, "tok_s": tokens / sec,
                     "step_samples": times[c.name], "params": c.params,
                     "first_loss": losses[c.name][0], "last_loss": losses[c.name][-1]})
    base = next((r for r in rows if r["config"] == "transformers fp32"), None)
    for r in rows:
        r["vs_transformers_fp32"] = r["tok_s"] / base["tok_s"] if base else None

    result = {"benchmark": "train_speed", "quick": args.quick, "recipe": str(args.recipe),
              "model": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                     "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                     "tie_word_embeddings")},
              "micro_batch": args.micro_batch, "seq_len": args.seq_len, "tokens_per_step": tokens,
              "reps": args.reps, "warmup": args.warmup, **environment(),
              "errors": errors, "rows": rows}
    print_table(result)
    save_json(args.json, result)
    return result


def print_table(r: dict) -> None:
    cpu, m = r["cpu"], r["model"]
    print(f"\n### Training speed: micro-batch {r['micro_batch']} x {r['seq_len']} tokens, median of "
          f"{r['reps']} steps after {r['warmup']} warmup{' (QUICK: smoke test only)' if r['quick'] else ''}\n")
    print(f"Model: hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']}/{m['num_kv_heads']} "
          f"heads, head_dim {m['head_dim']}, intermediate {m['intermediate_size']}, vocab {m['vocab_size']}. "
          f"CPU: {cpu.get('model', '?')}, {cpu.get('torch_threads')} torch threads, "
          f"AVX-512 bf16: {cpu.get('avx512_bf16')}, AMX bf16: {cpu.get('amx_bf16')}\n")
    print("| config | step s | tokens/s | vs transformers fp32 |")
    print("|---|---:|---:|---:|")
    for row in r["rows"]:
        ratio = f"{row['vs_transformers_fp32']:.2f}x" if row["vs_transformers_fp32"] is not None else "-"
        print(f"| {row['config']} | {row['step_seconds']:.3f} | {row['tok_s']:.0f} | {ratio} |")
    for name, err in r["errors"].items():
        print(f"FAILED {name}: {err}")


if __name__ == "__main__":
    main()
