"""The logit lens: read every layer's residual stream through the model's own final norm + LM head.

A pre-norm model only ever decodes x_L, but every x_l lives in the same residual space, so
lm_head(final_norm(x_l)) asks "what would the model say if it stopped after layer l?" (nostalgebraist
2020). Watching the final prediction's probability rise, and KL(final || layer l) fall, shows where
in depth the answer forms. The final norm is part of the lens on purpose: the raw stream's scale
grows with depth (see growth.py), and without the norm early and late layers would not be comparable
(`head_logits(..., final_norm=False)` gives the raw version, for the softmax-safety table).

The model runs once; a pre-hook on the first block (whose input is x_0: the embedding, scaled and
plus learned positions where the family has them, the same x_0 as observe()'s) and forward hooks
on every block copy x_0..x_L into one preallocated (L+1, B, T, C) tensor (blocks return the full residual stream, so the hook output is
x_l exactly). Logits are then computed one layer and one chunk of positions at a time, so at most
CHUNK_LOGITS of one layer's logits exist at once: (L+1) x B x T x V logits would be the largest thing
in memory by far (Qwen3-0.6B at 512 tokens: 29 x 512 x 151,936 fp32 = 9 GB), and even one layer's
(B, T, V) with its log-softmax temporaries is over a GB. The work itself, 2 (L+1) B T C V FLOPs in
the LM head, is what it is; `lens_flops` says how much before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ObservatoryError
from ..model.layers import Transformer
from .padding import check_mask

CHUNK_LOGITS = 16 << 20  # logits per chunk of positions (64 MiB in fp32): bounds the working set


@dataclass
class LensResult:
    """What each layer's stream predicts. L = number of blocks; row l = x_l (row 0: the first block's input)."""

    top_ids: torch.Tensor  # (L+1, B, T, k) int64: the k most likely tokens at layer l
    top_probs: torch.Tensor  # (L+1, B, T, k) fp32: their probabilities under layer l's lens
    predicted_prob: torch.Tensor  # (L+1, B, T) fp32: probability layer l gives to `predicted`
    kl: torch.Tensor  # (L+1, B, T) fp32: KL(final || layer l) in nats; 0 at l = L
    entropy: torch.Tensor  # (L+1, B, T) fp32: entropy of layer l's distribution, nats
    mean_square: torch.Tensor  # (L+1,) fp32: mean of x_l^2 over B, T, C (what fit_growth takes)
    final_logits: torch.Tensor  # (B, T, V) fp32: the model's own output of this forward
    predicted: torch.Tensor  # (B, T) int64: argmax of final_logits, the model's greedy next token


def head_logits(model: Transformer, x: torch.Tensor, final_norm: bool = True) -> torch.Tensor:
    """Residual stream x (B, T, C) -> fp32 logits (B, T, V), exactly as Transformer.forward ends.

    final_norm=False applies the LM head to the raw stream: what the final norm prevents (logits
    whose scale follows the stream's, which is what pushes exp() toward overflow)."""
    x = x.to(model.embed.weight.dtype)  # the activation dtype (a quantized lm_head has no float weight)
    if final_norm and model.final_norm is not None:
        x = model.final_norm(x)
    return model.logits(x)  # (B, T, V), with the final soft-cap where the model has one


def chunk_rows(V: int) -> int:
    """Positions per chunk, so that one chunk's (rows, V) fp32 tensor holds about CHUNK_LOGITS."""
    return max(1, CHUNK_LOGITS // V)


def lens_flops(cfg, B: int, T: int) -> float:
    """FLOPs of the lens's LM-head products: every layer's stream (x_0..x_L) through the head."""
    return 2.0 * (cfg.num_layers + 1) * B * T * cfg.hidden_size * cfg.vocab_size


def lens_bytes(model: Transformer, B: int, T: int) -> int:
    """The lens's working set: the captured stream, the final logits it returns, and ~6 (chunk, V)
    fp32 temporaries (logits, log-probs, their exp, the final layer's log-probs and probs, a product)."""
    cfg = model.config
    L, C, V = len(model.layers), cfg.hidden_size, cfg.vocab_size
    stream = (L + 1) * B * T * C * model.embed.weight.element_size()
    return stream + B * T * V * 4 + 6 * min(B * T, chunk_rows(V)) * V * 4


def check_size(model: Transformer, B: int, T: int, max_bytes: int) -> None:
    cfg = model.config
    L, C, V = len(model.layers), cfg.hidden_size, cfg.vocab_size
    stream = (L + 1) * B * T * C * model.embed.weight.element_size()
    need = lens_bytes(model, B, T)
    logits = need - stream
    if need > max_bytes:
        raise ObservatoryError(
            f"the logit lens on {B} x {T} tokens needs {need / 2**20:,.0f} MiB: the residual stream "
            f"x_0..x_{L} ({L + 1} x {B} x {T} x {C} values, {stream / 2**20:,.0f} MiB) plus fp32 logits "
            f"({B} x {T} x {V} final ones and chunks of {min(B * T, chunk_rows(V))} positions: "
            f"{logits / 2**20:,.0f} MiB), over max_bytes = "
            f"{max_bytes / 2**20:,.0f} MiB (pass a larger max_bytes= or fewer tokens)")


def capture_stream(model: Transformer, ids: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """Run the model once, copying x_0..x_L into stream (L+1, B, T, C); return its logits."""
    def keep(l):
        def hook(_module, _inputs, out):
            stream[l].copy_(out)
        return hook

    def keep_input(_module, args, kwargs):
        stream[0].copy_(args[0] if args else kwargs["x"])

    # x_0 is what the first block receives (Gemma's scaled embedding, GPT-2's wte + wpe), read off
    # its input as observe() reads it, not the embedding's output (token embedding only)
    handles = [model.layers[0].register_forward_pre_hook(keep_input, with_kwargs=True)]
    try:
        for i, block in enumerate(model.layers):
            handles.append(block.register_forward_hook(keep(i + 1)))
        return model(ids)  # (B, T, V) fp32
    finally:
        for h in handles:  # also on error: a stale hook would write into a freed buffer later
            h.remove()


def whole_lens(model: Transformer, ids: torch.Tensor, topk: int = 5,
               max_bytes: int = 2 << 30, attention_mask: torch.Tensor | None = None,
               on_layer=None) -> LensResult:
    """The logit lens of a whole (single-process) model on input ids (B, T); attach.logit_lens is the
    entry point, which gives a tensor-parallel rank model observatory/sharded.py's lens instead.

    max_bytes: refuse (ObservatoryError, naming the size) when the captured stream plus the logits
    working set would exceed it. attention_mask (B, T): a right padding (observatory/padding.py);
    pad positions get NaN (and -1 ids) and stay out of mean_square. on_layer(l): called after each
    layer, for progress."""
    if ids.ndim != 2:
        raise ObservatoryError(f"logit_lens takes token ids of shape (B, T), got {tuple(ids.shape)}")
    V = model.config.vocab_size
    if not 1 <= topk <= V:
        raise ObservatoryError(f"topk must be in [1, {V}], got {topk}")
    B, T = ids.shape
    L, C = len(model.layers), model.config.hidden_size
    mask = check_mask(ids, attention_mask) if attention_mask is not None else None
    check_size(model, B, T, max_bytes)
    w = model.embed.weight
    stream = torch.empty(L + 1, B, T, C, dtype=w.dtype, device=w.device)
    f32 = dict(dtype=torch.float32, device=w.device)
    top_ids = torch.empty(L + 1, B, T, topk, dtype=torch.int64, device=w.device)
    top_probs = torch.empty(L + 1, B, T, topk, **f32)
    predicted_prob, kl, entropy = (torch.empty(L + 1, B, T, **f32) for _ in range(3))
    mean_square = torch.empty(L + 1, **f32)

    rows, n = B * T, chunk_rows(V)
    with torch.inference_mode():
        final_logits = capture_stream(model, ids, stream)  # (B, T, V)
        predicted = final_logits.argmax(-1)  # (B, T)
        final_rows, pred_rows = final_logits.view(rows, V), predicted.view(rows)
        for l in range(L + 1):
            x = stream[l].view(rows, C)
            ids_l, probs_l = top_ids[l].view(rows, topk), top_probs[l].view(rows, topk)
            pred_l, kl_l, ent_l = predicted_prob[l].view(rows), kl[l].view(rows), entropy[l].view(rows)
            for a in range(0, rows, n):
                b = min(a + n, rows)
                logp = head_logits(model, x[a:b]).log_softmax(-1)  # (n, V)
                logp_final = final_rows[a:b].log_softmax(-1)  # recomputed per chunk: no (B, T, V) copy kept
                top = logp.topk(topk, dim=-1)
                ids_l[a:b], probs_l[a:b] = top.indices, top.values.exp()
                pred_l[a:b] = logp.gather(-1, pred_rows[a:b, None])[:, 0].exp()
                # KL(final || l) = sum_v p_final (log p_final - log p_l); log-probs are finite for finite
                # logits, so a p_final that underflowed to 0 contributes 0, not NaN
                kl_l[a:b] = (logp_final.exp() * (logp_final - logp)).sum(-1)
                ent_l[a:b] = -(logp.exp() * logp).sum(-1)
            real = stream[l] if mask is None else stream[l][mask.to(w.device)]  # (n, C) real tokens
            mean_square[l].copy_(real.float().pow(2).mean())
            if on_layer is not None:
                on_layer(l)
    if mask is not None:
        pad = ~mask.to(w.device)
        for t in (top_probs, predicted_prob, kl, entropy):
            t[:, pad] = float("nan")
        top_ids[:, pad] = -1
        predicted = predicted.masked_fill(pad, -1)
    return LensResult(top_ids, top_probs, predicted_prob, kl, entropy, mean_square, final_logits,
                      predicted)
