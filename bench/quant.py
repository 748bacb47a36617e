"""Weight-only quantization (sluice.load(..., quantize=)): what it costs in quality, what it buys in speed.

    python bench/quant.py --json docs/results/bench-quant.json     # the numbers in docs/quantization.md
    python bench/quant.py --quick                          # smoke run, bundled model only

1. bits per byte of the bundled model on its held-out text (observatory/surgery_eval.py's scorer):
   fp32, bf16 (unquantized, for the activation rounding alone), int8, int4, and int8 as the decode
   kernels compute it (INT8_DECODE: fp32 x, or x quantized to int8 per block of 32 / 128 / per row).
2. KL(bf16 logits || quantized logits), mean over positions, and top-1 agreement, on a random
   Qwen3-0.6B-shaped checkpoint (bench/random_checkpoint.py) fed random token ids; same schemes.
3. decode tok/s at batch 1 (LLM.generate, random-id prompt, greedy, ignore_eos), precisions
   interleaved round by round, median over rounds; quantized models are loaded in bf16.
Run it alone on the machine (the timings are wall clock); the CPU flags and torch version are recorded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from common import cpu_info, save_json

PRECISIONS = ("float32", "bfloat16", "int8", "int4")
# int8 as the decode kernels compute it (engine/gemv.py): (x path, x block); docs/quantization.md
INT8_DECODE = {"int8 decode, fp32 x": ("fp32", 0), "int8 decode, x int8/32": ("int8", 32),
               "int8 decode, x int8/128": ("int8", 128), "int8 decode, x int8/row": ("int8", 0)}
BIG = Path("/tmp/sluice-ckpt/qwen3-0.6b-fp32")


def _load_args(precision: str) -> dict:
    if precision in ("int8", "int4"):
        return {"dtype": "bfloat16", "quantize": precision}
    return {"dtype": precision}


def as_decode(model, x_path: str, xblock: int):
    """Make every Int8Linear of `model` compute each input row as an int8 decode step does: the decode
    kernel (gemv.py), 8 rows a call. x's quantization is per row, so chunking changes nothing: a
    whole-text forward scores the numerics of decoding it token by token."""
    from sluice.engine import gemv
    from sluice.model.quant import Int8Linear

    class DecodeInt8(Int8Linear):
        def forward(self, x):
            x2, s = x.reshape(-1, x.shape[-1]), self.scales.float()
            if x_path == "fp32":
                x2 = torch.nn.functional.pad(x2, (0, self.qweight.shape[1] - x2.shape[1]))
            y = torch.cat([gemv.gemv(x2[a:a + 8], self.qweight, s, self.bias) if x_path == "fp32" else
                           gemv.gemv_w8a8(x2[a:a + 8], self.qweight, s, self.bias, xblock)
                           for a in range(0, x2.shape[0], 8)])
            return y.view(*x.shape[:-1], self.out_features)

    for m in model.modules():
        if type(m) is Int8Linear:
            m.__class__ = DecodeInt8
    return model


def _loaded(path, dtype: str | None, precision: str):
    """sluice.load for a bits-per-byte / KL row: a precision, or one of the INT8_DECODE paths."""
    import sluice
    kw = {} if dtype is None else {"dtype": dtype}
    if precision in INT8_DECODE:
        return as_decode(sluice.load(path, **kw, quantize="int8"), *INT8_DECODE[precision])
    if precision in ("int8", "int4"):
        return sluice.load(path, **kw, quantize=precision)
    return sluice.load(path, **({"dtype": precision} if precision != "float32" else kw))


def bits_per_byte(quick: bool) -> dict:
    import sluice
    from sluice.engine import gemv
    from sluice.observatory.surgery_eval import measure, prepare
    out = {}
    for name in PRECISIONS + (tuple(INT8_DECODE) if gemv.available() else ()):
        model = _loaded(None, None, name)
        tok = sluice.Tokenizer.from_pretrained(model.model_dir)
        text = None
        if quick:
            from sluice.observatory.surgery_eval import default_text
            text = default_text(model)[0][:1500]
        inp = prepare(model, tok, text, None, 0)
        out[name] = {"bits_per_byte": measure(model, tok, inp)["bits_per_byte"], "scored_bytes": inp.scored_bytes,
                     "tokens": len(inp.ids)}
    return out


@torch.inference_mode()
def kl_to_bf16(path: Path | None, n_tokens: int) -> dict:
    import sluice
    ref = sluice.load(path, "bfloat16")
    ids = torch.randint(0, ref.config.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    lp = ref(ids)[0].log_softmax(-1)  # (T, V) fp32
    del ref
    out = {"tokens": n_tokens, "entropy_nats": float(-(lp.exp() * lp).sum(-1).mean())}
    from sluice.engine import gemv
    for scheme in ("int8", "int4") + (tuple(INT8_DECODE) if gemv.available() else ()):
        lq = _loaded(path, "bfloat16", scheme)(ids)[0].log_softmax(-1)
        kl = (lp.exp() * (lp - lq)).sum(-1)  # (T,) nats
        out[scheme] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                       "top1_agreement": float((lp.argmax(-1) == lq.argmax(-1)).float().mean())}
    return out


def weight_bytes(model) -> int:
    """Bytes of every weight a decode step reads (parameters and buffers; the embedding counts once,
    though a step reads only its rows)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def with_tokenizer(path: Path, workdir: Path) -> Path:
    """The random checkpoint has no tokenizer; LLM needs one to stream text. A directory of hard links
    to its files (sluice refuses symlinks that leave a model directory; a copy where links cannot
    be made) plus a word-level tokenizer "t0".."tN" covering every id (prompts are ids anyway)."""
    out = workdir / (path.name + "-tok")
    if (out / "tokenizer.json").is_file():
        return out
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    out.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.is_file() and not (out / f.name).exists():
            try:
                os.link(f.resolve(), out / f.name)
            except OSError:  # another file system
                shutil.copyfile(f.resolve(), out / f.name)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    return out


def decode_speed(path: Path | None, prompt_tokens: int, new_tokens: int, rounds: int) -> dict:
    import sluice
    llms = {p: sluice.LLM(path, **_load_args(p)) for p in PRECISIONS}
    vocab = llms["float32"].model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    params = sluice.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    runs = {p: [] for p in PRECISIONS}
    for llm in llms.values():  # warm-up: first-call allocations and kernel dispatch
        llm.generate([prompt[:8]], sluice.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for _ in range(rounds):
        for p, llm in llms.items():
            out = llm.generate([prompt], params)[0]
            assert len(out.token_ids) == new_tokens
            runs[p].append((llm.last_stats.decode_tok_s, llm.last_stats.prefill_tok_s))
    rows = []
    for p, llm in llms.items():
        dec = statistics.median(r[0] for r in runs[p])
        rows.append({"precision": p, "load_dtype": _load_args(p)["dtype"], "decode_tok_s": round(dec, 2),
                     "decode_runs": [round(r[0], 2) for r in runs[p]],
                     "prefill_tok_s": round(statistics.median(r[1] for r in runs[p]), 1),
                     "weight_MB": round(weight_bytes(llm.model) / 1e6, 1)})
    base = rows[1]["decode_tok_s"]
    for r in rows:
        r["vs_bf16"] = round(r["decode_tok_s"] / base, 2)
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "rounds": rounds, "rows": rows}


def kernel_times(quick: bool) -> list[dict]:
    """One batch-1 matmul, ms, per kernel and activation dtype: what chose the kernels and the bf16
    activations. Each timing cycles through enough weight copies (> 200 MB) that they come from DRAM."""
    import torch.nn.functional as F

    from sluice.model import quant as Q

    def ms_each(op, x, weights, reps=5) -> float:
        """Median ms of op(x, *w) for one w, timed over a pass through all the copies."""
        ts = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            for w in weights:
                op(x, *w)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts[1:]) / len(weights) * 1e3

    rows = []
    for N, K in ([(256, 128)] if quick else [(3072, 1024), (1024, 3072), (151936, 1024)]):
        copies = 1 if quick else max(1, 200_000_000 // (N * K * 4))
        w = [torch.randn(N, K) * 0.02 for _ in range(copies)]
        row = {"N": N, "K": K}
        for dt in (torch.float32, torch.bfloat16):
            x, name = torch.randn(1, K, dtype=dt), str(dt).removeprefix("torch.")
            row[f"linear {name}"] = ms_each(F.linear, x, [(t.to(dt),) for t in w])
            # the int8 op takes scales in the activation dtype
            q8 = [(q, s.to(dt)) for q, s in map(Q.int8_quantize, w)]
            row[f"int8 {name}"] = ms_each(torch.ops.aten._weight_int8pack_mm, x, q8)
            del q8
            for g in (32, 128):
                p4 = [(Q.int4_pack(c), g, sz.to(dt)) for c, sz in (Q.int4_quantize(t, g) for t in w)]
                row[f"int4 g{g} {name}"] = ms_each(torch.ops.aten._weight_int4pack_mm_for_cpu, x, p4)
                del p4
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--checkpoint", type=Path, default=BIG, help="the Qwen3-0.6B-shaped checkpoint")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/sluice-bench"), help="for the tokenizer it adds")
    ap.add_argument("--quick", action="store_true", help="bundled model only, short texts: a smoke run")
    ap.add_argument("--kernels-only", action="store_true", help="only the per-kernel matmul times")
    ap.add_argument("--quality-only", action="store_true", help="only bits per byte and KL (no timings)")
    args = ap.parse_args(argv)
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    r = {"quick": args.quick, "cpu": cpu_info(), "torch": torch.__version__,
         "simd_flags": [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))],
         "load_avg_start": Path("/proc/loadavg").read_text().split()[:3]}
    t0 = time.time()
    r["kernels_ms"] = [] if args.quality_only else kernel_times(args.quick)
    if args.kernels_only:
        print_kernels(r)
        save_json(args.json, r)
        return r
    r["bits_per_byte"] = bits_per_byte(args.quick)
    big = None if args.quick else args.checkpoint
    r["kl"] = {"model": str(big or "bundled"), **kl_to_bf16(big, 32 if args.quick else 256)}
    n = 8 if args.quick else 128
    models = [("bundled", None)] + ([] if args.quick else [("qwen3-0.6b", with_tokenizer(big, args.workdir))])
    models = [] if args.quality_only else models
    r["decode"] = {name: decode_speed(path, n, n, 1 if args.quick else args.rounds) for name, path in models}
    r["seconds"] = round(time.time() - t0, 1)
    r["load_avg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print_tables(r)
    save_json(args.json, r)
    return r


def print_kernels(r: dict) -> None:
    print(f"CPU {r['cpu'].get('model')} ({' '.join(r['simd_flags'])}), torch {r['torch']}\n")
    keys = [k for k in r["kernels_ms"][0] if k not in ("N", "K")]
    print("| N x K | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for row in r["kernels_ms"]:
        print(f"| {row['N']} x {row['K']} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    print("(ms per batch-1 matmul, median)\n")


def print_tables(r: dict) -> None:
    if r["kernels_ms"]:
        print_kernels(r)
    print("| precision | bits/byte (bundled, held-out) |\n|---|---|")
    for p, v in r["bits_per_byte"].items():
        print(f"| {p} | {v['bits_per_byte']:.4f} |")
    k = r["kl"]
    print(f"\nKL to bf16 logits, {k['model']}, {k['tokens']} random ids (bf16 entropy {k['entropy_nats']:.2f} nats)\n")
    print("| scheme | KL mean (nats) | KL max | top-1 agreement |\n|---|---|---|---|")
    for s in [s for s in k if isinstance(k[s], dict)]:
        print(f"| {s} | {k[s]['kl_mean']:.5f} | {k[s]['kl_max']:.4f} | {k[s]['top1_agreement']:.3f} |")
    for name, d in r["decode"].items():
        print(f"\n{name}: batch 1, {d['prompt_tokens']}-token prompt, {d['new_tokens']} new tokens, "
              f"median of {d['rounds']}\n")
        print("| precision | decode tok/s | vs bf16 | prefill tok/s | weights MB |\n|---|---|---|---|---|")
        for row in d["rows"]:
            print(f"| {row['precision']} | {row['decode_tok_s']} | {row['vs_bf16']} | {row['prefill_tok_s']} | "
                  f"{row['weight_MB']} |")


if __name__ == "__main__":
    main()
