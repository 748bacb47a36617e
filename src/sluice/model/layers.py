"""The decoder: norms, RoPE, attention, MLP, Block, Transformer. Plain torch.

One class per piece; every family (Llama, Qwen, Mistral, GPT-2, GPT-NeoX, Gemma 2/3, OLMo 2) runs
this same code, and the differences are ModelConfig fields (see model/config.py): which norm, where
it sits, soft-caps, scales, positions. Statistics of norms, RoPE tables, softmax and logits are
fp32 whatever the weight dtype; each family's cast order is kept (see RMSNorm).

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

    def mean_square(self, x32: torch.Tensor) -> torch.Tensor:
        """mean(x^2) over the normalised channels, fp32 (B, T, 1); a tensor-parallel subclass
        (parallel/layers.py) takes it over channels spread across ranks."""
        return x32.pow(2).mean(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(self.mean_square(x32) + self.eps)
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


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The family's norm over the last `dim` channels."""
    if cfg.norm_kind == "layer":
        return LayerNorm(dim, cfg.norm_eps, bias=cfg.norm_bias)
    return RMSNorm(dim, cfg.norm_eps, offset=cfg.norm_offset, gain_in_fp32=cfg.norm_gain_fp32)


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies, (R/2,) fp32, R = the rotary width of a head. `theta` overrides
    the base (Gemma 3's sliding layers), and then no scaling rule applies."""
    d = cfg.rotary_dim or cfg.head_dim
    base = theta or cfg.rope_theta
    # On the CPU even inside a meta-device build (every checkpoint load): arithmetic on meta tensors runs
    # torch's reference decompositions, which import torch._dynamo (~1.5 s of every start). reset_rope()
    # moves the table to the model's device.
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    sc = cfg.rope_scaling
    if sc is None or theta is not None:
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
    """cos/sin for `positions` (B, T) -> two (B, T, R) tensors in `dtype`, computed in fp32."""
    freqs = positions.float()[..., None] * inv_freq  # (B, T, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, R): halves layout, as HF checkpoints expect
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, D); rotates the pair (x[i], x[i + R/2]) of the first R channels by the
    position's angle. With partial rotary (NeoX, R < D) the other D - R channels pass unrotated."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :R], cos, sin), x[..., R:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def softcapped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """Attention with Gemma 2's soft-cap on the scores: cap * tanh(s / cap) bounds every score to
    (-cap, cap) before the softmax. SDPA cannot do this, so the scores are materialised.
    q (B, H, T, D), k/v (B, K, S, D), mask (B, 1, T, S) bool or None (plain causal) -> (B, H, T, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def decode_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """One new token per row against the whole cache, in fp32: q (B, H, 1, D), k/v (B, K, S, D) with
    H = K * G, mask (B, 1, 1, S) bool -> (B, H, 1, D) in q's dtype.

    The G query heads that share a KV head are one (G, D) @ (D, S) product, so each head's cache is
    read in place, once (SDPA's GQA path repeats it G times). In fp32 because on CPUs without bf16
    instructions a bf16 matmul is slower than casting the cache up and multiplying in fp32
    (docs/changelog-benchmarks.md, 2026-11-30 "Fast decode"); the softmax is fp32 as everywhere in sluice."""
    B, H, _, D = q.shape
    K = k.shape[1]
    qg = q.reshape(B, K, H // K, D).float()  # (B, K, G, D)
    scores = (qg @ k.float().transpose(-1, -2)) * scale  # (B, K, G, S)
    scores = scores.masked_fill(~mask.view(B, 1, 1, -1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()  # (B, K, G, D)
    return out.reshape(B, H, 1, D).to(q.dtype)


class Attend(nn.Module):
    """softmax(mask(cap(q k^T * scale))) v with the kernel that suits the call. No weights: it is a
    module of its own so that a forward hook sees exactly what the softmax is made of (q and k after
    their norms, RoPE and the cache, the mask with any sliding window, the scale, the soft-cap); the
    observatory's per-head statistics read it (observatory/attention.py). Unhooked, it is one call.

    q (B, H, T, D), k/v (B, K, S, D), mask (B, 1, T, S) bool, or None for plain causal over S = T."""

    def forward(self, q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
        if softcap is not None:
            return softcapped_attention(q, k, v, mask, scale, softcap)
        if q.shape[2] == 1 and mask is not None:  # a decode step (a cache always comes with a mask)
            return decode_attention(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        C, D = cfg.hidden_size, cfg.head_dim
        self.q = nn.Linear(C, self.n_heads * D, bias=cfg.qkv_bias)
        self.k = nn.Linear(C, self.n_kv * D, bias=cfg.qkv_bias)
        self.v = nn.Linear(C, self.n_kv * D, bias=cfg.qkv_bias)
        self.o = nn.Linear(self.n_heads * D, C, bias=cfg.o_bias)
        # q/k norms bound the attention logits: over each head's D channels (Qwen3, Gemma 3) or over
        # the whole projection (OLMo 2). Applied before RoPE.
        widths = {"head": (D, D), "full": (self.n_heads * D, self.n_kv * D)}.get(cfg.qk_norm)
        self.q_norm = make_norm(cfg, widths[0]) if widths else None
        self.k_norm = make_norm(cfg, widths[1]) if widths else None
        self.full_width_qk_norm = cfg.qk_norm == "full"
        self.scale = cfg.attn_scale or D ** -0.5
        self.softcap = cfg.attn_softcap  # an attribute, not read from config: surgery may change it
        self.attend = Attend()

    def forward(self, x, cos, sin, mask, kv=None, positions=None):
        B, T, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, H*D), (B, T, K*D), (B, T, K*D)
        if self.q_norm is not None and self.full_width_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = k.view(B, T, self.n_kv, self.head_dim)  # (B, T, K, D)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None and not self.full_width_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # None: positions are learned embeddings (GPT-2), no rotation
            # (.to: OLMo 2's tables are fp32, so the rotation is fp32 and rounds once, here)
            q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        q = q.transpose(1, 2)  # (B, H, T, D)
        if kv is not None:
            # A cache layer (engine/kv_cache.py: static; engine/paged_cache.py: blocks) stores the new
            # keys at their positions and gives back all S slots (B, K, S, D); slot s holds position s,
            # and the mask hides slots that are empty or in the future.
            k, v = kv.write(k, v, positions)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, K, T, D)
        out = self.attend(q, k, v, mask, self.scale, self.softcap)  # (B, H, T, D)
        return self.o(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, C)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU: the tanh approximation written out, every op rounded to x's dtype as GPT-2's
    reference computes it (in bf16 this differs from the fused kernel by a few ulps)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# config.hidden_act -> the function MLP applies (public: the native step reads which one a layer has)
ACTIVATION_FUNCTIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
                        "gelu_new": gelu_new}


class MLP(nn.Module):
    """Gated (SwiGLU / GeGLU): down(act(gate(x)) * up(x)). Ungated (GPT-2, NeoX): down(act(up(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.gate = nn.Linear(C, I, bias=cfg.mlp_bias) if cfg.mlp_gated else None
        self.up = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.down = nn.Linear(I, C, bias=cfg.mlp_bias)
        self.act = ACTIVATION_FUNCTIONS[cfg.hidden_act]

    def forward(self, x):
        if self.gate is None:
            return self.down(self.act(self.up(x)))
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One layer. Where the norms sit is the family's choice (config.norm_placement):
    pre      x + f(norm(x))            Llama, Qwen, Mistral, GPT-2, NeoX
    sandwich x + norm'(f(norm(x)))     Gemma 2/3
    post     x + norm'(f(x))           OLMo 2 (the "reordered" norm)
    and NeoX's parallel residual adds both branches to the same x. Absent norms are None."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm_placement in ("pre", "sandwich")
        post = cfg.norm_placement in ("sandwich", "post")
        self.attn_norm = make_norm(cfg, cfg.hidden_size) if pre else None
        self.attn = Attention(cfg)
        self.attn_post_norm = make_norm(cfg, cfg.hidden_size) if post else None
        self.mlp_norm = make_norm(cfg, cfg.hidden_size) if pre else None
        self.mlp = MLP(cfg)
        self.mlp_post_norm = make_norm(cfg, cfg.hidden_size) if post else None
        self.parallel = cfg.parallel_residual

    def forward(self, x, cos, sin, mask, kv=None, positions=None):
        a = self.attn(_apply(self.attn_norm, x), cos, sin, mask, kv, positions)
        a = _apply(self.attn_post_norm, a)
        if self.parallel:
            m = self.mlp(_apply(self.mlp_norm, x))
            return x + (m + a)  # NeoX's order of additions, so bf16 rounds the same way
        x = x + a
        m = _apply(self.mlp_post_norm, self.mlp(_apply(self.mlp_norm, x)))
        return x + m  # the full residual stream x_{l+1}, so a forward hook sees it exactly


def _apply(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def _embedding(num: int, dim: int) -> nn.Embedding:
    # Every checkpoint load builds the model on the meta device, and there nn.Embedding's own normal_ init
    # runs torch's reference decomposition, which imports torch._dynamo: ~1.5 s of every start, for
    # weights about to be replaced. A meta build skips it; elsewhere the init is torch's, as before.
    weight = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=weight) if weight.is_meta else nn.Embedding(num, dim)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = _embedding(cfg.vocab_size, cfg.hidden_size)
        learned = cfg.pos_embedding == "learned"
        self.pos_embed = _embedding(cfg.max_position_embeddings, cfg.hidden_size) if learned else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = make_norm(cfg, cfg.hidden_size) if cfg.final_norm else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.final_softcap = cfg.final_softcap  # attributes, so surgery can change them live
        self.sliding = [cfg.is_sliding(i) for i in range(cfg.num_layers)]
        # Derived from the config, never loaded: rebuilt by reset_rope() after a meta-device build.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.register_buffer("inv_freq_local", self._local_inv_freq(), persistent=False)

    def _local_inv_freq(self):
        theta = self.config.rope_theta_local
        return rope_inv_freq(self.config, theta) if theta else None

    def reset_rope(self, device=None):
        device = device or self.embed.weight.device
        self.inv_freq = rope_inv_freq(self.config).to(device)
        local = self._local_inv_freq()
        self.inv_freq_local = local.to(device) if local is not None else None

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None):
        """Fresh weights for training: normal(0, std) matrices, zero biases, unit norm gains."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std, generator=generator)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (RMSNorm, LayerNorm)):
                nn.init.constant_(m.weight, 1.0 - getattr(m, "offset", 0.0))
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def attention_mask(self, positions: torch.Tensor, num_slots: int, window: int | None = None):
        """(B, 1, T, S) bool: query at position p sees cache slot s iff s <= p (and s > p - window).

        Slots are positions: row b's token at position p lives in slot p. Padding at the end of a
        short prompt is therefore never visible to that row's real tokens."""
        slots = torch.arange(num_slots, device=positions.device)
        visible = slots <= positions[..., None]  # (B, T, S)
        if window:
            visible &= slots > positions[..., None] - window
        return visible[:, None]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states (B, T, C) -> logits (B, T, V) fp32, soft-capped if configured."""
        logits = self.lm_head(x).float()  # softmax and sampling work in fp32
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache=None, logits_at: torch.Tensor | None = None, return_hidden: bool = False) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V) in fp32.

        positions (B, T): token positions, default 0..T-1. cache: a KVCache (kv_cache.py); new keys
        are written at `positions`. logits_at (B,): only compute logits at that index of T per row
        (prefill needs just the last token), giving (B, 1, V). return_hidden: return the final-normed
        hidden states (B, T, C) in the weight dtype instead, i.e. what `logits()` would take, for a
        caller that applies the LM head itself (engine/fused_head.py)."""
        cfg = self.config
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids)  # (B, T, C)
        if cfg.embed_scale is not None:
            x = x * x.new_tensor(cfg.embed_scale)  # the scale rounded to the dtype, as Gemma does
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        rope = local_rope = (None, None)
        if self.pos_embed is None:
            table_dtype = torch.float32 if cfg.rope_fp32 else x.dtype
            rope = local_rope = rope_tables(self.inv_freq, positions, table_dtype)
            if self.inv_freq_local is not None:
                local_rope = rope_tables(self.inv_freq_local, positions, table_dtype)
        slots = cache.num_slots if cache is not None else T
        # mask None = plain causal, which lets SDPA pick its fastest kernel.
        mask = self.attention_mask(positions, slots) if cache is not None else None
        window_mask = mask
        if any(self.sliding) and (cache is not None or T > cfg.sliding_window):
            window_mask = self.attention_mask(positions, slots, cfg.sliding_window)
        for i, layer in enumerate(self.layers):
            cos, sin = local_rope if self.sliding[i] else rope
            kv = cache.layer(i) if cache is not None else None
            x = layer(x, cos, sin, window_mask if self.sliding[i] else mask, kv, positions)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]  # (B, 1, C)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x if return_hidden else self.logits(x)
