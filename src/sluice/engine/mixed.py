"""bf16 weights, fp32 compute: the engine's bf16 mode on a CPU without bf16 instructions.

Why: on a CPU without AVX-512-bf16 or AMX, every bf16 op converts through fp32 in software. A bf16
decode step spent a third of its time on elementwise work (norms, RoPE, residual adds, SiLU, the
casts between them), and torch's bf16 GEMM runs prefill at 17 GFLOP/s against 150+ for fp32
(docs/changelog-benchmarks.md, 2026-11-30 "Fast decode"). What bf16 buys is half the bytes per
weight, and decode is a stream over the weights. So this mode keeps the linear weights in bf16 and
computes everything else in fp32:
- decode rows go to sluice's kernel (engine/gemv.py), which takes fp32 x and widens bf16 W in
  registers;
- prefill multiplies by an fp32 copy of W, made one block of rows at a time, so the temporary
  stays small and the GEMM is MKL's fp32 one;
- norm gains, biases and other small parameters become fp32, and the embedding lookup returns fp32
  rows of the bf16 table (which the tied LM head shares).

What a bf16-weight product computes is one setting, BF16_DOT (below), shared with the native step
(fast_step.py, native/b16.h), so that step and this torch path give the same numbers in either mode:
- "fp32": x as it is, the weights widened exactly; the numbers are those of an fp32 model whose
  weights were rounded to bf16, which is closer to fp32 than a bf16 forward is;
- "bf16": each linear's input row first rounded to bf16 (to nearest even), then the same products:
  what the native step's vdpbf16ps computes, two bf16 x bf16 products per fp32 lane, as llama.cpp's
  bf16 path does. The rounding costs a few 1e-3 of the largest logit on random tiny models;
- "auto" (the default): "bf16" where the CPU has AVX512_BF16 and the kernels are built with it
  (AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later), "fp32" elsewhere (AVX2-only
  CPUs, a build with SLUICE_KERNEL_FLAGS=-mno-avx512f). Only the native step gains speed from it
  (its prefill tiles do twice the products per instruction); the torch path rounds x only to match. The KV cache is fp32 too, so it takes twice the memory of a bf16 cache.
`LLM(dtype="bfloat16")` picks this mode by itself where the CPU lacks bf16 instructions and the
kernel is available (`compute="auto"`); `compute="bfloat16"` keeps the plain bf16 forward
(transformers' numerics), `compute="float32"` asks for this mode.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from ..errors import ConfigError
from . import gemv
from .native import cflags

# Per process by SLUICE_BF16_DOT, or by assigning BF16_DOT (before a FastStep is built; the torch path reads it
# per call), or per native step: FastStep(model, bf16_dot=...). bf16_dot() resolves "auto".
BF16_DOTS = ("auto", "fp32", "bf16")
BF16_DOT = os.environ.get("SLUICE_BF16_DOT", "auto")
# torch.compile's options wherever the engine compiles its forward: inductor keeps a cast to a narrower dtype and back
# (the bf16 dot mode's rounding of x, Bf16WeightLinear) instead of fusing it away, so compile gives the eager numbers.
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def compile_forward(fn, **kwargs):
    """torch.compile(fn, options=COMPILE_OPTIONS, **kwargs), with inductor's cache kept apart per capped ISA.

    Inductor's FX graph cache keys neither ATEN_CPU_CAPABILITY nor the vector width it generated for: a graph
    compiled with AVX-512's 16 lanes and served from the cache under ATEN_CPU_CAPABILITY=avx2 (the AVX2 builds
    of docs/benchmarks.md) is rebuilt with 8-lane vectors and steps 16, and its logits come out NaN. So where
    the ISA is capped and the cache is inductor's default one, this process's inductor cache moves to a
    directory of that ISA's own. (Importing torch._dynamo already writes the default into
    TORCHINDUCTOR_CACHE_DIR; inductor reads it again at each lookup.)"""
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    if cap:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        default = os.path.abspath(default_cache_dir())
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{cap.lower()}"
    return torch.compile(fn, options=COMPILE_OPTIONS, **kwargs)


class UpcastEmbedding(nn.Embedding):
    """An embedding table stored in bf16 whose rows come out in fp32."""

    out_dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).float()


class Bf16WeightLinear(nn.Linear):
    """A linear with a bf16 weight and fp32 inputs and outputs (see the module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K, N = x.shape[-1], self.out_features
        rows = x.numel() // K
        x = x.float()
        if bf16_dot() == "bf16":  # as the native step's dot mode reads x (see the module doc)
            x = x.to(torch.bfloat16).float()
        if rows <= gemv.MAX_ROWS:
            return gemv.gemv(x.reshape(rows, K), self.weight, None, self.bias).view(*x.shape[:-1], N)
        return gemv.blocked_linear(x, lambda a, b: self.weight[a:b].float(), self.bias, N)


def bf16_dot(mode: str | None = None) -> str:
    """What bf16-weight products compute here, "fp32" or "bf16", for `mode` (default BF16_DOT); "auto" resolved
    for this CPU and kernel build. An unknown mode is a ConfigError."""
    mode = mode or BF16_DOT
    if mode not in BF16_DOTS:
        raise ConfigError(f"SLUICE_BF16_DOT (bf16_dot) must be one of {', '.join(BF16_DOTS)}, got {mode!r}")
    return _auto_constant() if mode == "auto" else mode


@torch.compiler.assume_constant_result
def _auto_constant() -> str:
    """auto_bf16_dot() as a constant of a torch.compile trace (dynamo cannot trace its read of /proc/cpuinfo)."""
    return auto_bf16_dot()


@functools.cache
def auto_bf16_dot() -> str:
    """ "bf16" where the CPU has AVX512_BF16 and the kernels' flags keep it (native/build.py compiles for this CPU;
    SLUICE_KERNEL_FLAGS=-mno-avx512f, the AVX2 build, drops it), else "fp32". The native step's has_bf16_dot()
    agrees wherever the compiler knows AVX512_BF16 (GCC 10+, Clang 9+)."""
    dropped = {"-mno-avx512f", "-mno-avx512bf16"} & set(cflags())
    return "bf16" if "avx512_bf16" in gemv.cpu_flags() and not dropped else "fp32"


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's activations (and so the KV cache) have: fp32 in this mode."""
    return getattr(model.embed, "out_dtype", model.embed.weight.dtype)


def cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX-512-bf16 or AMX), read at run time."""
    return bool({"avx512_bf16", "amx_bf16"} & gemv.cpu_flags())


def use_fp32_compute(model: nn.Module) -> int:
    """Put a bf16 model in this mode, in place; returns how many linears keep bf16 weights. Needs the
    kernel (gemv.available()), for the decode rows."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16:
            m.__class__ = Bf16WeightLinear  # same object: parameters, names, hooks and ties stay
            n += 1
        elif type(m) is nn.Embedding:
            m.__class__ = UpcastEmbedding
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):  # tables stay bf16: a lookup reads one row of them
            continue
        for name, p in m.named_parameters(recurse=False):
            if p.dtype == torch.bfloat16 and id(p) not in linear_weights:  # norm gains and the like
                setattr(m, name, nn.Parameter(p.detach().float(), requires_grad=False))
    return n
