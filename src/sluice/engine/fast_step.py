"""A native whole-model step (decode, speculative verification, the scheduler's prefill): step.cpp.

Why: a small model's eager step is hundreds of ATen calls, each with a fixed cost (dispatch,
allocation, waking the thread pool) that dwarfs its arithmetic: the bundled 6.8 M-parameter model
spent ~13 ms per decoded token that way, almost none of it in the weights. step.cpp runs the whole
forward of a (B, T) chunk in one OpenMP parallel region over the model's own tensors (no copies)
and writes keys and values straight into the engine's KV cache (bench/fast_step.py has the numbers):
the static (L, B, K, S, D) cache, or a paged pool of blocks read through a block table (below).

Which models: every family sluice loads, each variation a flag or a tensor of the one kernel (house rule 2):
RMSNorm ((1 + w) as Gemma) or LayerNorm with bias; pre, sandwich (Gemma 2/3) or post (OLMo 2) norms;
per-head or full-width qk-norm; GQA; RoPE from the model's own inv_freq (scaled variants and NeoX's
partial rotary come out right) and a second table for Gemma 3's sliding layers, or GPT-2's learned
positions; attention and final soft-caps, embedding scale; NeoX's parallel residual; SwiGLU, GeGLU or
an ungated MLP with SiLU or GELU (erf or tanh); optional biases, tied or untied head, sliding windows;
fp32 or bf16 linear weights with fp32 activations and an fp32 cache (the fp32 model, and
engine/mixed.py's bf16-weight mode), or model/quant.py's int8 and int4 ones (a model loaded with
quantize="int8": each row's sum of code x input, in fp32, times the row's scale; quantize="int4", any group
size: per group the sum of code x input, times the group's scale, plus its zero term, native/q4.h; by default
with x rounded per block of 32 to int8 and integer sums, native/q4i.h: INT4_DOT below). Numerics
are the torch path's in fp32 (for int8 and int4, the product with the dequantized weight, without the bf16
rounding of x and y that torch's quantized ops need), so the cast orders of the families' norms are moot
here. `unsupported(model)` names the first thing outside that (other quantized or custom linears,
bf16 activations, a module class or activation layers.py does not have, norms that mix kinds or eps),
and then the caller keeps the torch path. Forward hooks are such a thing: the observatory relies on them
firing, and this step calls no module.

The step holds references to the tensors it was built over: build it after the model has its final
form (dtype mode, fast linears). unsupported() and FastStep.current() are cheap (walks over the modules),
so callers (native_check) re-check them per request, when hooks may have come or surgery may have replaced
a norm or set a soft-cap: a step that no longer matches its model is built again.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..errors import ConfigError
from ..model.layers import ACTIVATION_FUNCTIONS, MLP, Attention, Block, LayerNorm, RMSNorm, Transformer
from ..model.quant import INT4_GROUP_SIZES, Int4Linear, Int8Linear
from . import gemv, mixed
from .gemv import FastInt4Linear, FastInt8Linear, FastLinear
from .mixed import Bf16WeightLinear, UpcastEmbedding, activation_dtype
from .native import NATIVE_DIR, NativeExtension

_EXT = NativeExtension(NATIVE_DIR / "step.cpp", "whole-step CPU kernel")
_LINEARS = (nn.Linear, FastLinear, Bf16WeightLinear)  # same parameters, forward differs only in speed
_INT8_LINEARS = (Int8Linear, FastInt8Linear)  # qweight and scales: step.cpp multiplies by the codes, then the scale
_INT4_LINEARS = (Int4Linear, FastInt4Linear)  # qweight and scales_zeros (native/q4.h)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
MAX_CHUNK = 64  # tokens per row per kernel call; a longer chunk runs as pieces of this many (small scratch)
# config.hidden_act -> step.cpp's Act: gelu_new and torch's "tanh" GELU are one formula, equal in fp32 to an ulp
_ACT_KINDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "gelu_new": 2}
# The native step's int4 products: "int8" quantizes each activation row per block of 32 to int8 and sums code x
# code in integers (native/q4i.h: llama.cpp's Q4_0 x Q8_0 arithmetic, faster, within its own bound of the
# dequantized model), "fp32" widens the codes and sums in fp32 (q4.h: within 1e-4 of the dequantized model).
# One mode for every chunk, decode and prefill, so a token's numbers never depend on its batch or chunk. Set
# per process by SLUICE_INT4_DOT, or by assigning gemv.INT4_DOT before a FastStep is built, or per step:
# FastStep(model, int4_dot=...).
INT4_DOTS = gemv.INT4_DOTS  # the setting lives in gemv.py, whose FastInt4Linear follows it too
# The native step's bf16-weight products (native/b16.h): "fp32" widens the weights and multiplies in fp32, "bf16"
# rounds x to bf16 (to nearest even) and sums pairs of exact bf16 products with vdpbf16ps (llama.cpp's bf16
# arithmetic), "auto" (the default) is "bf16" where the CPU and build have AVX512_BF16, else "fp32". "bf16" asked
# for where the kernel lacks it is an error. One mode for every chunk. The setting lives in mixed.py (BF16_DOT,
# SLUICE_BF16_DOT), whose Bf16WeightLinear, the torch path, rounds x the same way; or FastStep(bf16_dot=...).
BF16_DOTS = mixed.BF16_DOTS
# The native step's int8-weight products (native/q8t.h): "int8" rounds each activation row per block of 32 to int8
# (Q8_0, as INT4_DOT "int8") and sums code x code in integers (llama.cpp's Q8_0 x Q8_0 arithmetic; within its own
# bound of the dequantized model), "fp32" widens the codes and multiplies in fp32 (within 1e-4 of it). One mode for
# every chunk. Per process by SLUICE_INT8_DOT, or by assigning gemv.INT8_DOT before a FastStep is built (gemv's
# FastInt8Linear follows it too), or FastStep(int8_dot=...).
INT8_DOTS = gemv.INT8_DOTS
# The order in which the AVX-512 decode tiles (one token, 16 weight rows a tile) read their rows: "rows" one after
# the other, each a single stream (step.cpp's tile_rows), or "interleaved", the 16 side by side, a line of each in
# turn. The same sums bit for bit; only the speed differs. "rows" read the decode weights ~1.1-1.25x faster on a
# Zen 5 (bench/decode_order.py measures the two on a machine, alternating in one process). Per process by
# SLUICE_DECODE_ORDER, or FastStep(decode_order=...). (The AVX2 tiles read 4 rows side by side either way: row
# after row lost there, one FMA chain per row.)
DECODE_ORDERS = ("rows", "interleaved")
DECODE_ORDER = os.environ.get("SLUICE_DECODE_ORDER", "rows")

# step.cpp's Phase, in order: what FastStep's counters time (named as observatory/costs.py's components)
PHASES = ("embedding", "norms", "qkv_proj", "attention", "o_proj", "mlp", "final_norm", "lm_head")


def kernel():
    """The compiled extension (built on first call), or None; `why_unavailable()` says why."""
    return _EXT.module()


def why_unavailable() -> str | None:
    return _EXT.why_unavailable()


def building() -> bool:
    """Whether the kernel is still being built in the background (kernel() may turn non-None later); asking
    starts that build if nobody runs one (SLUICE_KERNEL_BUILD=background)."""
    return _EXT.module() is None and _EXT.failure is None


def config_reason(cfg) -> str | None:
    """Every ModelConfig field that changes numerics and step.cpp does not implement (none today but an
    activation outside its table, which a new ModelConfig activation would be until step.cpp has it)."""
    if cfg.hidden_act not in _ACT_KINDS:
        return f"hidden_act={cfg.hidden_act!r} (step.cpp has {', '.join(_ACT_KINDS)})"
    return None


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


def _act_kind(fn) -> int | None:
    return next((_ACT_KINDS[name] for name, f in ACTIVATION_FUNCTIONS.items() if f is fn), None)


def _norm_consts(n: nn.Module) -> tuple[float, float]:
    # The offset only takes part with gain_in_fp32 (RMSNorm.forward); in fp32 the cast order is moot.
    return float(n.eps), float(n.offset) if getattr(n, "gain_in_fp32", False) else 0.0


_NORMS = ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")


def _int8_reason(name: str, lin: Int8Linear) -> str | None:
    q, s = lin.qweight, lin.scales
    if q.dim() != 2 or q.shape[0] != lin.out_features or q.shape[1] < lin.in_features:
        return f"{name}.qweight has shape {tuple(q.shape)}, not ({lin.out_features}, >= {lin.in_features})"
    if s.shape != (lin.out_features,):
        return f"{name}.scales has shape {tuple(s.shape)}, not ({lin.out_features},)"
    return _tensor_reason(f"{name}.qweight", q, (torch.int8,)) or _tensor_reason(f"{name}.scales", s, _WEIGHT_DTYPES)


def _int4_reason(name: str, lin: Int4Linear) -> str | None:
    q, sz, g = lin.qweight, lin.scales_zeros, lin.group_size
    if g not in INT4_GROUP_SIZES:
        return f"{name} has groups of {g} inputs (step.cpp takes {INT4_GROUP_SIZES})"
    if q.dim() != 2 or q.shape[0] < lin.out_features or not 0 <= 2 * q.shape[1] - lin.in_features < g:
        return (f"{name}.qweight has shape {tuple(q.shape)}, not (>= {lin.out_features}, {lin.in_features} inputs "
                f"padded to a group of {g}, / 2)")
    if sz.shape != (2 * q.shape[1] // g, q.shape[0], 2):
        return f"{name}.scales_zeros has shape {tuple(sz.shape)}, not ({2 * q.shape[1] // g}, {q.shape[0]}, 2)"
    return _tensor_reason(f"{name}.qweight", q, (torch.uint8,)) or _tensor_reason(f"{name}.scales_zeros", sz,
                                                                                   (torch.bfloat16,))


def _module_reason(model: Transformer) -> str | None:
    """Module classes and tensors: only what step.cpp reads, in the dtypes it reads."""
    if activation_dtype(model) != torch.float32:
        return f"activations are {activation_dtype(model)} (the native step computes and caches in fp32)"
    for name, emb in (("embedding", model.embed), ("position embedding", model.pos_embed)):
        if emb is not None and type(emb) not in (nn.Embedding, UpcastEmbedding):
            return f"the {name} is a {type(emb).__name__}"
    found = [_tensor_reason("embed.weight", model.embed.weight, _WEIGHT_DTYPES),
             _tensor_reason("inv_freq", model.inv_freq), _tensor_reason("inv_freq_local", model.inv_freq_local, optional=True)]
    if model.pos_embed is not None:
        found.append(_tensor_reason("pos_embed.weight", model.pos_embed.weight, _WEIGHT_DTYPES))
    norms = [("final_norm", model.final_norm)]
    linears = [("lm_head", model.lm_head)]
    same = {"scale": set(), "act": set(), "qk": set()}  # what step.cpp takes once for the whole model
    for i, blk in enumerate(model.layers):
        a, mlp = blk.attn, blk.mlp
        if (type(blk), type(a), type(mlp)) != (Block, Attention, MLP):
            return f"layer {i} has a {type(blk).__name__}/{type(a).__name__}/{type(mlp).__name__}"
        if blk.parallel and (blk.attn_post_norm is not None or blk.mlp_post_norm is not None):
            return f"layer {i} has post-norms and a parallel residual"
        if _act_kind(mlp.act) is None:
            return f"layer {i}'s MLP activation is {getattr(mlp.act, '__name__', mlp.act)!r}, not one of layers.py's"
        norms += [(f"layers.{i}.{n}", getattr(blk, n)) for n in _NORMS]
        norms += [(f"layers.{i}.attn.{n}", getattr(a, n)) for n in ("q_norm", "k_norm")]
        linears += [(f"layers.{i}.attn.{n}", getattr(a, n)) for n in ("q", "k", "v", "o")]
        linears += [(f"layers.{i}.mlp.{n}", getattr(mlp, n)) for n in ("gate", "up", "down")
                    if getattr(mlp, n) is not None]
        same["scale"].add(float(a.scale))
        same["act"].add(_act_kind(mlp.act))
        same["qk"].add(a.full_width_qk_norm if a.q_norm is not None else None)
    for name, lin in linears:
        if type(lin) in _INT8_LINEARS:
            found += [_int8_reason(name, lin)]
        elif type(lin) in _INT4_LINEARS:
            found += [_int4_reason(name, lin)]
        elif type(lin) in _LINEARS:
            found += [_tensor_reason(f"{name}.weight", lin.weight, _WEIGHT_DTYPES)]
        else:
            return (f"{name} is a {type(lin).__name__} (step.cpp reads float, int8 and int4 weights: other quantized "
                    "or custom linears stay on the torch path)")
        found += [_tensor_reason(f"{name}.bias", lin.bias, _WEIGHT_DTYPES, optional=True)]
    norms = [(name, n) for name, n in norms if n is not None]
    for name, n in norms:
        if type(n) not in (RMSNorm, LayerNorm):
            return f"{name} is a {type(n).__name__} from {type(n).__module__}, not layers.py's RMSNorm or LayerNorm"
        found += [_tensor_reason(f"{name}.weight", n.weight), _tensor_reason(f"{name}.bias", getattr(n, "bias", None),
                                                                            optional=True)]
    if len({type(n) for _, n in norms}) > 1:
        return "the model mixes RMSNorm and LayerNorm (step.cpp takes one kind for all norms)"
    if len({_norm_consts(n) for _, n in norms}) > 1 or len(same["scale"]) > 1:
        return "the norms' eps/offset or the layers' attention scales differ"
    if len(same["act"]) > 1 or len(same["qk"] - {None}) > 1:
        return "the layers' MLP activations or qk-norm widths differ"
    if len({lin.group_size for _, lin in linears if type(lin) in _INT4_LINEARS}) > 1:
        return "the int4 linears' group sizes differ (step.cpp takes one per model)"
    return next((why for why in found if why), None)


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot take the native step (a sentence), or None when it can."""
    if not isinstance(model, Transformer):
        return f"a {type(model).__name__} is not a sluice Transformer"
    if hasattr(model, "full_config"):  # parallel/sharding.py's rank part
        return ("the model is one rank's part under tensor parallelism (the native step runs the whole model in "
                "one call; a rank's part needs an all-reduce after the attention output and the MLP inside it)")
    return config_reason(model.config) or _hook_reason(model) or _module_reason(model) or why_unavailable()


def _weight(m: nn.Module) -> torch.Tensor:
    """What step.cpp reads as a module's weight: a norm's gain, a linear's weight, an Int8Linear's or Int4Linear's
    codes."""
    return m.qweight if isinstance(m, (Int8Linear, Int4Linear)) else m.weight


def _scales(lin: nn.Module | None) -> torch.Tensor | None:
    if isinstance(lin, Int4Linear):
        return lin.scales_zeros
    return lin.scales if isinstance(lin, Int8Linear) else None


def _sources(model: Transformer):
    """What step.cpp's Step is built from, in its order (None for an absent tensor): per layer the 26 tensors
    of its norms and linears, the embeddings, final norm, head, the int8 linears' row scales or the int4 ones'
    scales_zeros (per layer q, k, v, o, gate, up, down, then the head), RoPE tables, per-layer lists, options."""
    tensors, scales = [], []
    for blk in model.layers:
        a, mlp = blk.attn, blk.mlp
        parts = [blk.attn_norm, a.q, a.k, a.v, a.o, a.q_norm, a.k_norm, blk.attn_post_norm, blk.mlp_norm,
                 mlp.gate, mlp.up, mlp.down, blk.mlp_post_norm]
        for m in parts:
            tensors += [None, None] if m is None else [_weight(m), getattr(m, "bias", None)]
        scales += [_scales(m) for m in (a.q, a.k, a.v, a.o, mlp.gate, mlp.up, mlp.down)]
    scales.append(_scales(model.lm_head))
    cfg, layers = model.config, model.layers
    first = next((n for blk in layers for n in (blk.attn_norm, blk.attn_post_norm)
                  if n is not None), model.final_norm)
    eps, offset = _norm_consts(first) if first is not None else (1e-6, 0.0)
    opts = {"eps": eps, "norm_offset": offset, "layer_norm": float(isinstance(first, LayerNorm)),
            "scale": float(layers[0].attn.scale) if len(layers) else 1.0,
            "act": float(_act_kind(layers[0].mlp.act)) if len(layers) else 0.0,
            "qk_full_width": float(any(blk.attn.full_width_qk_norm and blk.attn.q_norm is not None for blk in layers)),
            "parallel_residual": float(any(blk.parallel for blk in layers)),
            "embed_scale": float(cfg.embed_scale or 0.0), "final_softcap": float(model.final_softcap or 0.0)}
    local = model.inv_freq_local is not None
    per_layer = ([cfg.sliding_window if s else 0 for s in model.sliding],
                 [float(blk.attn.softcap or 0.0) for blk in layers], [bool(s and local) for s in model.sliding])
    fn = model.final_norm
    final = [None, None] if fn is None else [fn.weight, getattr(fn, "bias", None)]
    # GPT-2's learned positions take the place of RoPE: no table, so step.cpp rotates nothing.
    rope = model.pos_embed is None
    pos = None if rope else model.pos_embed.weight
    return (tensors, model.embed.weight, pos, final, _weight(model.lm_head), scales, model.inv_freq if rope else None,
            model.inv_freq_local if rope else None, per_layer, opts)


def _signature(sources) -> tuple:
    tensors, embed, pos, final, head, scales, inv, inv_local, per_layer, opts = sources
    ids = tuple(None if t is None else id(t) for t in [*tensors, embed, pos, *final, head, *scales, inv, inv_local])
    return ids, tuple(map(tuple, per_layer)), tuple(sorted(opts.items()))


class FastStep:
    """`step(tokens (B, T), positions (B, T), k, v, hidden=False, block_table=None, counters=None)` -> fp32 logits
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

    def __init__(self, model: Transformer, int4_dot: str | None = None, bf16_dot: str | None = None,
                 int8_dot: str | None = None, decode_order: str | None = None):
        why = unsupported(model)
        if why is not None:
            raise ConfigError(f"the native step cannot run this model: {why}")
        self.model, cfg = model, model.config
        self.built_from = _sources(model)  # held, so no id in it can be reused while this step lives
        tensors, embed, pos, final, head, scales, inv, inv_local, per_layer, opts = self.built_from
        self.int4_dot = int4_dot or gemv.INT4_DOT
        if self.int4_dot not in INT4_DOTS:
            raise ConfigError(f"SLUICE_INT4_DOT (int4_dot) must be one of {', '.join(INT4_DOTS)}, "
                              f"got {self.int4_dot!r}")
        self.bf16_dot = mixed.bf16_dot(bf16_dot)  # "fp32" or "bf16" (auto resolved)
        if self.bf16_dot == "bf16" and not kernel().has_bf16_dot() and (bf16_dot or mixed.BF16_DOT) == "auto":
            self.bf16_dot = "fp32"  # (a compiler without AVX512_BF16: see mixed.auto_bf16_dot)
        if self.bf16_dot == "bf16" and not kernel().has_bf16_dot():
            raise ConfigError("SLUICE_BF16_DOT=bf16 needs a CPU with AVX512_BF16 (vdpbf16ps); this one lacks it: "
                              "use fp32")
        self.int8_dot = int8_dot or gemv.INT8_DOT
        if self.int8_dot not in INT8_DOTS:
            raise ConfigError(f"SLUICE_INT8_DOT (int8_dot) must be one of {', '.join(INT8_DOTS)}, "
                              f"got {self.int8_dot!r}")
        self.decode_order = decode_order or DECODE_ORDER
        if self.decode_order not in DECODE_ORDERS:
            raise ConfigError(f"SLUICE_DECODE_ORDER (decode_order) must be one of {', '.join(DECODE_ORDERS)}, "
                              f"got {self.decode_order!r}")
        opts = {**opts, "int4_dot": float(self.int4_dot == "int8"), "bf16_dot": float(self.bf16_dot == "bf16"),
                "int8_dot": float(self.int8_dot == "int8"), "decode_rows": float(self.decode_order == "rows")}
        # bf16 biases (mixed.py leaves a linear's bias in its dtype) and int8 row scales (quant.py keeps them in
        # bf16) widen exactly to the fp32 step.cpp reads: a copy of N floats per linear, made once here. int4 codes
        # have rows padded to a multiple of 16: step.cpp gets the first out_features (a view) and the scales as
        # they are (bf16, read in place).
        rows = {id(m.qweight): m.out_features for m in model.modules() if isinstance(m, Int4Linear)}
        kept = [torch.empty(0) if t is None else t.detach().float() if t.dim() == 1 else t.detach()[:rows.get(id(t))]
                for t in tensors]
        none = torch.empty(0)
        scales = [none if s is None else s.detach() if s.dim() == 3 else s.detach().float().contiguous()
                  for s in scales]
        head = head.detach()[:rows.get(id(head))]
        self._step = kernel().Step(kept, embed.detach(), none if pos is None else pos.detach(),
                                   [none if t is None else t.detach() for t in final], head, scales,
                                   none if inv is None else inv, none if inv_local is None else inv_local, *per_layer,
                                   cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, opts)

    def current(self) -> bool:
        """Whether the model still has the tensors and settings this step was built over (surgery may
        replace a norm or set a soft-cap; a caller then builds a new step)."""
        return _signature(self.built_from) == _signature(_sources(self.model))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 hidden: bool = False, block_table: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None) -> torch.Tensor:
        T = tokens.shape[-1]
        if T <= MAX_CHUNK:
            return self._step.run(tokens, positions, k, v, hidden, block_table, counters)
        # A long chunk (a prompt's prefill) runs as pieces of MAX_CHUNK tokens, in order. That gives bit for
        # bit what one call would: step.cpp computes each token's products alone, in an order that does not
        # depend on how many rows share the call, and its attention reads the keys and values the earlier
        # pieces wrote. So a prompt's numbers never depend on how the scheduler cut it into chunks.
        return torch.cat([self._step.run(tokens[:, t0:t0 + MAX_CHUNK], positions[:, t0:t0 + MAX_CHUNK], k, v,
                                         hidden, block_table, counters) for t0 in range(0, T, MAX_CHUNK)], 1)

    def guess(self, last_two: list[int], start: list[int], k: torch.Tensor, v: torch.Tensor, tables: list[list[int]],
              caps: list[int], temperature: list[float], sampled: list[bool], keys: list[int], draws: list[int],
              want_q: bool, lanes: int):
        """A draft's round of guesses in one native call (step.cpp's guess; proposers.DraftProposer says what it
        computes): (each row's guesses, q (B, K, V) or empty, deferred)."""
        return self._step.guess(last_two, start, k, v, tables, caps, temperature, sampled, keys, draws, want_q, lanes)

    @staticmethod
    def counters() -> torch.Tensor:
        """Zeroed phase counters for __call__(counters=...): each call adds the seconds of each phase (PHASES,
        the profile's component names; qkv_proj includes the qk-norms, RoPE and the cache writes). Without
        them the step times nothing."""
        return torch.zeros(len(PHASES), dtype=torch.float64)


def native_check(model: nn.Module, fast: FastStep | None) -> tuple[str | None, FastStep | None]:
    """For a caller about to run `model`: (why the native step cannot run it now, or None; the FastStep,
    `fast` as given, or built now: the first time it can, or again when the model is no longer the one
    `fast` was built over). The Runner and the Scheduler ask per request or busy period, since a hook may
    have been attached, or surgery done, in between."""
    why = unsupported(model)
    stale = isinstance(fast, FastStep) and not fast.current()  # (anything else is a caller's wrapper: kept)
    if why is None and (fast is None or stale):
        fast = FastStep(model)
    return why, fast
