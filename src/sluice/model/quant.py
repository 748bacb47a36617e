"""Weight-only quantization at load time: int8 per output channel, int4 per group of input channels.

`quantize_(model, "int8" | "int4")` replaces the block Linears (attn q/k/v/o, mlp gate/up/down) and
the LM head in place by Int8Linear / Int4Linear under the same attribute names, so forward hooks (the
observatory) attach where they did. Embeddings, norms and biases stay in the load dtype; a tied LM
head gets its own quantized copy and the embedding keeps the original.

  int8  w ~ q * s          q int8 in [-128, 127], one scale per output row, s = max|w_row| / 127
  int4  w ~ (q - 8) * s + z  q in [0, 15], per group of `group_size` consecutive inputs of a row:
                           s = (max - min) / 15, z = min + 8 s (asymmetric min/max, torch's format)

int4 codes are stored in a layout sluice owns, the same on every CPU (`qweight`, (N', K'/2) uint8): each
row is cut into blocks of 32 inputs, and byte j of a block's 16 holds input j in its low nibble and input
j + 16 in its high one (llama.cpp's Q4_0 order). One 16-byte load then gives 32 codes, which an AND and a
shift split into two runs of 16 consecutive inputs: what step.cpp's SIMD loops want. torch's packed layout
(which differs between AVX2 and AVX-512 builds of torch) is made from it only when the torch forward first
runs, so a model that decodes on the native step never holds both.

Kernels are torch's own CPU ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`). They run
with bf16 activations whatever the model dtype: on AVX2 both ops with fp32 activations are slower
than the fp32 F.linear they replace (measured, docs/quantization.md), with bf16 ones faster than a
bf16 F.linear. So in a float32 model a quantized linear rounds its input and output to bf16 and
everything else (norms, residual stream, attention, softmax) stays fp32. Scales and zeros are rounded
to bf16 *before* the codes are chosen, so the codes are the best ones for the scales the kernel uses.

Each scheme's matmul is one module-level function (int8_linear, int4_linear), where a faster native
kernel can be slotted in; int8_reference / int4_reference are the same math in plain torch (tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu accepts
DEFAULT_GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16  # activations, scales and zeros as the kernels take them
CHUNK_ELEMENTS = 1 << 22  # a weight is quantized this many elements at a time (16 MiB of fp32 temporaries)
_K_MULTIPLE = 16  # int8 weights keep in_features % 16 == 0 (see int8_quantize)
_N_MULTIPLE = 16  # the int4 kernel wants out_features % 16 == 0: rows are zero-padded up to it
_PACK_ROWS = 64  # torch packs int4 rows in blocks of 32 (AVX2) or 64 (AVX-512): chunks keep to 64


def check_scheme(scheme, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    if scheme not in SCHEMES:
        raise ConfigError(f"quantize must be one of {', '.join(SCHEMES)} (or None), got {scheme!r}")
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ConfigError(f"int4 group_size must be one of {INT4_GROUP_SIZES} (what torch's CPU kernel "
                          f"takes), got {group_size!r}")


def check_quantize(scheme, device: torch.device | None = None) -> None:
    """What load() checks before reading any weight."""
    check_scheme(scheme)
    if device is not None and device.type != "cpu":
        raise ConfigError(f"quantize={scheme} runs on torch's CPU kernels only; got device {str(device)!r} "
                          "(load it unquantized there, or quantize on device cpu)")


def _row_chunks(N: int, K: int, multiple: int = 1):
    rows = max(multiple, CHUNK_ELEMENTS // max(K, 1) // multiple * multiple)
    for a in range(0, N, rows):
        yield a, min(a + rows, N)


# --------------------------------------------------------------------------- int8, per output channel
def int8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (qweight (N, K') int8, scales (N,) bf16), row chunk by row chunk.

    K' = K rounded up to a multiple of 16, the padding zeros: torch 2.13's _weight_int8pack_mm
    crashes (segfault) for more than one input row when K % 8 != 0 on an AVX2 CPU, and on an
    AVX-512/AMX Xeon returns NaN/inf for K = 72 or 136 (K % 16 == 8) and segfaults at 15 rows;
    every multiple of 16 measured (16 ... 192) was right on both."""
    N, K = w.shape
    Kp = -(-K // _K_MULTIPLE) * _K_MULTIPLE
    qweight = torch.empty(N, Kp, dtype=torch.int8)
    scales = torch.empty(N, dtype=COMPUTE_DTYPE)
    tiny = torch.finfo(COMPUTE_DTYPE).tiny
    for a, b in _row_chunks(N, Kp):
        w32 = F.pad(w[a:b].float(), (0, Kp - K))
        s = (w32.abs().amax(1) / 127).clamp_min(tiny).to(COMPUTE_DTYPE)  # (rows,)
        qweight[a:b] = (w32 / s.float()[:, None]).round_().clamp_(-128, 127).to(torch.int8)
        scales[a:b] = s
    return qweight, scales


def int8_dequantize(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, K') fp32: the weight the int8 kernel multiplies by."""
    return qweight.float() * scales.float()[:, None]


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) in x's dtype: x @ (q * s)^T + bias, on torch's int8 CPU kernel."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).to(COMPUTE_DTYPE)  # (M, K)
    if qweight.shape[1] != K:  # zero inputs for the padded columns
        x2 = F.pad(x2, (0, qweight.shape[1] - K))
    y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), qweight, scales)  # (M, N) bf16, fp32 accumulation
    y = y.view(*lead, qweight.shape[0]).to(x.dtype)
    return y if bias is None else y + bias


def int8_reference(x, qweight, scales, bias=None) -> torch.Tensor:
    """int8_linear in plain torch: fp32 matmul of the bf16-rounded input with the dequantized weight."""
    x32 = F.pad(x.to(COMPUTE_DTYPE).float(), (0, qweight.shape[1] - x.shape[-1]))
    y = F.linear(x32, int8_dequantize(qweight, scales)).to(COMPUTE_DTYPE).to(x.dtype)
    return y if bias is None else y + bias


# --------------------------------------------------------------------------- int4, per group of inputs
def int4_quantize(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (codes (N', K') uint8 in [0, 15], scales_zeros (K'/g, N', 2) bf16).

    N' = N rounded up to a multiple of 16 and K' = K rounded up to a multiple of the group size
    (what the kernel needs), the padding zeros. Plain codes, one per byte: for tests and packing."""
    N, K = w.shape
    Np, Kp = -(-N // _N_MULTIPLE) * _N_MULTIPLE, -(-K // group_size) * group_size
    w32 = F.pad(w.float(), (0, Kp - K, 0, Np - N)).view(Np, Kp // group_size, group_size)
    lo, hi = w32.amin(-1), w32.amax(-1)  # (N', G)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(COMPUTE_DTYPE).tiny).to(COMPUTE_DTYPE)
    zero = (lo + 8 * scale.float()).to(COMPUTE_DTYPE)
    codes = ((w32 - zero.float()[..., None]) / scale.float()[..., None]).round_().add_(8).clamp_(0, 15)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # (G, N', 2)
    return codes.view(Np, Kp).to(torch.uint8), scales_zeros


def int4_dequantize(codes: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N', K') fp32 from plain codes: (q - 8) * s + z, each group's s and z repeated over its inputs."""
    s = scales_zeros[..., 0].float().T.repeat_interleave(group_size, dim=1)  # (N', K')
    z = scales_zeros[..., 1].float().T.repeat_interleave(group_size, dim=1)
    return (codes.float() - 8) * s + z


BLOCK = 32  # inputs per block of the nibble layout: every group size is a multiple of it


def int4_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Plain codes (N', K') -> sluice's layout (N', K'/2) uint8: per block of 32 inputs, byte j = input j
    | input j + 16 << 4."""
    N, K = codes.shape
    blocks = codes.to(torch.uint8).view(N, K // BLOCK, 2, BLOCK // 2)  # (N', blocks, low/high half, 16)
    return (blocks[:, :, 0] | blocks[:, :, 1] << 4).reshape(N, K // 2)


def int4_unnibble(qweight: torch.Tensor) -> torch.Tensor:
    """sluice's layout (N', K'/2) -> plain codes (N', K') uint8 (the inverse of int4_nibbles)."""
    N, half = qweight.shape
    blocks = qweight.view(N, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(N, 2 * half)


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Plain codes (N', K') -> torch's packed CPU layout (N', K'/2) uint8 (CPU-dependent: never saved)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) in x's dtype, on torch's int4 CPU kernel (packed from int4_pack, not
    sluice's nibble layout)."""
    lead, K = x.shape[:-1], x.shape[-1]
    Kp = scales_zeros.shape[0] * group_size
    x2 = x.reshape(-1, K).to(COMPUTE_DTYPE)
    if Kp != K:  # zero inputs for the padded columns
        x2 = F.pad(x2, (0, Kp - K))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), packed, group_size, scales_zeros)  # (M, N')
    y = y[:, :out_features].reshape(*lead, out_features).to(x.dtype)
    return y if bias is None else y + bias


def int4_reference(x, codes, scales_zeros, group_size, out_features, bias=None) -> torch.Tensor:
    """int4_linear in plain torch, from the plain codes."""
    w = int4_dequantize(codes, scales_zeros, group_size)  # (N', K')
    x32 = F.pad(x.to(COMPUTE_DTYPE).float(), (0, w.shape[1] - x.shape[-1]))
    y = F.linear(x32, w)[..., :out_features].to(COMPUTE_DTYPE).to(x.dtype)
    return y if bias is None else y + bias


# --------------------------------------------------------------------------- modules
class QuantizedLinear(nn.Module):
    """What replaces an nn.Linear: same in/out features and bias, a quantized weight."""

    scheme = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, False)

    def dequantize(self) -> torch.Tensor:
        """(out, in) fp32: the weight this module multiplies by."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, {self.scheme}"


class Int8Linear(QuantizedLinear):
    scheme = "int8"

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        qweight, scales = int8_quantize(linear.weight.detach())
        self.register_buffer("qweight", qweight)  # (N, K') int8
        self.register_buffer("scales", scales)  # (N,) bf16

    def forward(self, x):
        return int8_linear(x, self.qweight, self.scales, self.bias)

    def dequantize(self):
        return int8_dequantize(self.qweight, self.scales)[:, :self.in_features]


class Int4Linear(QuantizedLinear):
    def __init__(self, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE):
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        self.group_size = group_size
        self.scheme = f"int4 (group {group_size})"
        w = linear.weight.detach()
        N, K = w.shape
        Np, Kp = -(-N // _N_MULTIPLE) * _N_MULTIPLE, -(-K // group_size) * group_size
        qweight = torch.empty(Np, Kp // 2, dtype=torch.uint8)
        scales_zeros = torch.empty(Kp // group_size, Np, 2, dtype=COMPUTE_DTYPE)
        for a, b in _row_chunks(N, Kp, _N_MULTIPLE):
            codes, sz = int4_quantize(w[a:b], group_size)  # the last chunk carries the row padding
            qweight[a:a + codes.shape[0]] = int4_nibbles(codes)
            scales_zeros[:, a:a + codes.shape[0]] = sz
        self.register_buffer("qweight", qweight)  # (N', K'/2) uint8, sluice's nibble layout (module doc)
        self.register_buffer("scales_zeros", scales_zeros)  # (K'/g, N', 2) bf16
        self._packed = None  # torch's layout, made by the first torch forward (see `packed`)

    @property
    def packed(self) -> torch.Tensor:
        """torch's packed layout of the codes, built from qweight the first time it is asked for and kept.
        Row chunks of whole packing blocks (32 rows on AVX2, 64 on AVX-512): packing a chunk gives exactly
        those rows of the whole, and the temporaries stay small."""
        if self._packed is None or self._packed.shape != self.qweight.shape:
            packed = torch.empty_like(self.qweight)
            for a, b in _row_chunks(self.qweight.shape[0], 2 * self.qweight.shape[1], _PACK_ROWS):
                packed[a:b] = int4_pack(int4_unnibble(self.qweight[a:b]))
            self._packed = packed
        return self._packed

    def forward(self, x):
        return int4_linear(x, self.packed, self.scales_zeros, self.group_size, self.out_features, self.bias)

    def codes(self) -> torch.Tensor:
        """(N', K') uint8: the plain codes, one per byte."""
        return int4_unnibble(self.qweight)

    def dequantize(self):
        return int4_dequantize(self.codes(), self.scales_zeros, self.group_size)[:self.out_features,
                                                                                 :self.in_features]


def quantizable(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every Linear quantize_ replaces: the blocks' attn q/k/v/o, mlp
    gate/up/down, and the LM head."""
    sites = []
    for layer in model.layers:
        sites += [(layer.attn, n) for n in ("q", "k", "v", "o")]
        sites += [(layer.mlp, n) for n in ("gate", "up", "down") if getattr(layer.mlp, n) is not None]
    return sites + [(model, "lm_head")]


def quantize_(model: nn.Module, scheme: str, group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """Quantize the model's Linears in place (see the module docstring); returns the model.

    Every site is checked before any is touched, then they are replaced one at a time, so memory
    peaks at the model plus one layer's temporaries (a chunk of fp32 rows, and the new buffers)."""
    check_scheme(scheme, group_size)
    sites = quantizable(model)
    for parent, name in sites:
        m = getattr(parent, name)
        if isinstance(m, QuantizedLinear):
            raise ConfigError(f"the model is already quantized ({m.scheme}); load it again to quantize "
                              f"it as {scheme}")
        if not isinstance(m, nn.Linear) or m.weight.device.type != "cpu" or not m.weight.is_floating_point():
            where = m.weight.device if isinstance(m, nn.Linear) else type(m).__name__
            raise ConfigError(f"quantize={scheme} runs on torch's CPU kernels and needs a float weight "
                              f"on the CPU; {type(parent).__name__}.{name} is {where}")
    for parent, name in sites:
        linear = getattr(parent, name)
        q = Int8Linear(linear) if scheme == "int8" else Int4Linear(linear, group_size)
        setattr(parent, name, q)
        del linear  # the float weight goes now (unless it is also the tied embedding)
    model.quantization = scheme if scheme == "int8" else f"int4-g{group_size}"
    return model
