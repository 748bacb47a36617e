"""The decoder: norms, RoPE, attention, MLP, Block, Transformer. Plain torch.

One class per piece; variation between families comes from ModelConfig fields (see model/config.py).
Numerics follow transformers' Llama/Qwen code: norms in fp32 and cast back to the activation
dtype *before* the weight multiply, RoPE tables in fp32, logits returned in fp32.

Shapes: B batch, T new tokens, S cache slots, H query heads, K kv heads, D head_dim, C hidden.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g: no mean subtraction and no bias (cf. LayerNorm).

    The statistics are always fp32. Two family choices (config.py): the gain g is `weight` (Llama,
    Qwen, OLMo 2) or `1 + weight` (Gemma, whose weights are stored as offsets from 1, `offset=1`);
    and the cast back to the activation dtype happens before the gain multiply (Llama, Qwen) or
    after it, with the gain applied in fp32 (Gemma, OLMo 2: `gain_in_fp32`). In bf16 the two
    orders round differently, so each family follows its reference."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, gain_in_fp32: bool = False):
        super().__init__()
        self.eps, self.offset, self.gain_in_fp32 = eps, offset, gain_in_fp32
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def gain(self) -> torch.Tensor:
        """The effective per-channel gain, fp32 (what surgery carries over to another norm kind)."""
        return self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gain_in_fp32:
            return (x32 * (self.weight.float() + self.offset)).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, gain_in_fp32={self.gain_in_fp32}"


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * w + b, as GPT-2 and GPT-NeoX normalise.

    F.layer_norm accumulates mean and variance in fp32 even for bf16 inputs and rounds once at the
    end, which is exactly what transformers' nn.LayerNorm does for these families."""

    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def gain(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, (D/2,) fp32, with the config's scaling rule applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / sc["factor"]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, blended, scaled)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin for `positions` (B, T) -> two (B, T, D) tensors in `dtype`, computed in fp32."""
    freqs = positions.float()[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D): halves layout, as HF checkpoints expect
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, D); rotates the pair (x[i], x[i + D/2]) by the position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        C, D = cfg.hidden_size, cfg.head_dim
        self.q = nn.Linear(C, self.n_heads * D, bias=cfg.qkv_bias)
        self.k = nn.Linear(C, self.n_kv * D, bias=cfg.qkv_bias)
        self.v = nn.Linear(C, self.n_kv * D, bias=cfg.qkv_bias)
        self.o = nn.Linear(self.n_heads * D, C, bias=cfg.o_bias)
        # Qwen3 normalises each head's q and k (over D) before RoPE, bounding attention logits.
        self.q_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm == "head" else None
        self.k_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm == "head" else None

    def forward(self, x, cos, sin, mask, kv=None, positions=None):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.k(x).view(B, T, self.n_kv, self.head_dim)  # (B, T, K, D)
        v = self.v(x).view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            # Static cache (B, S, K, D): write the new keys at their positions, attend over all slots;
            # the mask hides slots that are empty or in the future.
            k_cache, v_cache = kv
            rows = torch.arange(B, device=x.device)[:, None]
            k_cache[rows, positions] = k.to(k_cache.dtype)
            v_cache[rows, positions] = v.to(v_cache.dtype)
            k, v = k_cache, v_cache
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, H|K, T|S, D)
            attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_heads != self.n_kv,
        )  # (B, H, T, D)
        return self.o(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.gate = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.up = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.down = nn.Linear(I, C, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm block: the residual stream x passes through untouched except for two additions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, kv=None, positions=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, kv, positions)
        x = x + self.mlp(self.mlp_norm(x))
        return x  # the full residual stream x_{l+1}, so a forward hook sees it exactly


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # Derived from the config, never loaded: rebuilt by reset_rope() after a meta-device build.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def reset_rope(self, device=None):
        self.inv_freq = rope_inv_freq(self.config).to(device or self.embed.weight.device)

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None):
        """Fresh weights for training: normal(0, std) matrices, zero biases, unit norms."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std, generator=generator)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def attention_mask(self, positions: torch.Tensor, num_slots: int) -> torch.Tensor:
        """(B, 1, T, S) bool: query at position p sees cache slot s iff s <= p (and within the window).

        Slots are positions: row b's token at position p lives in slot p. Padding at the end of a
        short prompt is therefore never visible to that row's real tokens."""
        slots = torch.arange(num_slots, device=positions.device)
        visible = slots <= positions[..., None]  # (B, T, S)
        if self.config.sliding_window:
            visible &= slots > positions[..., None] - self.config.sliding_window
        return visible[:, None]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache=None, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V) in fp32.

        positions (B, T): RoPE positions, default 0..T-1. cache: a KVCache (kv_cache.py); new keys
        are written at `positions`. logits_at (B,): only compute logits at that index of T per row
        (prefill needs just the last token), giving (B, 1, V)."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids)  # (B, T, C)
        cos, sin = rope_tables(self.inv_freq, positions, x.dtype)
        if cache is not None:
            mask = self.attention_mask(positions, cache.num_slots)
        elif self.config.sliding_window and T > self.config.sliding_window:
            mask = self.attention_mask(positions, T)
        else:
            mask = None  # plain causal: lets SDPA pick its fastest kernel
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache.layer(i) if cache is not None else None, positions)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]  # (B, 1, C)
        x = self.final_norm(x)
        return self.lm_head(x).float()  # (B, T, V) fp32: softmax and sampling work in fp32
