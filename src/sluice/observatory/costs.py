"""What one decode step must move and compute, per component, from a ModelConfig alone (no weights).

`sluice profile` (measured time) and `sluice roofline` (predicted time) share these components, so
a measured share and a predicted one can be set side by side:

    embedding    token (and learned position) embedding rows
    norms        every norm inside the blocks: input, post (sandwich/OLMo 2), per-head or full q/k
    qkv_proj     the q, k and v projections        o_proj   the attention output projection
    attention    RoPE, the KV-cache write and attention over every cache slot (SDPA or soft-capped)
    mlp          gate/up/down (or up/down) and the activation
    final_norm   the norm before the LM head       lm_head  the vocabulary projection (+ logit soft-cap)
    sampling     temperature, filters and the exponential race over the fp32 logits (the softmax)
    other        residual adds, RoPE tables, the attention mask, Python glue between modules

Bytes: `param_bytes` is what a component stores (tied embeddings are stored once, by the embedding,
so the components add up to the model's parameter bytes); `read_bytes` is what one step reads from
memory: every weight matrix whole, one embedding row per sequence (all of it when the LM head reads
it tied), and the whole KV cache, because sluice's static cache attends over every slot and masks
the empty or out-of-window ones (Transformer.attention_mask) -- sliding-window layers included.
FLOPs: matrix products exactly (2 per multiply-add); element-wise work approximately (a few per
element), which is well under 1% of any realistic step.
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig

COMPONENTS = ("embedding", "norms", "qkv_proj", "o_proj", "attention", "mlp", "final_norm", "lm_head",
              "sampling", "other")
LABELS = {"embedding": "embedding", "norms": "norms", "qkv_proj": "q/k/v proj", "o_proj": "o proj",
          "attention": "attention (KV)", "mlp": "MLP", "final_norm": "final norm", "lm_head": "LM head",
          "sampling": "softmax+sampling", "other": "other"}
# approximate element-wise FLOPs per element
_NORM_FLOPS = {"rms": 4, "layer": 7}
_ACT_FLOPS = 8  # silu / gelu, plus the gate product
_SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide
_SAMPLE_FLOPS = 6  # max, subtract, divide, exponential noise, log, argmax


def kv_cache_bytes(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
    """Bytes of keys + values for `context` slots per sequence: what sluice's KVCache allocates."""
    return 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def hidden_norms_per_block(cfg: ModelConfig) -> int:
    return {"pre": 2, "sandwich": 4, "post": 2}[cfg.norm_placement]


def step_costs(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
               act_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None) -> dict[str, dict]:
    """{component: {"param_bytes", "read_bytes", "flops"}} of one decode step: `batch` sequences,
    one new token each, attending over `context` cache slots (the new token's included). dtype: the
    stored matrices and embedding; act_dtype (default dtype): the activations, so the norm gains, which
    "bf16 weights, fp32 compute" (engine/mixed.py) keeps in fp32, and the KV cache unless kv_dtype says
    otherwise (LLM(kv_cache_dtype=))."""
    b = dtype.itemsize
    a = (act_dtype or dtype).itemsize
    C, I, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    H, K, D, B, S = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, batch, context
    q, kv = H * D, K * D
    norm_vecs = 2 if cfg.norm_bias else 1  # gain (+ LayerNorm's bias)
    nf = _NORM_FLOPS[cfg.norm_kind]
    out: dict[str, dict] = {}

    emb_params = V * C + (cfg.max_position_embeddings * C if cfg.pos_embedding == "learned" else 0)
    rows = B * C * (2 if cfg.pos_embedding == "learned" else 1)  # one token row (+ one position row)
    out["embedding"] = dict(param_bytes=emb_params * b, read_bytes=rows * b,
                            flops=B * C * ((cfg.embed_scale is not None) + (cfg.pos_embedding == "learned")))

    hidden = hidden_norms_per_block(cfg)
    qk_width = {None: 0, "head": 2 * D, "full": q + kv}[cfg.qk_norm]  # stored gain widths
    qk_elems = {None: 0, "head": q + kv, "full": q + kv}[cfg.qk_norm]  # elements normalised
    norm_params = L * (hidden * C + qk_width) * norm_vecs
    out["norms"] = dict(param_bytes=norm_params * a, read_bytes=norm_params * a,
                        flops=L * B * nf * (hidden * C + qk_elems))

    qkv = C * (q + 2 * kv) + ((q + 2 * kv) if cfg.qkv_bias else 0)
    out["qkv_proj"] = dict(param_bytes=L * qkv * b, read_bytes=L * qkv * b,
                           flops=L * B * (2 * C * (q + 2 * kv) + (q + 2 * kv) * cfg.qkv_bias))
    o = q * C + (C if cfg.o_bias else 0)
    out["o_proj"] = dict(param_bytes=L * o * b, read_bytes=L * o * b, flops=L * B * (2 * q * C + C * cfg.o_bias))

    rotary = (cfg.rotary_dim or D) if cfg.pos_embedding == "rope" else 0
    per_score = _SOFTMAX_FLOPS + (3 if cfg.attn_softcap else 0)
    attn_flops = 4 * B * H * S * D + per_score * B * H * S + 3 * B * (H + K) * rotary
    out["attention"] = dict(param_bytes=0, read_bytes=kv_cache_bytes(cfg, batch, context, kv_dtype or act_dtype or dtype),
                            flops=L * attn_flops)

    mats = 3 if cfg.mlp_gated else 2
    mlp = mats * C * I + (((mats - 1) * I + C) if cfg.mlp_bias else 0)
    out["mlp"] = dict(param_bytes=L * mlp * b, read_bytes=L * mlp * b,
                      flops=L * B * (2 * mats * C * I + _ACT_FLOPS * I))

    final = C * norm_vecs if cfg.final_norm else 0
    out["final_norm"] = dict(param_bytes=final * a, read_bytes=final * a, flops=B * nf * C * cfg.final_norm)

    head = V * C
    out["lm_head"] = dict(param_bytes=0 if cfg.tie_word_embeddings else head * b, read_bytes=head * b,
                          flops=B * (2 * C * V + (3 * V if cfg.final_softcap else 0)))
    # The sampler reads the fp32 logits; its temporaries (V floats per row) stay in cache.
    out["sampling"] = dict(param_bytes=0, read_bytes=B * V * 4, flops=B * V * _SAMPLE_FLOPS)
    out["other"] = dict(param_bytes=0, read_bytes=0, flops=2 * L * B * C)
    return out


def totals(costs: dict[str, dict]) -> dict[str, int]:
    return {k: sum(c[k] for c in costs.values()) for k in ("param_bytes", "read_bytes", "flops")}
