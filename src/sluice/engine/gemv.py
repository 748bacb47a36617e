"""sluice's own batch-1 linear for decode on CPU (gemv.cpp), and the switch that puts it in a model.

Why: a decode step multiplies 1..8 token rows by every weight matrix, so it is a stream over the
weights. torch's F.linear at batch 1 reads a weight from DRAM at well under this machine's
bandwidth (docs/changelog-benchmarks.md, 2026-11-30 "Fast decode"), and for bf16 weights on a CPU
without AVX-512-bf16 it converts through a slow path. gemv.cpp reads W once at its stored width
(fp32, bf16, int8), widens in registers and accumulates in fp32.

How it is used: `use_fast_linears(model)` swaps each nn.Linear's class for FastLinear, a subclass
with the same parameters, names and hooks, whose forward sends inputs of a few rows (ROWS) to the
kernel and anything else (prefill) to F.linear. The model code is unchanged; `sluice.load()`
models stay plain (the reference); the engine (LLM) opts in with kernels="auto".

The extension is built once per machine by native/ (in the background at first use, unless asked to
wait); until then, without a compiler, or on a CPU without AVX2 + FMA, or off the CPU, `available()` is
False and every linear stays F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..model.quant import Int4Linear, Int8Linear, int4_dequantize, int4_unnibble
from .native import NATIVE_DIR, NativeExtension, cpu_flags, cpu_info  # noqa: F401  (cpu_*: re-exported for callers)

# Rows of x sent to the kernel, by weight dtype, from bench/decode_kernels.py on the AVX2 EPYC
# (docs/changelog-benchmarks.md, 2026-11-30 "Fast decode"; Qwen3-0.6B's matrices from DRAM, 2 threads):
# the kernel streams fp32 weights at 13.7 / 14.8 / 11.9 / 6.6 GB/s for 1 / 2 / 4 / 8 rows against
# F.linear's 8.7 / 5.5 / 3.8 / 4.5, and bf16 at 11.5 / 9.7 / 8.0 / 5.7 against 9.8 / 6.8 / 3.6 / 2.3. More rows
# than this is prefill (F.linear's GEMM).
ROWS = {torch.float32: (1, 8), torch.bfloat16: (1, 8)}
MAX_ROWS = 8  # what the kernel itself accepts
PREFILL_BLOCK_BYTES = 32 * 2**20  # the fp32 copy of a bf16 or int8 weight made per GEMM call in prefill
# What --quantize int8 decode rows multiply the int8 weights with (docs/quantization.md, "Integer
# decode"): "int8" quantizes x to int8 in blocks of X_BLOCK inputs and multiplies integers
# (gemv_w8a8); "fp32" widens the weights and multiplies fp32 x (gemv), the exact product with the
# dequantized weight. Set per process by SLUICE_INT8_X, or by assigning these before a forward.
# The default stays "fp32" until "int8" is measured faster end to end on a quiet machine (its
# quality cost is small: KL 0.00042 against 0.00036 nats on the random 0.6B); blocks of 32 as Q8_0,
# since one scale per row spends x's 8 bits on its largest outlier.
INT8_X_CHOICES = ("int8", "fp32")
INT8_X = os.environ.get("SLUICE_INT8_X", "fp32")
X_BLOCK = 32
_EXT = NativeExtension(NATIVE_DIR / "gemv.cpp", "decode CPU kernel")


def kernel(wait: bool | None = None):
    """The compiled extension, or None where it cannot be had (yet: a background build may be running;
    wait=True builds it now, see native/extension.py)."""
    return _EXT.module(wait)


def available(wait: bool | None = None) -> bool:
    return kernel(wait) is not None


def building() -> bool:
    """Whether the kernel is still being built in the background (available() may turn True later)."""
    return _EXT.module() is None and _EXT.failure is None


def why_unavailable() -> str | None:
    return _EXT.why_unavailable()


@torch.library.custom_op("sluice::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M <= 8, K) @ weight (N, K)^T [* scale (N,)] [+ bias] -> (M, N) in x's dtype, fp32 accumulation."""
    return kernel().gemv(x, weight, scale, bias)


@gemv.register_fake
def _(x, weight, scale=None, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("sluice::gemv_w8a8", mutates_args=())
def gemv_w8a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              xblock: int = 32) -> torch.Tensor:
    """x (M <= 8, K' <= K) @ (qweight (N, K) int8 * scale (N,))^T [+ bias] -> (M, N) in x's dtype, with x
    quantized to int8 per block of `xblock` inputs (0: per row) and integer products (w8a8_reference)."""
    return kernel().gemv_w8a8(x, qweight, scale, bias, xblock)


@gemv_w8a8.register_fake
def _(x, qweight, scale, bias=None, xblock=32):
    return x.new_empty(x.shape[0], qweight.shape[0])


def quantize_x(x: torch.Tensor, K: int, xblock: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_w8a8's quantization of x (M, K' <= K) in plain torch: codes (M, nb, B) in [-127, 127] over
    K rounded up to 32 (zeros past K'), scales d (M, nb, 1) = amax / 127, so x ~ q * d per block."""
    Kq = -(-K // 32) * 32
    B = Kq if xblock == 0 or xblock >= Kq else xblock
    nb = -(-Kq // B)
    xb = F.pad(x.float(), (0, nb * B - x.shape[-1])).view(x.shape[0], nb, B)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.tensor(127.0).div(amax)  # a true division, as the kernel does (127 / t is 1/t * 127)
    q = torch.where(amax > 0, (xb * inv).round().clamp(-127, 127), 0.0)
    return q, amax / 127


def w8a8_reference(x, qweight, scale, bias=None, xblock: int = 32) -> torch.Tensor:
    """gemv_w8a8 in plain torch (float64): per block, the exact integer dot of x's codes with the
    weight codes, times the block's x scale; summed, times the row's weight scale, plus bias."""
    q, d = quantize_x(x, qweight.shape[1], xblock)  # (M, nb, B), (M, nb, 1)
    M, nb, B = q.shape
    w = F.pad(qweight.double(), (0, nb * B - qweight.shape[1])).view(-1, nb, B)  # (N, nb, B)
    dots = torch.einsum("mbk,nbk->mnb", q.double(), w)  # integers, exact in float64
    y = (dots * d.double().view(M, 1, nb)).sum(-1) * scale.double()
    return (y if bias is None else y + bias.double()).to(x.dtype)


class FastLinear(nn.Linear):
    """nn.Linear whose few-row (decode) calls go to sluice's gemv; same parameters and state_dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        lo, hi = ROWS.get(self.weight.dtype, (1, 0))
        if not lo <= rows <= hi or x.device.type != "cpu" or torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        y = gemv(x.reshape(rows, x.shape[-1]), self.weight, None, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class FastInt8Linear(Int8Linear):
    """model/quant.py's Int8Linear whose decode calls (1-8 rows) go to a kernel, and whose prefill
    multiplies by fp32 blocks of the dequantized weight. Decode, by INT8_X: "int8" quantizes x to int8
    per block of X_BLOCK inputs and multiplies integers (gemv_w8a8, w8a8_reference); "fp32" sends
    the int8 weight and its row scales to gemv, the fp32 product of x with the dequantized weight
    (quant.int8_reference without the bf16 rounding of x), as prefill is. With the native step's integer dot
    (INT8_DOT "int8") fp32 inputs are first rounded as that rounds them (round_blocks_int8), so a torch forward
    (hooks attached) keeps the step's numbers up to summation order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, K = x.numel() // x.shape[-1], x.shape[-1]
        if x.device.type != "cpu":
            return super().forward(x)
        if INT8_DOT == "int8" and x.dtype == torch.float32:
            x = round_blocks_int8(x, -(-K // 32) * 32)
        if rows > MAX_ROWS:
            return self._prefill(x)
        x2 = x.reshape(rows, K)
        if INT8_X == "int8":  # the kernel reads the padded columns' inputs as zeros itself
            y = gemv_w8a8(x2, self.qweight, self.scales32, self.bias, X_BLOCK)
        else:
            if self.qweight.shape[1] != K:  # zero inputs for the padded columns
                x2 = F.pad(x2, (0, self.qweight.shape[1] - K))
            y = gemv(x2, self.qweight, self.scales32, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows: fp32 GEMMs on the dequantized weight (MKL's fp32 GEMM ran a 0.6B prefill at 82
        tok/s here, torch's int8 op at 51)."""
        K = x.shape[-1]
        rows = lambda a, b: self.qweight[a:b, :K].float() * self.scales32[a:b, None]  # noqa: E731
        return blocked_linear(x.float(), rows, self.bias, self.out_features).to(x.dtype)


def blocked_linear(x32: torch.Tensor, weight_rows, bias: torch.Tensor | None, N: int) -> torch.Tensor:
    """x32 (..., K) @ W^T (+ bias) in fp32, where weight_rows(a, b) gives W[a:b] as fp32: W is made
    PREFILL_BLOCK_BYTES at a time, so a weight stored narrower (bf16, int8) is multiplied by MKL's
    fp32 GEMM without ever holding a full fp32 copy of it."""
    step = max(1, PREFILL_BLOCK_BYTES // (4 * x32.shape[-1]))
    out = torch.empty(*x32.shape[:-1], N, dtype=torch.float32, device=x32.device)
    for a in range(0, N, step):
        b = min(a + step, N)
        out[..., a:b] = F.linear(x32, weight_rows(a, b), None if bias is None else bias[a:b].float())
    return out


@torch.library.custom_op("sluice::round_blocks_int8", mutates_args=())
def round_blocks_int8(x: torch.Tensor, padded: int) -> torch.Tensor:
    """x as native/q4i.h's and q8t.h's integer dots see it: over each row zero-padded to `padded` inputs, per block of 32,
    a = rint(clamp(x * (127 / max|x|), -127, 127)) times max|x| / 127 (Q8_0's rounding). An op of its own, so that
    torch.compile calls it as it is: inductor's fusion of the padded blocks and the slice back to K gave the next op
    wrong inputs (test_composition's compile+int8 cell), and a fused rounding could round one input differently."""
    K = x.shape[-1]
    xb = F.pad(x, (0, padded - K)).unflatten(-1, (-1, 32))
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round((xb * inv).clamp(-127, 127)) * (amax / 127)).flatten(-2)[..., :K].contiguous()


@round_blocks_int8.register_fake
def _(x, padded):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# The native step's int4 arithmetic (fast_step.py, native/q4i.h): "int8" rounds x per block of 32 to int8 for an
# integer dot, "fp32" widens the codes. Per process by SLUICE_INT4_DOT, or by assigning gemv.INT4_DOT before a
# FastStep is built; FastInt4Linear below rounds x the same way, so the torch forward keeps the step's numbers.
INT4_DOTS = ("int8", "fp32")
INT4_DOT = os.environ.get("SLUICE_INT4_DOT", "int8")
# The same for int8 weights (native/q8t.h): "int8" rounds x so and sums code x code in integers, "fp32" widens the
# codes. SLUICE_INT8_DOT, or gemv.INT8_DOT before a FastStep is built; FastInt8Linear above follows it too.
INT8_DOTS = ("int8", "fp32")
INT8_DOT = os.environ.get("SLUICE_INT8_DOT", "int8")


class FastInt4Linear(Int4Linear):
    """An Int4Linear whose fp32 inputs are multiplied in fp32 by its dequantized weight, made a block of rows at a
    time (blocked_linear): where the engine runs the torch forward of an int4 model (a hook attached, compile) it
    then gives the native step's numbers up to summation order, not those of torch's int4 op, which rounds x and
    y to bf16 (and it builds no packed copy of the codes). So with the native step's integer dot (INT4_DOT
    "int8") x is first rounded as that rounds it. Other inputs take torch's op, as before."""

    def forward(self, x):
        if x.dtype != torch.float32:
            return super().forward(x)
        if INT4_DOT == "int8":
            x = round_blocks_int8(x, 2 * self.qweight.shape[1])
        K, g = self.in_features, self.group_size

        def rows(a, b):
            return int4_dequantize(int4_unnibble(self.qweight[a:b]), self.scales_zeros[:, a:b], g)[:, :K]
        return blocked_linear(x, rows, self.bias, self.out_features)


def use_fast_linears(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` with an fp32 / bf16 weight into a FastLinear, every Int8Linear
    into a FastInt8Linear and every Int4Linear into a FastInt4Linear, in place. Returns how many; 0 (and nothing changed) when the
    kernel is unavailable."""
    if not available():
        return 0
    if INT8_X not in INT8_X_CHOICES:
        raise ConfigError(f"SLUICE_INT8_X must be one of {', '.join(INT8_X_CHOICES)}, got {INT8_X!r}")
    if X_BLOCK < 0 or X_BLOCK % 32:
        raise ConfigError(f"gemv.X_BLOCK must be 0 (one scale per row) or a multiple of 32, got {X_BLOCK!r}")
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype in (torch.float32, torch.bfloat16) and m.weight.is_contiguous():
            m.__class__ = FastLinear  # same object: parameters, names, hooks and ties stay as they were
            n += 1
        elif type(m) is Int8Linear and m.qweight.device.type == "cpu":
            m.register_buffer("scales32", m.scales.float(), persistent=False)  # the kernel's scale dtype
            m.__class__ = FastInt8Linear
            n += 1
        elif type(m) is Int4Linear and m.qweight.device.type == "cpu":
            m.__class__ = FastInt4Linear
            n += 1
    return n
