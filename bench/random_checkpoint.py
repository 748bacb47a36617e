"""A random-weight Hugging Face checkpoint with a real model's shapes, written shard by shard.

    python bench/random_checkpoint.py llama-3-8b --dtype bfloat16 --out /tmp/sluice-ckpt/llama-3-8b-bf16
    python bench/random_checkpoint.py qwen3-0.6b --dtype float32 --out /tmp/sluice-ckpt/qwen3-0.6b

For `sluice profile` on shapes too big to build as a model first: Llama-3-8B in bf16 is 16 GB, and
building it with transformers (an fp32 init, or even a bf16 one, then save_pretrained) needs the
whole model in memory plus a serialisation copy. Here transformers builds the model on the meta
device only, for its tensor names and shapes; each ~1 GB shard is then filled (normal(0, 0.02)
matrices, unit norm gains) directly in the target dtype, saved and freed. Peak memory: one shard.
Speed does not depend on the weights' values, so random weights measure the real step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

# the config.json values of the real checkpoints (Qwen/Qwen3-0.6B, meta-llama/Meta-Llama-3-8B)
SHAPES = {
    "qwen3-0.6b": ("Qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)),
    "llama-3-8b": ("Llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                 bos_token_id=128000, eos_token_id=128001)),
}
SHARD_BYTES = 1 << 30


def write_tokenizer(out: Path, vocab_size: int, eos_id: int) -> None:
    """A byte-level BPE tokenizer with exactly vocab_size ids, so that every id of a random prompt is a
    token both engines know: the 256 byte symbols, then every pair of them, then triples, each with the
    merge that makes it (a real BPE table, as llama.cpp's GGUF loader wants one), and the eos token at
    eos_id. Its merges say nothing about any language: the benchmarks feed token ids, not text."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab, merges = {}, []

    def add(tok: str) -> None:
        if len(vocab) == eos_id:
            vocab["<|endoftext|>"] = eos_id
        if len(vocab) < vocab_size:
            vocab[tok] = len(vocab)

    for a in symbols:
        add(a)
    pairs = [a + b for a in symbols for b in symbols]
    for p in pairs:
        if len(vocab) >= vocab_size:
            break
        add(p)
        merges.append((p[0], p[1]))
    for p in pairs:
        for c in symbols:
            if len(vocab) >= vocab_size:
                break
            add(p + c)
            merges.append((p, c))
    tok = Tokenizer(BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if "<|endoftext|>" in vocab:
        tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=None, help="build fewer layers than the real model")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="weights and config only (by default a byte-level BPE tokenizer of the shape's "
                         "vocabulary size is written too: sluice.LLM and llama.cpp's GGUF need one)")
    args = ap.parse_args(argv)
    import transformers as T

    family, shape = SHAPES[args.shape]
    shape = dict(shape, **({"num_hidden_layers": args.layers} if args.layers else {}))
    cfg = getattr(T, f"{family}Config")(**shape)
    cfg.architectures = [f"{family}ForCausalLM"]
    cfg.dtype = args.dtype
    with torch.device("meta"):
        meta = getattr(T, f"{family}ForCausalLM")(cfg)
    tensors = {n: t for n, t in meta.state_dict().items()
               if not (cfg.tie_word_embeddings and n == "lm_head.weight")}  # tied: stored once
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    groups, current, size = [], [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * dtype.itemsize
        if current and size + nbytes > SHARD_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)
    weight_map, total, t0 = {}, 0, time.perf_counter()
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for n in names:
            t = torch.empty(tensors[n].shape, dtype=dtype)
            if n.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            shard[n] = t
            weight_map[n] = fname
            total += t.nbytes
        save_file(shard, str(args.out / fname), metadata={"format": "pt"})
        del shard
        print(f"{fname}: {len(names)} tensors, {total / 1e9:.1f} GB so far, {time.perf_counter() - t0:.0f} s",
              flush=True)
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg.save_pretrained(args.out)
    if not args.no_tokenizer:
        write_tokenizer(args.out, cfg.vocab_size, cfg.eos_token_id)
    print(f"{args.out}: {total / 1e9:.2f} GB, {len(weight_map)} tensors in {len(groups)} shards")


if __name__ == "__main__":
    main()
