"""The bundled model's quality three ways (sluice.training.quality), for one or more trained models.

    python bench/bundled_quality.py --json bench/bundled_quality.json            # the bundled model
    python bench/bundled_quality.py --models runs/a/model runs/b/model --json o.json

Per model: held-out stdlib bits per byte (its training.json, written by train.write_card at export;
--recompute evaluates again), bits per byte on code from outside the standard library (the packages
in quality.OUTSIDE_PACKAGES, versions recorded) next to gzip -9 and xz -9e on the same text, and
how many greedy completions of quality.PROMPTS parse with `ast` once cut at their last complete line
(as typed, and again after the corpus' file separator <|endoftext|>, which says "a file starts here").
Models are evaluated in fp32 on non-overlapping windows of the recipe's train.seq_len.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

import sluice
from sluice.model.loading import bundled_model_dir
from sluice.training import quality
from sluice.training.corpus import (Corpus, compression_baselines, encode_paths, load_corpus,
                                    token_byte_lengths)
from sluice.training.recipe import Recipe
from sluice.training.train import evaluate

from common import environment, save_json


def bpb(model, tok: HFTokenizer, texts: list[str], seq_len: int) -> dict:
    stream, nbytes = encode_paths(tok, texts, tok.token_to_id("<|endoftext|>"))
    ev = evaluate(model, stream, token_byte_lengths(tok), seq_len, stream.size, autocast=False)
    return {**ev, "text_bytes": nbytes}


def recipe_of(model_dir: Path) -> Recipe:
    """The bundled model's recipe.toml, or the recipe.json that `sluice train` exports."""
    if (model_dir / "recipe.toml").is_file():
        return Recipe.load(model_dir / "recipe.toml")
    raw = json.loads((model_dir / "recipe.json").read_text())
    raw.pop("path", None)
    return Recipe.from_dict(raw, source=str(model_dir / "recipe.json"))


def one(model_dir: Path, outside_texts: list[str], recompute: bool, max_tokens: int) -> dict:
    recipe = recipe_of(model_dir)
    seq_len = recipe.train.seq_len
    tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = sluice.load(model_dir, "float32")
    t0 = time.perf_counter()
    card = json.loads((model_dir / "training.json").read_text()) if (model_dir / "training.json").is_file() else {}
    if recompute or "heldout" not in card:
        held = [Corpus.read(p) for p in load_corpus(recipe.corpus).heldout]
        heldout = bpb(model, tok, held, seq_len)
    else:
        heldout = card["heldout"]
    outside = bpb(model, tok, outside_texts, seq_len)
    del model
    llm = sluice.LLM(model_dir)
    parse = quality.completion_parse_share(llm, max_tokens=max_tokens)
    # The same prompts after the corpus' file separator: "this starts a file" (a top-level def)
    parse_start = quality.completion_parse_share(llm, max_tokens=max_tokens, start_token="<|endoftext|>")
    return {"model": str(model_dir), "params": card.get("params"), "tokens_seen": card.get("tokens_seen"),
            "train_wall_seconds": card.get("train_wall_seconds"),
            "heldout_bpb": heldout["bpb"], "heldout": heldout, "heldout_baselines": card.get("baselines", {}),
            "outside_bpb": outside["bpb"], "outside": outside, "parse": parse, "parse_file_start": parse_start,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", help="model directories (default: the bundled model)")
    ap.add_argument("--recompute", action="store_true",
                    help="evaluate the held-out split again instead of reading training.json")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per greedy completion")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    files, versions = quality.outside_files()
    texts = [Corpus.read(p) for p in files]
    base = compression_baselines(texts)
    res = {"env": environment(), "outside_set": {"packages": versions, "files": len(files), **base},
           "models": []}
    print(f"outside-stdlib set: {len(files)} files, {base['bytes']:,} bytes, "
          f"gzip -9 {base['gzip-9']:.3f}, xz -9e {base['xz-9e']:.3f} bits/byte ({versions})")
    for d in args.models or [bundled_model_dir()]:
        r = one(Path(d), texts, args.recompute, args.max_tokens)
        res["models"].append(r)
        print(f"{d}: held-out stdlib {r['heldout_bpb']:.3f} bits/byte, outside {r['outside_bpb']:.3f} "
              f"({r['outside_bpb'] / base['xz-9e'] - 1:+.1%} vs xz -9e), completions parsing "
              f"{r['parse']['parsed']}/{r['parse']['prompts']} ({r['parse_file_start']['parsed']} after the file "
              f"separator)  [{r['seconds']} s]", flush=True)
    save_json(args.json, res)


if __name__ == "__main__":
    main()
