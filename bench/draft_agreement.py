"""How well the bundled draft predicts the bundled model: held-out bits per byte of both, and the
greedy agreement that decides speculative decoding's acceptance rate.

    python bench/draft_agreement.py --json docs/results/draft-agreement.json

Agreement: prompts are windows of the held-out stdlib files (the recipe's split, never trained on);
the main model continues each greedily; then both models read prompt + that continuation in one
forward (teacher forcing) and we count the positions where the draft's argmax equals the main
model's. Along the main model's greedy path this is exact for greedy speculation: a draft proposal
is conditioned on the accepted tokens, which are the main model's, so "tokens per target forward"
for k speculated tokens follows from the agreement sequence alone (accept the run of matches, at
most k, then the target's own token). Bits per byte: each model's training.json, which
training/train.py's write_card computed with `evaluate` on the whole held-out split (--recompute-bpb
runs that evaluation again).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

import sluice
from sluice.engine.kv_cache import KVCache
from sluice.model.loading import bundled_draft_dir, bundled_model_dir
from sluice.training.corpus import encode_paths, load_corpus, token_byte_lengths
from sluice.training.recipe import Recipe
from sluice.training.train import evaluate

from common import environment, save_json


def prompts(files: list[Path], tok: HFTokenizer, n: int, length: int, new: int) -> torch.Tensor:
    """n windows of `length` tokens, from the files in turn (a file long enough for a window plus its
    continuation gives one at 1/3 of its tokens, then at 2/3, ...), so no file dominates."""
    streams = [tok.encode(p.read_bytes().decode("utf-8", errors="replace"), add_special_tokens=False).ids
               for p in files]
    streams = [s for s in streams if len(s) >= length + new]
    out, rnd = [], 1
    while len(out) < n and streams:
        for s in streams:
            start = min(len(s) * rnd // (rnd + 2), len(s) - length - new)
            out.append(s[start:start + length])
            if len(out) == n:
                break
        rnd += 1
    return torch.tensor(out)


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """The main model's greedy continuation (B, new), batched, on its KV cache."""
    B, T = ids.shape
    cache = KVCache(model.config, B, T + new)
    logits = model(ids, cache=cache)[:, -1]
    out = []
    for i in range(new):
        nxt = logits.argmax(-1)  # (B,)
        out.append(nxt)
        if i + 1 < new:
            pos = torch.full((B, 1), T + i)
            logits = model(nxt[:, None], positions=pos, cache=cache)[:, -1]
    return torch.stack(out, 1)


def tokens_per_forward(match: np.ndarray, k: int) -> float:
    """Greedy speculation with k guesses along one path: each target forward accepts the run of
    matching guesses (at most k) and adds its own token."""
    i, forwards = 0, 0
    while i < match.size:
        run = 0
        while run < k and i + run < match.size and match[i + run]:
            run += 1
        i += run + 1
        forwards += 1
    return match.size / forwards


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--main", help="target model directory (default: the bundled model)")
    ap.add_argument("--draft", help="draft model directory (default: the bundled draft)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--recompute-bpb", action="store_true",
                    help="evaluate both models on the held-out split now instead of reading training.json")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    main_dir = Path(args.main) if args.main else bundled_model_dir()
    draft_dir = Path(args.draft) if args.draft else bundled_draft_dir()
    if (main_dir / "tokenizer.json").read_bytes() != (draft_dir / "tokenizer.json").read_bytes():
        raise SystemExit("the draft's tokenizer.json differs from the main model's")
    tok = HFTokenizer.from_file(str(main_dir / "tokenizer.json"))
    recipe = Recipe.load(main_dir / "recipe.toml")
    held = load_corpus(recipe.corpus).heldout
    big, small = sluice.load(main_dir, "float32"), sluice.load(draft_dir, "float32")

    t0 = time.perf_counter()
    ids = prompts(held, tok, args.prompts, args.prompt_tokens, args.new_tokens)
    cont = greedy(big, ids, args.new_tokens)
    seq = torch.cat([ids, cont], 1)
    P = ids.shape[1]
    with torch.no_grad():  # logits at P-1 .. end-1 predict the continuation's tokens
        big_top = big(seq)[:, P - 1:-1].argmax(-1)
        small_top = small(seq)[:, P - 1:-1].argmax(-1)
    match = (small_top == big_top).numpy()
    per_prompt = match.mean(1)
    spec = {k: float(np.mean([tokens_per_forward(m, k) for m in match])) for k in range(1, 9)}
    agree_s = time.perf_counter() - t0

    if args.recompute_bpb:  # what write_card did at export, again, on these weights
        texts = [p.read_bytes().decode("utf-8", errors="replace") for p in held]
        stream, _ = encode_paths(tok, texts, tok.token_to_id("<|endoftext|>"))
        bpb = {name: evaluate(m, stream, token_byte_lengths(tok), recipe.train.seq_len, stream.size,
                              autocast=False) for name, m in (("main", big), ("draft", small))}
    else:  # the cards' numbers, written by that code when each model was exported
        bpb = {name: json.loads((d / "training.json").read_text())["heldout"]
               for name, d in (("main", main_dir), ("draft", draft_dir))}
    nbytes = bpb["main"]["bytes"]

    res = {"main": str(main_dir), "draft": str(draft_dir),
           "params": {"main": big.config.num_params, "draft": small.config.num_params},
           "prompts": len(ids), "prompt_tokens": P, "new_tokens": args.new_tokens,
           "prompt_files": sorted({p.name for p in held}),
           "greedy_agreement": float(match.mean()),
           "agreement_per_prompt": {"min": float(per_prompt.min()), "median": float(np.median(per_prompt)),
                                    "max": float(per_prompt.max())},
           "main_teacher_forced_equals_its_greedy": float((big_top == cont).float().mean()),
           "tokens_per_target_forward": spec,
           "heldout_bpb": {k: v["bpb"] for k, v in bpb.items()}, "heldout_bytes": nbytes,
           "heldout_tokens": bpb["main"]["tokens"], "bpb_recomputed": args.recompute_bpb,
           "agreement_seconds": round(agree_s, 1),
           "environment": environment()}
    print(f"params: main {res['params']['main']:,}, draft {res['params']['draft']:,} "
          f"({res['params']['main'] / res['params']['draft']:.1f}x fewer)")
    print(f"greedy agreement over {len(ids)} prompts x {args.new_tokens} tokens: {match.mean():.3f} "
          f"(per prompt {per_prompt.min():.3f} .. {per_prompt.max():.3f}, median {np.median(per_prompt):.3f})")
    print(f"(main model, teacher-forced, equals its own cached greedy tokens at "
          f"{res['main_teacher_forced_equals_its_greedy']:.3f} of positions)")
    print("tokens per target forward, greedy, k guesses: "
          + ", ".join(f"k={k} {v:.2f}" for k, v in spec.items()))
    print(f"held-out bits/byte ({nbytes:,} bytes): main {bpb['main']['bpb']:.3f}, draft {bpb['draft']['bpb']:.3f}")
    if args.json:
        save_json(Path(args.json), res)
    return res


if __name__ == "__main__":
    main()
