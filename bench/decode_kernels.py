"""The two kernels of a decode step, alone: the few-row linear and attention over the KV cache.

Linear: torch's F.linear against sluice's gemv (engine/native/gemv.cpp) over every weight matrix of a
Qwen3-0.6B-shaped stack (28 layers of q, k, v, o, gate, up, down: 1.76 GB fp32), so each weight comes
from DRAM, not the cache, as in a real step; GB/s = weight bytes / time per pass. int8: torch's
_weight_int8pack_mm (what model/quant.py uses, bf16 activations) against gemv with int8 weights
(fp32 x) and gemv_w8a8 (x quantized to int8 per block of 32 or 128 inputs, or per row; integer dot).

Attention: one query token against S cache slots (16 query heads, 8 KV heads, head 128): SDPA on the
old (B, S, K, D) cache layout (a strided view), SDPA on the (B, K, S, D) layout, and sluice's
decode_attention (model/layers.py). Results: docs/changelog-benchmarks.md, 2026-11-30 "Fast decode".

    python bench/decode_kernels.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

from common import call_times
from sluice.engine import gemv
from sluice.model import quant
from sluice.model.layers import decode_attention

sdpa = F.scaled_dot_product_attention
X_BLOCKS = (32, 128, 0)
QWEN3_06B = dict(C=1024, I=3072, H=16, KV=8, D=128, L=28)


def best_of(fn, reps: int) -> float:
    return call_times(fn, reps)[0]


def linear_rows(shape: dict, rows_list, reps: int) -> list[dict]:
    C, I, H, KV, D, L = (shape[k] for k in ("C", "I", "H", "KV", "D", "L"))
    mats = [(H * D, C), (KV * D, C), (KV * D, C), (C, H * D), (I, C), (I, C), (C, I)]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        ws = [torch.randn(n, k).to(dtype) for _ in range(L) for n, k in mats]
        nbytes = sum(w.nbytes for w in ws)
        for rows in rows_list:
            xs = {k: torch.randn(rows, k).to(dtype) for k in {C, I, H * D}}
            for name, f in (("F.linear", lambda x, w: F.linear(x, w)), ("gemv", lambda x, w: gemv.gemv(x, w, None, None))):
                s = best_of(lambda f=f, xs=xs, ws=ws: [f(xs[w.shape[1]], w) for w in ws], reps)
                out.append(dict(kernel=name, dtype=str(dtype)[6:], rows=rows, ms=s * 1e3, GB_s=nbytes / s / 1e9))
        del ws
    qs = [quant.int8_quantize(torch.randn(n, k) * 0.02) for _ in range(L) for n, k in mats]
    nbytes = sum(q.nbytes for q, _ in qs)
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {C, I, H * D}}
        xb = {k: v.to(torch.bfloat16) for k, v in xs.items()}
        s = best_of(lambda xb=xb: [quant.int8_linear(xb[q.shape[1]], q, sc) for q, sc in qs], reps)
        out.append(dict(kernel="_weight_int8pack_mm", dtype="int8", rows=rows, ms=s * 1e3, GB_s=nbytes / s / 1e9))
        s = best_of(lambda xs=xs: [gemv.gemv(xs[q.shape[1]], q, sc.float(), None) for q, sc in qs], reps)
        out.append(dict(kernel="gemv", dtype="int8", rows=rows, ms=s * 1e3, GB_s=nbytes / s / 1e9))
        for xblock in X_BLOCKS:  # x quantized to int8 too, integer dot; 0 = one x scale per row
            s = best_of(lambda xs=xs, xb=xblock: [gemv.gemv_w8a8(xs[q.shape[1]], q, sc.float(), None, xb)
                                                  for q, sc in qs], reps)
            out.append(dict(kernel=f"gemv_w8a8 x/{xblock or 'row'}", dtype="int8", rows=rows, ms=s * 1e3,
                            GB_s=nbytes / s / 1e9))
    return out


def attention_rows(slots_list, reps: int) -> list[dict]:
    K, G, D = 8, 2, 128
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for S in slots_list:
            k_old, v_old = torch.randn(1, S, K, D).to(dtype), torch.randn(1, S, K, D).to(dtype)
            k, v = k_old.transpose(1, 2).contiguous(), v_old.transpose(1, 2).contiguous()
            q = torch.randn(1, K * G, 1, D).to(dtype)
            mask = torch.ones(1, 1, 1, S, dtype=torch.bool)
            mask[..., S // 2:] = False  # half the slots still empty
            variants = {
                "sdpa, (B, S, K, D) cache": lambda q=q, k=k_old, v=v_old, m=mask: sdpa(
                    q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m, scale=D ** -0.5, enable_gqa=True),
                "sdpa, (B, K, S, D) cache": lambda q=q, k=k, v=v, m=mask: sdpa(
                    q, k, v, attn_mask=m, scale=D ** -0.5, enable_gqa=True),
                "decode_attention": lambda q=q, k=k, v=v, m=mask: decode_attention(q, k, v, m, D ** -0.5),
            }
            ref = variants["sdpa, (B, S, K, D) cache"]().float()
            for name, f in variants.items():
                err = (f().float() - ref).abs().max().item()
                s = best_of(f, reps)
                out.append(dict(kernel=name, dtype=str(dtype)[6:], slots=S, ms_per_layer=s * 1e3,
                                max_abs_diff=err, cache_MB=2 * k.nbytes / 1e6))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, tiny sizes: a smoke test, seconds")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    if not gemv.available():
        raise SystemExit(f"bench/decode_kernels.py: sluice's kernel is unavailable: {gemv.why_unavailable()}")
    shape = dict(QWEN3_06B, L=2) if args.quick else QWEN3_06B
    reps = 1 if args.quick else 5
    result = {"cpu_flags": sorted(f for f in gemv.cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx"))),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(),
              "linear": linear_rows(shape, (1, 2) if args.quick else (1, 2, 4, 8), reps),
              "attention": attention_rows((64,) if args.quick else (256, 4096, 16384), reps)}
    for r in result["linear"]:
        print(f"linear {r['kernel']:>20} {r['dtype']:>8} rows={r['rows']}: {r['ms']:8.1f} ms  {r['GB_s']:5.1f} GB/s")
    for r in result["attention"]:
        print(f"attention {r['kernel']:>26} {r['dtype']:>8} S={r['slots']:>6}: {r['ms_per_layer']:8.3f} ms/layer "
              f"(max diff {r['max_abs_diff']:.1e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
