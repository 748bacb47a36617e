"""Attention valves, per layer and head: how each head spends its softmax.

    with sluice.observe(model) as obs, torch.inference_mode():
        model(ids)
    obs.attention.head_means()["sink_mass"]   # (L, H): share of attention on position 0
    obs.attention.per_position()["entropy"]   # (L, H, B, T)

The statistics are computed from the attention's own inputs: a forward hook on every
`layers.i.attn.attend` (model/layers.py) receives q and k after their q/k norms, RoPE and the KV
cache, the mask (causal, sliding window, cache slots) and the scale and soft-cap, and recomputes
the scores in fp32 exactly as the softmax sees them, grouped-query heads sharing their KV head.
With no observer attached nothing of this runs.

Per query position and head:
  entropy      of the attention distribution over the visible keys, nats
  sink_mass    the probability on position 0 (cache slot 0), the "attention sink"
  top_mass     the largest probability, i.e. the share on that query's top key
  top_position which key position that is
  max_logit    the largest score the softmax receives (after the scale and any soft-cap)
  max_logit_raw  the same before the soft-cap (equal to max_logit without one)
  q_norm       L2 norm of the query, after q-norm and RoPE (RoPE rotates pairs of channels, so
               it leaves the norm as the q-norm made it, up to rounding)
and per KV head, k_norm: the norm of the key the query itself wrote (its own position's slot),
after k-norm and RoPE. `head_means()` averages over every query that can see two keys or more:
a query that sees only itself (position 0) has entropy 0 and all its mass on itself by
construction, and would only dilute the means.
"""

from __future__ import annotations

import torch

from ..errors import ObservatoryError
from .recorder import GrowingRecorder

PER_HEAD = ("entropy", "sink_mass", "top_mass", "max_logit", "max_logit_raw", "q_norm")
CHUNK_BYTES = 64 << 20  # the fp32 scores of one chunk of heads; larger attention runs head group by group


class AttentionProbe(GrowingRecorder):
    """Hooks on every layer's `attn.attend` writing per-head statistics into preallocated buffers."""

    def __init__(self, model, capacity: tuple[int, int], max_bytes: int):
        cfg = model.config
        self.model, self.max_bytes = model, max_bytes
        self.L, self.H, self.K = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
        self.shape: tuple[int, int] | None = None
        # on a tensor-parallel rank (sharded.py): local heads -> every head, the same on each rank
        self.merge = None
        self._capacity = (0, 0)
        self._allocate(*capacity)
        self.handles = [model.register_forward_pre_hook(self._begin, with_kwargs=True)]
        self.handles += [layer.attn.attend.register_forward_hook(self._hook(i))
                         for i, layer in enumerate(model.layers)]

    def bytes_for(self, B: int, T: int) -> int:
        return B * T * (4 * self.L * (len(PER_HEAD) * self.H + self.K) + 8 * self.L * (self.H + 1))

    def _allocate(self, B: int, T: int) -> None:
        self._check_bytes(B, T, "the attention statistics of a forward of {B} x {T} tokens need", "attention=False, ")
        dev = next(self.model.parameters()).device
        f32 = dict(dtype=torch.float32, device=dev)
        with torch.inference_mode(False):  # see probes.Observation._allocate
            self._buf = {**{k: torch.zeros(self.L, self.H, B, T, **f32) for k in PER_HEAD},
                         "k_norm": torch.zeros(self.L, self.K, B, T, **f32),
                         "top_position": torch.zeros(self.L, self.H, B, T, dtype=torch.long, device=dev),
                         "keys_visible": torch.zeros(self.L, B, T, dtype=torch.long, device=dev)}
        self._capacity = (B, T)

    def _begin(self, _module, args, kwargs):
        B, T = self._reserve(args, kwargs)
        for buf in self._buf.values():  # a layer that does not run must not show stale numbers
            buf[..., :B, :T].zero_()

    def _hook(self, layer: int):
        def hook(_module, args, _out):
            q, k, _v, mask, scale, softcap = args
            self._measure(layer, q.detach(), k.detach(), mask, scale, softcap)
        return hook

    def _measure(self, layer: int, q, k, mask, scale: float, softcap: float | None) -> None:
        B, H, T, D = q.shape
        K, S = k.shape[1], k.shape[2]
        G = H // K
        slots = torch.arange(S, device=q.device)
        if mask is None:  # plain causal: query t (of T new tokens) sits at slot S - T + t
            visible = (slots <= torch.arange(S - T, S, device=q.device)[:, None])[None, None]  # (1, 1, T, S)
        else:
            visible = mask  # (B, 1, T, S)
        # the query's own slot is the last one it sees (slots are positions, and a token sees itself)
        own = torch.where(visible, slots, 0).amax(-1).expand(B, 1, T)  # (B, 1, T)
        buf = lambda name: self._buf[name][layer, ..., :B, :T]  # noqa: E731 - (heads, B, T)
        kf = k.float()
        k_norm = torch.linalg.vector_norm(kf, dim=-1)  # (B, K, S)
        buf("k_norm").copy_(k_norm.gather(-1, own.expand(B, K, T)).transpose(0, 1))
        buf("q_norm").copy_(torch.linalg.vector_norm(q.float(), dim=-1).transpose(0, 1))
        self._buf["keys_visible"][layer, :B, :T].copy_(visible.sum(-1).expand(B, 1, T)[:, 0])
        # KV heads in chunks so that the (B, G, T, S) fp32 scores of a chunk stay near CHUNK_BYTES
        per_kv = 4 * B * G * T * S
        step = max(1, min(K, CHUNK_BYTES // max(per_kv, 1)))
        for k0 in range(0, K, step):
            k1 = min(K, k0 + step)
            qg = q[:, k0 * G:k1 * G].float().reshape(B, k1 - k0, G, T, D)
            raw = (qg @ kf[:, k0:k1, None].transpose(-1, -2)).reshape(B, (k1 - k0) * G, T, S) * scale
            capped = raw if softcap is None else torch.tanh(raw / softcap) * softcap
            hidden = ~visible
            logits = capped.masked_fill(hidden, float("-inf"))  # (B, h, T, S), h = heads of this chunk
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            top = p.max(-1)
            heads = slice(k0 * G, k1 * G)
            into = lambda name: self._buf[name][layer, heads, :B, :T]  # noqa: E731 - (h, B, T)
            into("entropy").copy_(torch.special.entr(p).sum(-1).transpose(0, 1))
            into("sink_mass").copy_(p[..., 0].transpose(0, 1))
            into("top_mass").copy_(top.values.transpose(0, 1))
            into("top_position").copy_(top.indices.transpose(0, 1))
            into("max_logit").copy_(logits.amax(-1).transpose(0, 1))
            into("max_logit_raw").copy_((logits if softcap is None else raw.masked_fill(hidden, float("-inf")))
                                        .amax(-1).transpose(0, 1))

    # ------------------------------------------------------------------ results
    def per_position(self) -> dict[str, torch.Tensor]:
        """Copies of the last forward's statistics: (L, H, B, T) per query head, k_norm (L, K, B, T),
        keys_visible (L, B, T): how many keys each query could attend to (causal mask and window)."""
        if self.shape is None:
            raise ObservatoryError("nothing observed yet: run the model inside `with observe(model)`")
        B, T = self.shape
        out = {name: buf[..., :B, :T].to("cpu", copy=True) for name, buf in self._buf.items()}
        return out if self.merge is None else self.merge(out)

    def head_means(self) -> dict[str, torch.Tensor]:
        """(L, H) means over the queries that see at least two keys (all of them when none does),
        k_norm (L, K); plus max_logit_peak (L, H), the largest score any query gave its head."""
        s = self.per_position()
        counted = (s["keys_visible"] >= 2)[:, None]  # (L, 1, B, T)
        if not counted.any():  # a one-token prompt: nothing to leave out
            counted = torch.ones_like(counted)
        n = counted.sum((-1, -2)).clamp_min(1)  # (L, 1)
        mean = lambda x: torch.where(counted, x, 0.0).sum((-1, -2)) / n  # noqa: E731
        out = {name: mean(s[name]) for name in (*PER_HEAD, "k_norm")}
        out["max_logit_peak"] = torch.where(counted, s["max_logit"], float("-inf")).amax((-1, -2))
        # how often the top key is position 0: the sink seen as an argmax rather than as mass
        out["top_is_first"] = mean((s["top_position"] == 0).float())
        return out


JSON_CELLS = 250_000  # per-position statistics go into inspect's JSON up to this many (layer, head, position) cells


def attention_data(probe: AttentionProbe, model) -> dict:
    """What `sluice inspect` keeps (batch row 0): head means (L, H), and per position (L, H, T) while
    the prompt is small enough for the JSON to stay readable."""
    s, means = probe.per_position(), probe.head_means()
    L, H, _, T = s["entropy"].shape
    K = s["k_norm"].shape[1]  # every KV head, also on a tensor-parallel rank
    data = {"num_heads": H, "num_kv_heads": K, "kv_head_of": [h // (H // K) for h in range(H)],
            "sliding": list(model.sliding), "softcap": model.layers[0].attn.softcap,
            "q_k_norms": "L2 norms after the q/k norm and RoPE (RoPE is a rotation: it keeps the norm)",
            "means_over": "queries that see at least two keys (the first position sees only itself)",
            "head_means": {k: v.tolist() for k, v in means.items()},
            "keys_visible": s["keys_visible"][:, 0].tolist()}
    if L * H * T <= JSON_CELLS:
        data["per_position"] = {k: s[k][:, :, 0].tolist() for k in (*PER_HEAD, "top_position")}
        data["per_position"]["k_norm"] = s["k_norm"][:, :, 0].tolist()
    else:
        data["per_position_omitted"] = (f"{L} x {H} x {T} cells per statistic: left out of the JSON; "
                                        "sluice.observe(model).attention.per_position() has them")
    return data
