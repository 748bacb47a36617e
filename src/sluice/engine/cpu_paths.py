"""Which CPU fast paths an LLM's model gets: sluice's decode kernel (gemv.py) under its linears, and
"bf16 weights, fp32 compute" (mixed.py) for bf16 models. Both are chosen at run time from what this
CPU has and how big the model is, never from what one machine had."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..model.quant import Int8Linear
from .mixed import cpu_has_bf16, use_fp32_compute

# kernels="auto" swaps in the decode kernel at batch 1 (and compute="auto" picks fp32 compute) for
# models whose linear weights pass this size: past a last-level cache, the step streams them from DRAM.
AUTO_KERNEL_BYTES = 64 * 2**20
COMPUTE_CHOICES = ("auto", "float32", "bfloat16")


def kernels_pay_off(model: torch.nn.Module, device: torch.device) -> bool:
    """At batch 1 the kernel pays where the weights stream from DRAM (a model past the CPU's last-level
    cache): there it reads them 1.2-1.6x faster than F.linear. A small model (the bundled one, 28 MB)
    sits in the cache, where the step is per-call overhead, not bandwidth, and keeps F.linear."""
    stored = {torch.nn.Linear: "weight", Int8Linear: "qweight"}  # what gemv would stream
    return device.type == "cpu" and sum(getattr(m, stored[type(m)]).nbytes for m in model.modules()
                                        if type(m) in stored) >= AUTO_KERNEL_BYTES


def native_step_fits(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether the model's config is one the native step (fast_step.py) implements, on the CPU."""
    from .fast_step import config_reason
    return device.type == "cpu" and config_reason(model.config) is None


def use_kernels(model: torch.nn.Module, device: torch.device, required: bool) -> int:
    """Put sluice's decode CPU kernel (engine/gemv.py) under the model's float and int8 linears: 1-8-row
    decode steps go to it (gemv.ROWS), prefill keeps torch's. Returns how many linears use it. The LLM
    calls this with kernels="auto" at the first request of 2+ rows, or of any size for a model that
    passes AUTO_KERNEL_BYTES, and takes no for an answer; with kernels=True at load, where an
    unavailable kernel is an error."""
    if device.type == "cpu":
        from . import gemv
        # kernels=True asked for it: build it now rather than run without; else SLUICE_KERNEL_BUILD decides
        if gemv.available(wait=True if required else None):
            return gemv.use_fast_linears(model)
        why = gemv.why_unavailable()
    else:
        why = "it runs on the CPU only"
    if required:
        raise ConfigError(f"kernels=True but sluice's CPU kernel is unavailable: {why}")
    return 0


def decode_kernel_building(device: torch.device) -> bool:
    """Whether the decode kernel is still being built in the background, so use_kernels may succeed later."""
    from . import gemv
    return device.type == "cpu" and gemv.building()


def set_compute(model: torch.nn.Module, device: torch.device, compute: str, kernels, quantize) -> bool:
    """Put a bf16 model in "bf16 weights, fp32 compute" (engine/mixed.py) where asked ("float32") or
    where it pays ("auto": a CPU without bf16 instructions, a model past AUTO_KERNEL_BYTES, the kernel
    allowed and available). An int8 or int4 model loaded in bf16 takes it under "auto" where the native step
    runs it (its norms and embedding lookups in fp32, so the step, which computes in fp32, can). Returns whether
    it did."""
    if compute not in COMPUTE_CHOICES:
        raise ConfigError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, got {compute!r}")
    weights = model.embed.weight.dtype
    if compute == "bfloat16" and weights != torch.bfloat16:
        raise ConfigError(f"compute='bfloat16' needs bf16 weights (dtype='bfloat16'), not {weights}")
    if weights != torch.bfloat16 or compute == "bfloat16" or quantize not in (None, "int8", "int4") or (
            quantize is not None and (compute != "auto" or not native_step_fits(model, device))):
        return False
    # "auto": fp32 compute where the native whole step (fast_step.py, fp32 activations only) can run the
    # model, whose step is 5-10x the torch one on small models whatever the CPU; otherwise on a CPU
    # without bf16 instructions for a model that streams its weights from DRAM (the GEMV kernel).
    if compute == "auto" and (kernels is False or not (
            native_step_fits(model, device) or not cpu_has_bf16() and kernels_pay_off(model, device))):
        return False
    from . import gemv
    if kernels is False or device.type != "cpu" or not gemv.available(wait=True if compute == "float32" else None):
        if compute == "auto":
            return False
        why = "kernels=False" if kernels is False else (
            "it runs on the CPU only" if device.type != "cpu" else gemv.why_unavailable())
        raise ConfigError(f"compute='float32' with bf16 weights needs sluice's CPU decode kernel: {why}")
    use_fp32_compute(model)
    return True
