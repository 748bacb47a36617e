"""A native whole-model step (decode, speculative verification, the scheduler's prefill): step.cpp.

Why: a small model's eager step is hundreds of ATen calls, each with a fixed cost (dispatch,
allocation, waking the thread pool) that dwarfs its arithmetic: the bundled 6.8 M-parameter model
spent ~13 ms per decoded token that way, almost none of it in the weights. step.cpp runs the whole
forward of a (B, T) chunk in one OpenMP parallel region over the model's own tensors (no copies)
and writes keys and values straight into the engine's KV cache (bench/fast_step.py has the numbers):
the static (L, B, K, S, D) cache, or a paged pool of blocks read through a block table (below).

Which models: the pre-norm RMSNorm decoders (Llama, Qwen2, Qwen3, Mistral): optional per-head
qk-norm, GQA, RoPE from the model's own inv_freq (so scaled variants and partial rotary come out
right), SwiGLU, optional biases, tied or untied head, sliding windows, fp32 or bf16 linear weights
with fp32 activations and an fp32 cache (the fp32 model, and engine/mixed.py's bf16-weight mode).
`unsupported(model)` names the first thing outside that, and then the caller keeps the torch path.
Forward hooks are such a thing: the observatory relies on them firing, and this step calls no module.

The step holds references to the tensors it was built over: build it after the model has its final
form (dtype mode, fast linears), and again after anything replaces a parameter object. unsupported()
is cheap (a walk over the modules), so callers re-check it per request, when hooks may have come.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..model.layers import MLP, Attention, Block, RMSNorm, Transformer
from .gemv import FastLinear
from .mixed import Bf16WeightLinear, UpcastEmbedding, activation_dtype
from .native import NATIVE_DIR, NativeExtension

_EXT = NativeExtension(NATIVE_DIR / "step.cpp", "whole-step CPU kernel")
_LINEARS = (nn.Linear, FastLinear, Bf16WeightLinear)  # same parameters, forward differs only in speed
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
MAX_CHUNK = 64  # tokens per row per kernel call; a longer chunk runs as pieces of this many (small scratch)


def kernel():
    """The compiled extension (built on first call), or None; `why_unavailable()` says why."""
    return _EXT.module()


def why_unavailable() -> str | None:
    return _EXT.why_unavailable()


def config_reason(cfg) -> str | None:
    """Every ModelConfig field that changes numerics and step.cpp does not implement."""
    checks = (
        (cfg.norm_kind != "rms", f"norm_kind={cfg.norm_kind!r} (step.cpp has RMSNorm only)"),
        (cfg.norm_placement != "pre", f"norm_placement={cfg.norm_placement!r} (pre-norm only)"),
        (cfg.parallel_residual, "parallel_residual (NeoX's parallel attention + MLP)"),
        (cfg.qk_norm not in (None, "head"), f"qk_norm={cfg.qk_norm!r} (per-head qk-norm only)"),
        (not cfg.mlp_gated, "an ungated MLP (SwiGLU only)"),
        (cfg.hidden_act != "silu", f"hidden_act={cfg.hidden_act!r} (SiLU only)"),
        (cfg.pos_embedding != "rope", f"pos_embedding={cfg.pos_embedding!r} (RoPE only)"),
        (cfg.embed_scale is not None, f"embed_scale={cfg.embed_scale}"),
        (cfg.attn_softcap is not None, f"attn_softcap={cfg.attn_softcap}"),
        (cfg.final_softcap is not None, f"final_softcap={cfg.final_softcap}"),
        (cfg.rope_theta_local is not None, f"rope_theta_local={cfg.rope_theta_local} (a second RoPE base)"),
    )
    return next((why for bad, why in checks if bad), None)


def _hook_reason(model: nn.Module) -> str | None:
    g = nn.modules.module
    if g._global_forward_hooks or g._global_forward_pre_hooks:
        return "a global forward hook is registered (it would not fire)"
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return f"a forward hook is registered on {name or 'the model'} (it would not fire)"
    return None


def _tensor_reason(name: str, t: torch.Tensor | None, dtypes=(torch.float32,), optional=False) -> str | None:
    if t is None:
        return None if optional else f"{name} is missing"
    if t.device.type != "cpu":
        return f"{name} is on {t.device} (the native step is CPU only)"
    if t.dtype not in dtypes:
        return f"{name} is {t.dtype} (supported: {', '.join(str(d) for d in dtypes)})"
    if not t.is_contiguous():
        return f"{name} is not contiguous"
    return None


def _module_reason(model: Transformer) -> str | None:
    """Module classes and tensors: only what step.cpp reads, in the dtypes it reads."""
    if activation_dtype(model) != torch.float32:
        return f"activations are {activation_dtype(model)} (the native step computes and caches in fp32)"
    if type(model.embed) not in (nn.Embedding, UpcastEmbedding) or model.pos_embed is not None:
        return f"the embedding is a {type(model.embed).__name__}"
    if model.final_softcap is not None:  # an attribute surgery may set, like each layer's attn.softcap
        return f"final_softcap={model.final_softcap}"
    norms = [model.final_norm] if model.final_norm is not None else []
    found = [_tensor_reason("embed.weight", model.embed.weight, _WEIGHT_DTYPES),
             _tensor_reason("inv_freq", model.inv_freq), model.inv_freq_local is not None and "a local RoPE table"]
    linears = [("lm_head", model.lm_head)]
    scales = set()
    for i, blk in enumerate(model.layers):
        a, mlp = blk.attn, blk.mlp
        if (type(blk), type(a), type(mlp)) != (Block, Attention, MLP):
            return f"layer {i} has a {type(blk).__name__}/{type(a).__name__}/{type(mlp).__name__}"
        if blk.parallel or blk.attn_post_norm is not None or blk.mlp_post_norm is not None:
            return f"layer {i} has post-norms or a parallel residual"
        if a.softcap is not None or a.full_width_qk_norm or mlp.act is not F.silu or mlp.gate is None:
            return f"layer {i} has an attention soft-cap, full-width qk-norm or a non-SwiGLU MLP"
        norms += [blk.attn_norm, blk.mlp_norm] + ([a.q_norm, a.k_norm] if a.q_norm is not None else [])
        linears += [(f"layers.{i}.attn.{n}", getattr(a, n)) for n in ("q", "k", "v", "o")]
        linears += [(f"layers.{i}.mlp.{n}", getattr(mlp, n)) for n in ("gate", "up", "down")]
        scales.add(float(a.scale))
    for name, lin in linears:
        if type(lin) not in _LINEARS:
            return f"{name} is a {type(lin).__name__} (quantized or custom linears stay on the torch path)"
        found += [_tensor_reason(f"{name}.weight", lin.weight, _WEIGHT_DTYPES),
                  _tensor_reason(f"{name}.bias", lin.bias, optional=True)]
    if any(type(n) is not RMSNorm for n in norms):
        return "a norm is not an RMSNorm"
    found += [_tensor_reason("a norm weight", n.weight) for n in norms]
    if len({_norm_consts(n) for n in norms}) > 1 or len(scales) > 1:
        return "the norms' eps/offset or the layers' attention scales differ"
    return next((why for why in found if why), None)


def _norm_consts(n: RMSNorm) -> tuple[float, float]:
    # The offset only takes part with gain_in_fp32 (RMSNorm.forward); in fp32 the cast order is moot.
    return float(n.eps), float(n.offset) if n.gain_in_fp32 else 0.0


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot take the native step (a sentence), or None when it can."""
    if not isinstance(model, Transformer):
        return f"a {type(model).__name__} is not a sluice Transformer"
    return config_reason(model.config) or _hook_reason(model) or _module_reason(model) or why_unavailable()


class FastStep:
    """`step(tokens (B, T), positions (B, T), k, v, hidden=False, block_table=None)` -> fp32 logits
    (B, T, V), or the final-normed hidden states (B, T, C) with hidden=True; writes the chunk's keys and
    values into the cache tensors k, v at `positions`, as the torch forward does. Token t of a row
    sees the slots <= its position (Transformer.attention_mask), so a chunk is causal within itself.

    The cache is either static, k, v (L, B, K, S, D) with block_table None, or a paged pool (the
    continuous-batching scheduler's, engine/paged_cache.py), k, v (L, NB, K, bs, D) fp32 with a block
    table (B, nb) of int64 (no copy) or int32 block ids: slot s of row b (its position s) is in block
    block_table[b, s // bs] at offset s % bs. The entries up to each row's highest position must be
    block ids of the pool; later ones are never read (pad with anything). Both layouts run the same
    code in step.cpp, so a paged step gives bit for bit the logits of the static one. Bad input (a
    position past the table, a block id outside the pool) raises RuntimeError before anything runs.
    """

    def __init__(self, model: Transformer):
        why = unsupported(model)
        if why is not None:
            raise ConfigError(f"the native step cannot run this model: {why}")
        cfg, none = model.config, torch.empty(0)
        tensors = []
        for blk in model.layers:
            a, mlp = blk.attn, blk.mlp
            qn, kn = (a.q_norm.weight, a.k_norm.weight) if a.q_norm is not None else (none, none)
            for t in (blk.attn_norm.weight, a.q.weight, a.q.bias, a.k.weight, a.k.bias, a.v.weight, a.v.bias,
                      a.o.weight, a.o.bias, qn, kn, blk.mlp_norm.weight, mlp.gate.weight, mlp.gate.bias,
                      mlp.up.weight, mlp.up.bias, mlp.down.weight, mlp.down.bias):
                tensors.append(none if t is None else t.detach())
        windows = [cfg.sliding_window if s else 0 for s in model.sliding]
        eps, offset = _norm_consts(model.layers[0].attn_norm) if len(model.layers) else (1e-6, 0.0)
        final = model.final_norm.weight.detach() if model.final_norm is not None else None
        self.model = model
        self._step = kernel().Step(tensors, model.embed.weight.detach(), final, model.lm_head.weight.detach(),
                                   model.inv_freq, windows, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   eps, offset, float(model.layers[0].attn.scale) if len(model.layers) else 1.0)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 hidden: bool = False, block_table: torch.Tensor | None = None) -> torch.Tensor:
        T = tokens.shape[-1]
        if T <= MAX_CHUNK:
            return self._step.run(tokens, positions, k, v, hidden, block_table)
        # A long chunk (a prompt's prefill) runs as pieces of MAX_CHUNK tokens, in order. That gives bit for
        # bit what one call would: step.cpp computes each token's products alone, in an order that does not
        # depend on how many rows share the call, and its attention reads the keys and values the earlier
        # pieces wrote. So a prompt's numbers never depend on how the scheduler cut it into chunks.
        return torch.cat([self._step.run(tokens[:, t0:t0 + MAX_CHUNK], positions[:, t0:t0 + MAX_CHUNK], k, v,
                                         hidden, block_table) for t0 in range(0, T, MAX_CHUNK)], 1)


def native_check(model: nn.Module, fast: FastStep | None) -> tuple[str | None, FastStep | None]:
    """For a caller about to run `model`: (why the native step cannot run it now, or None; the FastStep,
    `fast` as given or built now, the first time it can). The Runner and the Scheduler ask per request
    or busy period, since a hook may have been attached in between."""
    why = unsupported(model)
    if why is None and fast is None:
        fast = FastStep(model)
    return why, fast
