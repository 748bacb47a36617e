"""Attribution: which block's attention or MLP writes the residual growth and a token's final logit.

    with sluice.observe(model, attribution=True) as obs, torch.inference_mode():
        model(ids)
    obs.attribution().growth["delta_mean_square"]       # (2L, B, T)
    obs.attribution(target=42).logit["contribution"]   # (components, B, T)

The residual stream is a sum: x_L = x_0 + sum of what every branch adds (attention and MLP of
each block; the post-norm's output where the family has one: Gemma's sandwich, OLMo 2). Forward
hooks keep x_0 (the first block's input: embeddings, Gemma's scale, GPT-2's positions), every
branch's addition b and x_L, in fp32. The streams in between are rebuilt as partial sums.

Growth, per branch and position, with s the stream the branch is added to (x_l for attention and
x_l + a_l for the MLP; x_l for both under NeoX's parallel residual):
  delta_mean_square = mean(|s + b|^2) - mean(|s|^2) = (2 s.b + |b|^2) / C
  along_stream      = s.b / |s|, the signed length of b along the stream's direction
In exact arithmetic ms(x_0) + the sum of all deltas = ms(x_L): the growth fit's mean squares,
split by branch. Under the parallel residual the cross term 2 a.m / C is split equally.

Logit, direct logit attribution (as TransformerLens's logit attributions): the final norm is
linear once its scale is frozen, so each component's share of target t's logit is
  W_U[t] . (g * center(b) / sigma)
with sigma the norm's scale at that position, computed from the full residual x_L and held fixed
for every component (sqrt(mean(x_L^2) + eps) for RMSNorm, sqrt(var(x_L) + eps) for LayerNorm),
g its gain (1 + w for Gemma), center() the mean subtraction of LayerNorm (none for RMSNorm).
The components (embedding, every branch, the norm's bias where it has one) sum to the logit
before any final soft-cap. That the scale really depends on every component is the approximation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ObservatoryError
from ..model.layers import LayerNorm
from .recorder import GrowingRecorder

FROZEN_NOTE = ("direct logit attribution: the final norm's scale is frozen at its value for the full residual "
               "x_L at each position (as TransformerLens does), so the components add up; they sum to the "
               "logit before any final soft-cap")


@dataclass
class Attribution:
    """What `Observation.attribution()` returns; every tensor is a CPU copy.

    components: names of the rows of logit["contribution"]: "embed", "layers.i.attn",
    "layers.i.mlp", then "final_norm.bias" where the final norm has a bias.
    growth: delta_mean_square and along_stream (2L, B, T) in branch order (layers.0.attn,
    layers.0.mlp, ...); mean_square (L+1, B, T) of x_0..x_L rebuilt from the parts.
    logit (None without a target): contribution (components, B, T), target (B, T), sum (B, T),
    logit (B, T): the model's own logit of the target before the final soft-cap, and the frozen
    scale sigma (B, T)."""

    components: list[str]
    growth: dict[str, torch.Tensor]
    logit: dict[str, torch.Tensor] | None
    note: str = FROZEN_NOTE


class BranchRecorder(GrowingRecorder):
    """Hooks that keep x_0, every branch's addition to the stream and x_L of the last forward."""

    def __init__(self, model, capacity: tuple[int, int], max_bytes: int):
        cfg = model.config
        self.model, self.max_bytes = model, max_bytes
        self.L, self.C = cfg.num_layers, cfg.hidden_size
        self.parallel = cfg.parallel_residual
        # on a tensor-parallel rank (sharded.py): the LM head holds vocabulary rows from `vocab_start`,
        # and `reduce` sums each rank's share of the logit parts
        self.vocab_size = getattr(model, "full_config", cfg).vocab_size
        self.vocab_start, self.reduce = 0, None
        self.branch_names = [f"layers.{i}.{b}" for i in range(self.L) for b in ("attn", "mlp")]
        self.shape: tuple[int, int] | None = None
        self._capacity = (0, 0)
        self._allocate(*capacity)
        self.handles = [model.register_forward_pre_hook(self._begin, with_kwargs=True),
                        model.layers[0].register_forward_pre_hook(lambda _m, args: self._keep(0, args[0])),
                        model.layers[-1].register_forward_hook(lambda _m, _a, out: self._keep(-1, out))]
        for j, name in enumerate(self.branch_names):
            block, kind = model.layers[j // 2], name.rsplit(".", 1)[1]
            # what is added: the post-norm's output where there is one (sandwich, OLMo 2)
            site = getattr(block, f"{kind}_post_norm") or getattr(block, kind)
            self.handles.append(site.register_forward_hook(lambda _m, _a, out, j=j: self._keep(j + 1, out)))

    def bytes_for(self, B: int, T: int) -> int:
        return 4 * (2 * self.L + 2) * B * T * self.C

    def _allocate(self, B: int, T: int) -> None:
        self._check_bytes(B, T, "recording the residual parts for attribution of {B} x {T} tokens needs", "")
        dev = next(self.model.parameters()).device
        with torch.inference_mode(False):  # see probes.Observation._allocate
            # rows: x_0, then the 2L branch additions in order, then x_L
            self._parts = torch.zeros(2 * self.L + 2, B, T, self.C, dtype=torch.float32, device=dev)
        self._capacity = (B, T)

    def _begin(self, _module, args, kwargs):
        B, T = self._reserve(args, kwargs)
        self._parts[:, :B, :T].zero_()

    def _keep(self, row: int, x: torch.Tensor) -> None:
        self._parts[row, :x.shape[0], :x.shape[1]].copy_(x.detach())

    # ------------------------------------------------------------------ results
    def parts(self) -> torch.Tensor:
        if self.shape is None:
            raise ObservatoryError("nothing observed yet: run the model inside `with observe(model, attribution=True)`")
        B, T = self.shape
        return self._parts[:, :B, :T].to("cpu", copy=True)  # (2L + 2, B, T, C)

    def growth(self, parts: torch.Tensor) -> dict[str, torch.Tensor]:
        x0, branches = parts[0].double(), parts[1:-1].double()  # fp64: the deltas are small differences
        C, stream = self.C, x0
        delta, along, ms = [], [], [x0.square().mean(-1)]

        def split(s, b, extra=0.0):
            delta.append((2 * (s * b).sum(-1) + b.square().sum(-1)) / C + extra)
            along.append((s * b).sum(-1) / torch.linalg.vector_norm(s, dim=-1).clamp_min(1e-30))

        for i in range(self.L):
            a, m = branches[2 * i], branches[2 * i + 1]
            if self.parallel:
                cross = (a * m).sum(-1) / C  # half of 2 a.m / C to each branch
                split(stream, a, cross)
                split(stream, m, cross)
                stream = stream + a + m
            else:
                split(stream, a)
                stream = stream + a
                split(stream, m)
                stream = stream + m
            ms.append(stream.square().mean(-1))
        return {"delta_mean_square": torch.stack(delta).float(), "along_stream": torch.stack(along).float(),
                "mean_square": torch.stack(ms).float()}

    def logit(self, parts: torch.Tensor, target: torch.Tensor) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Direct logit attribution of `target` (B, T) ids; see the module doc."""
        model = self.model
        norm = model.final_norm
        x_L = parts[-1].double()  # (B, T, C), the model's real final residual
        components = parts[:-1].double()  # x_0 and the 2L branches
        names = ["embed", *self.branch_names]
        layer = isinstance(norm, LayerNorm)
        if norm is None:
            sigma, gain = torch.ones(x_L.shape[:2], dtype=torch.float64), torch.ones(self.C, dtype=torch.float64)
        else:
            gain = norm.gain().detach().double().cpu()
            spread = x_L.var(-1, correction=0) if layer else x_L.square().mean(-1)
            sigma = (spread + norm.eps).sqrt()  # (B, T)
        if layer:  # LayerNorm subtracts each vector's mean: linear, so applied to each part
            components = components - components.mean(-1, keepdim=True)
        rows = _head_rows(model.lm_head, target, self.vocab_start, self.vocab_size)  # (B, T, C)
        direction = rows * gain / sigma[..., None]  # (B, T, C)
        contribution = (components * direction).sum(-1)  # (parts, B, T)
        if layer and norm.bias is not None:
            names.append("final_norm.bias")
            contribution = torch.cat([contribution, (rows * norm.bias.detach().double().cpu()).sum(-1)[None]])
        with torch.inference_mode():
            normed = norm(parts[-1].to(model.embed.weight.dtype).to(norm.weight.device)) if norm is not None \
                else parts[-1]
        own = (normed.double().cpu() * rows).sum(-1)  # (B, T): the model's logit of the target, uncapped
        if self.reduce is not None:  # rows this rank does not hold are zero here
            contribution, own = self.reduce(contribution), self.reduce(own)
        return names, {"contribution": contribution.float(), "sum": contribution.sum(0).float(),
                       "logit": own.float(), "target": target.clone(), "sigma": sigma.float()}


def _head_rows(head: nn.Module, target: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """The LM head's rows for `target` (B, T) -> (B, T, C) fp64 on the CPU (dequantized if need be);
    zero for ids outside the rows this head holds (start .. start + its rows: a tensor-parallel shard)."""
    weight = head.weight if isinstance(head, nn.Linear) else head.dequantize()
    if target.min() < 0 or target.max() >= vocab_size:
        raise ObservatoryError(f"target token ids must lie in [0, {vocab_size}), got "
                               f"{int(target.min())}..{int(target.max())}")
    local = target - start
    held = (local >= 0) & (local < weight.shape[0])
    rows = weight.detach()[local.clamp(0, weight.shape[0] - 1).to(weight.device)].double().cpu()
    return rows * held[..., None]


def target_ids(target, shape: tuple[int, int], predicted: torch.Tensor | None) -> torch.Tensor:
    """An int (the same token at every position), a (B, T) tensor of ids, or None = `predicted`
    (the model's own top-1 at each position) -> (B, T) int64."""
    B, T = shape
    if target is None:
        if predicted is None:
            raise ObservatoryError("no target given and the model's prediction is not known at every position "
                                   "(the forward made logits for fewer positions): pass target=")
        return predicted.long()
    if isinstance(target, int) and not isinstance(target, bool):
        return torch.full((B, T), target, dtype=torch.long)
    if isinstance(target, torch.Tensor) and target.shape == (B, T) and not target.is_floating_point():
        return target.long().cpu()
    raise ObservatoryError(f"target must be a token id (int), a ({B}, {T}) integer tensor or None, got "
                           f"{type(target).__name__}{tuple(target.shape) if isinstance(target, torch.Tensor) else ''}")


def attribution_data(result: Attribution, text, chosen: bool) -> dict:
    """What `sluice inspect` keeps of an Attribution (batch row 0); text: token id -> its text;
    chosen: whether the target was given (else each position's own top-1 prediction)."""
    g, lg = result.growth, result.logit
    ids = lg["target"][0].tolist()
    delta = g["delta_mean_square"][:, 0]  # (2L, T)
    return {"note": result.note, "components": result.components,
            "growth": {"definition": "delta_mean_square = mean(|s + b|^2) - mean(|s|^2) for branch output b "
                                     "added to stream s; along_stream = s.b / |s|",
                       "branches": result.components[1:1 + delta.shape[0]],
                       "delta_mean_square": delta.tolist(), "mean_delta": delta.mean(-1).tolist(),
                       "along_stream": g["along_stream"][:, 0].tolist(),
                       "mean_square": g["mean_square"][:, 0].tolist()},
            "logit": {"target": "given" if chosen else "the model's top-1 prediction at each position",
                      "target_ids": ids, "target_tokens": [text(i) for i in ids],
                      "contribution": lg["contribution"][:, 0].tolist(), "sum": lg["sum"][0].tolist(),
                      "logit": lg["logit"][0].tolist(), "sigma": lg["sigma"][0].tolist()}}
