"""The hooks behind `sluice.observe(model)` (attach.py): they measure the four valves, per layer AND per position.

    with sluice.observe(model) as obs, torch.inference_mode():
        model(ids)
    obs.stats["resid_rms"]   # (L+1, B, T): RMS of x_0 (embeddings) .. x_L, for every token
    obs.summary()            # the short per-layer summary `sluice demo` prints
    obs.run([ids_a, ids_b])  # prompts of different lengths in one forward (padding.py)

What is measured at each kind of site (a "site" is a module whose output a hook reads):
1. residual stream x_0..x_L (embedding + block outputs): RMS, variance over channels, max |x|, and
   the top-k largest-magnitude channels with their signed values ("massive activations");
2. every norm (attention/MLP input norms, per-head q/k norms, the final norm): RMS in and out,
   so the gain it applies is out / in;
3. every residual branch (attention, MLP): output RMS; its ratio to the stream it is added to is
   derived in `branch_ratio()`;
4. the LM head: per position logit max, min, std, log-sum-exp (log Z), softmax entropy, top-1
   probability and token;
and, at every site plus every Linear, whether each position's output holds a NaN or inf, so that
`first_nonfinite()` names where one first appeared (layer, module, batch row, position).

Hooks are registered from outside (the model code has no `if observe`), only read their tensors,
and write into preallocated fp32 buffers with copy_ (no Python lists that grow, no .item()), so
logits stay bit-identical and the hooks trace into a torch.compile'd model. Buffers hold
`capacity` = (batch, tokens); a larger forward re-allocates them once in a pre-hook on the model,
after checking the size against `max_bytes`. Statistics describe the *last* forward; with a KV
cache (decode), its T is the number of new tokens, not their absolute positions. `stats` returns
copies, so what a caller keeps is not overwritten by the next forward. A forward made by `run()`
carries an attention mask: pad positions hold NaN (or -1) in `stats` and are left out of every
aggregate (summary, massive activations, records).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ObservatoryError
from ..model.layers import Transformer
from ..model.quant import QuantizedLinear
from .attention import AttentionProbe
from .attribution import Attribution, BranchRecorder, target_ids
from .padding import blank_padding, check_mask, masked_mean, pad_prompts

_LAYER = re.compile(r"^layers\.(\d+)\.")
LOGIT_STATS = ("max", "min", "std", "logsumexp", "entropy", "top1_prob")


def _layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _is_norm(name: str, module: nn.Module) -> bool:
    # Norms are found by name (attn_norm, mlp_norm, q_norm, k_norm, final_norm, and whatever a later
    # family adds): the model code names every norm "*norm", and no other module.
    return name.rsplit(".", 1)[-1].endswith("norm") and not isinstance(module, nn.Identity)


@dataclass(frozen=True)
class Sites:
    """Which modules are read, in the order their forward hooks fire (children before parents)."""
    norms: list[str]     # every norm
    branches: list[str]  # layers.i.attn, layers.i.mlp
    tracked: list[str]   # every module whose output is checked for non-finite values


def find_sites(model: Transformer) -> Sites:
    modules = dict(model.named_modules())
    # Post-order (children before their parent) is the order in which forward hooks fire here.
    def post_order(prefix: str, module: nn.Module):
        for child_name, child in module.named_children():
            yield from post_order(f"{prefix}.{child_name}" if prefix else child_name, child)
        if prefix:
            yield prefix

    order = list(post_order("", model))
    branches = [f"layers.{i}.{b}" for i in range(len(model.layers)) for b in ("attn", "mlp")]
    norms = [n for n in order if _is_norm(n, modules[n])]
    blocks = {f"layers.{i}" for i in range(len(model.layers))}
    tracked = [n for n in order if n in blocks or n in branches or n in norms
               or n in ("embed", "lm_head") or isinstance(modules[n], (nn.Linear, QuantizedLinear))]
    return Sites(norms=norms, branches=branches, tracked=tracked)


class Observation:
    """Hooks + buffers. Use `sluice.observe(model)` to make one; a context manager removes the hooks."""

    def __init__(self, model: Transformer, topk: int = 4, capacity: tuple[int, int] = (1, 128),
                 max_bytes: int = 2 << 30, attention: bool = True, attribution: bool = False):
        if not isinstance(topk, int) or not 1 <= topk <= model.config.hidden_size:
            raise ObservatoryError(f"topk must be an integer in [1, {model.config.hidden_size}], got {topk!r}")
        self.model = model
        self.topk = topk
        self.max_bytes = max_bytes
        self.num_layers = model.config.num_layers
        self.sites = find_sites(model)
        self.norm_names, self.branch_names = self.sites.norms, self.sites.branches
        self.shape: tuple[int, int] | None = None  # (B, T) of the last forward
        self.logits_len = 0  # T of the LM head's input (1 when only the last position's logits are made)
        self.mask: torch.Tensor | None = None  # (B, T) bool of the last forward, True = real token
        self._next_mask: torch.Tensor | None = None  # set by run() for the forward it makes
        self._capacity = (0, 0)
        self._allocate(*capacity)
        self._handles: list = []
        modules = dict(model.named_modules())
        self._handles.append(model.register_forward_pre_hook(self._begin, with_kwargs=True))
        # x_0 is what the first block receives (embeddings, scaled as Gemma does, plus GPT-2's
        # learned positions), so it is read off layers.0's input rather than the embedding's output.
        measure = {
                   **{f"layers.{i}": self._resid_stats(i + 1, first=i == 0) for i in range(self.num_layers)},
                   **{name: self._norm_stats(j) for j, name in enumerate(self.norm_names)},
                   **{name: self._branch_stats(j) for j, name in enumerate(self.branch_names)}}
        # One hook per module (each call of a hook costs more than the arithmetic at decode sizes)
        for j, name in enumerate(self.sites.tracked):
            self._handles.append(modules[name].register_forward_hook(self._hook(j, measure.get(name))))
        # The logits as the model returns them (after Gemma 2's final soft-cap, where there is one).
        self._handles.append(model.register_forward_hook(lambda _m, inputs, out: self._logits_stats(inputs, out.detach())))
        # per-head attention statistics (attention.py) and the residual's parts (attribution.py)
        self._attention = AttentionProbe(model, capacity, max_bytes) if attention else None
        self._recorder = BranchRecorder(model, capacity, max_bytes) if attribution else None
        for extra in (self._attention, self._recorder):
            self._handles += extra.handles if extra is not None else []

    # ------------------------------------------------------------------ buffers
    def bytes_for(self, B: int, T: int) -> int:
        L1, k = self.num_layers + 1, self.topk
        floats = L1 * 3 + L1 * k + 2 * len(self.norm_names) + 2 * len(self.branch_names) + len(LOGIT_STATS)
        return B * T * (4 * floats + 8 * (L1 * k + 1) + 8 * len(self.sites.tracked))

    def _allocate(self, B: int, T: int) -> None:
        need = self.bytes_for(B, T)
        if need > self.max_bytes:
            raise ObservatoryError(f"observing a forward of {B} x {T} tokens needs {need / 2**20:,.0f} MiB "
                                   f"of statistics, over the limit of {self.max_bytes / 2**20:,.0f} MiB "
                                   "(pass max_bytes= to observe() to allow more, or a shorter input)")
        with torch.inference_mode(False):  # normal tensors even when growing inside inference mode,
            self._buf = self._zeros(B, T)  # so that a later forward under no_grad can write them
        self._capacity = (B, T)

    def _zeros(self, B: int, T: int) -> dict[str, torch.Tensor]:
        dev = next(self.model.parameters()).device  # written by hooks on the model's device
        L1, k, f32 = self.num_layers + 1, self.topk, dict(dtype=torch.float32, device=dev)
        return {
            "resid_rms": torch.zeros(L1, B, T, **f32),
            "resid_var": torch.zeros(L1, B, T, **f32),
            "resid_absmax": torch.zeros(L1, B, T, **f32),
            "resid_top_channels": torch.zeros(L1, B, T, k, dtype=torch.long, device=dev),
            "resid_top_values": torch.zeros(L1, B, T, k, **f32),
            "norm_in_rms": torch.zeros(len(self.norm_names), B, T, **f32),
            "norm_out_rms": torch.zeros(len(self.norm_names), B, T, **f32),
            "branch_rms": torch.zeros(len(self.branch_names), B, T, **f32),
            # the branch's input, needed only where no norm precedes it (OLMo 2: the raw stream)
            "branch_in_rms": torch.zeros(len(self.branch_names), B, T, **f32),
            "logits": torch.zeros(len(LOGIT_STATS), B, T, **f32),
            "top1_id": torch.zeros(B, T, dtype=torch.long, device=dev),
            # per module and position, the sum of its output in fp64: NaN or inf iff some element
            # is (finite fp32/bf16 values cannot overflow an fp64 sum), at the cost of one reduction
            "nonfinite_sum": torch.zeros(len(self.sites.tracked), B, T, dtype=torch.float64, device=dev),
        }

    def _begin(self, _module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        B, T = ids.shape
        if B > self._capacity[0] or T > self._capacity[1]:
            self._allocate(max(B, self._capacity[0]), max(T, self._capacity[1]))
        self.shape = (B, T)
        self.mask = self._next_mask  # None for a forward not made by run(): every token is real
        for view in self._views(B, T).values():  # a site that does not run must not show stale data
            view.zero_()

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Copies of the buffers cut to the last forward's (B, T), on the CPU: the next forward does
        not change them. The logits rows cover `logits_len` positions. "nonfinite" (sites, B, T)
        int32 is 1 where that module's output at that token has a NaN/inf. "mask" (B, T) bool: the
        real tokens; pad positions (a `run()` of unequal prompts) hold NaN, or -1 in the id tensors."""
        if self.shape is None:
            raise ObservatoryError("nothing observed yet: run the model inside `with observe(model)`")
        # copy=True: .cpu() of a CPU tensor is the buffer itself, which the next forward overwrites
        views = {name: v.to("cpu", copy=True) for name, v in self._views(*self.shape).items()}
        views["nonfinite"] = (~torch.isfinite(views.pop("nonfinite_sum"))).to(torch.int32)
        if self.mask is not None:
            blank_padding(views, self.mask, self.logits_len)
        views["mask"] = self.mask.clone() if self.mask is not None else torch.ones(self.shape, dtype=torch.bool)
        return views

    def run(self, prompts, attention_mask=None, pad_id: int = 0) -> torch.Tensor:
        """One observed forward of several prompts: token id lists of any lengths (right-padded
        with pad_id here), or ids (B, T) with a right-padding attention_mask (B, T). Returns the
        logits (B, T, V); the statistics of pad positions are excluded everywhere (module doc)."""
        if isinstance(prompts, torch.Tensor):
            ids = prompts
            mask = check_mask(ids, attention_mask if attention_mask is not None else torch.ones_like(ids, dtype=torch.bool))
        else:
            if attention_mask is not None:
                raise ObservatoryError("attention_mask goes with ids (B, T); token id lists are padded here")
            ids, mask = pad_prompts(prompts, pad_id)
        self._next_mask = mask
        try:
            with torch.inference_mode():
                return self.model(ids.to(next(self.model.parameters()).device))
        finally:
            self._next_mask = None

    def _views(self, B: int, T: int) -> dict[str, torch.Tensor]:
        # (B, T) are the last two dims of every buffer but the top-k ones, which have k after them.
        return {name: buf[:, :B, :T] if name.startswith("resid_top") else buf[..., :B, :T]
                for name, buf in self._buf.items()}

    # ------------------------------------------------------------------ hooks
    def _at(self, name: str, i: int, x: torch.Tensor) -> torch.Tensor:
        """Row i of buffer `name`, cut to x's (B, T). Cut here from the tensor in hand, never cached
        between hooks: under torch.compile a view kept on self could be one of an earlier shape."""
        return self._buf[name][i, :x.shape[0], :x.shape[1]]

    def _hook(self, j: int, measure):
        def hook(_module, inputs, out):
            out = out.detach()
            if measure is not None:
                measure(inputs, out)
            torch.sum(out.flatten(2), -1, dtype=torch.float64, out=self._at("nonfinite_sum", j, out))
        return hook

    @staticmethod
    def _rms(x: torch.Tensor, into: torch.Tensor) -> None:
        """RMS over everything after (B, T), computed in fp32 into `into` (B, T): the L2 norm then a
        scale, two kernels where pow/mean/sqrt/copy take four (at decode sizes, kernels are the cost)."""
        torch.linalg.vector_norm(x.flatten(2), dim=-1, dtype=torch.float32, out=into)
        into.mul_(math.prod(x.shape[2:]) ** -0.5)

    def _resid_stats(self, i: int, first: bool = False):
        first_measure = self._resid_stats(0) if first else None

        def measure(inputs, out):
            if first_measure is not None:
                first_measure(None, inputs[0].detach())
            self._rms(out, self._at("resid_rms", i, out))
            x = out.float()  # (B, T, C)
            torch.var(x, -1, correction=0, out=self._at("resid_var", i, x))
            top = x.abs().topk(self.topk, dim=-1)  # (B, T, k): the largest-magnitude channels
            self._at("resid_absmax", i, x).copy_(top.values[..., 0])
            self._at("resid_top_channels", i, x).copy_(top.indices)
            torch.gather(x, -1, top.indices, out=self._at("resid_top_values", i, x))
        return measure

    def _norm_stats(self, j: int):
        def measure(inputs, out):  # (B, T, C), or (B, T, heads, D) for q/k norms
            self._rms(inputs[0].detach(), self._at("norm_in_rms", j, out))
            self._rms(out, self._at("norm_out_rms", j, out))
        return measure

    def _branch_stats(self, j: int):
        unnormed_input = f"{self.branch_names[j]}_norm" not in self.norm_names

        def measure(inputs, out):
            self._rms(out, self._at("branch_rms", j, out))
            if unnormed_input:
                self._rms(inputs[0].detach(), self._at("branch_in_rms", j, out))
        return measure

    def _logits_stats(self, _inputs, out):
        z = out.float()  # (B, T, V), in fp32 as sampling sees them
        B, T = z.shape[:2]  # T is 1 when only the last position's logits are made
        logz = torch.logsumexp(z, dim=-1, keepdim=True)
        logp = z - logz
        p = logp.exp()
        top = z.max(-1)
        stats = torch.stack([top.values, z.min(-1).values, z.std(-1, correction=0), logz[..., 0],
                             -(p * logp).sum(-1), (top.values - logz[..., 0]).exp()])  # (6, B, T)
        self._buf["logits"][:, :B, :T].copy_(stats)
        self._buf["top1_id"][:B, :T].copy_(top.indices)
        self.logits_len = T

    # ------------------------------------------------------------------ lifecycle
    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    # ------------------------------------------------------------------ derived views
    @property
    def attention(self) -> AttentionProbe:
        """Per layer and head attention statistics of the last forward (observatory/attention.py)."""
        if self._attention is None:
            raise ObservatoryError("attention statistics were not recorded: observe(model, attention=True) "
                                   "(the default; not available on a tensor-parallel rank)")
        return self._attention

    def attribution(self, target=None) -> Attribution:
        """Each block's attention and MLP share of the residual growth and, for `target`, of the final
        logit, per position (observatory/attribution.py). target: a token id, a (B, T) tensor of ids,
        or None for the model's own top-1 prediction at each position."""
        if self._recorder is None:
            raise ObservatoryError("the residual's parts were not recorded: use observe(model, attribution=True)")
        parts = self._recorder.parts()
        predicted = self.stats["top1_id"] if self.logits_len == self.shape[1] else None
        ids = target_ids(target, self.shape, predicted)
        names, logit = self._recorder.logit(parts, ids)
        return Attribution(components=names, growth=self._recorder.growth(parts), logit=logit)

    def norm_gain(self) -> torch.Tensor:
        """(norms, B, T): output RMS / input RMS, what each norm multiplies the scale by."""
        s = self.stats
        return s["norm_out_rms"] / s["norm_in_rms"].clamp_min(torch.finfo(torch.float32).tiny)

    def branch_ratio(self) -> torch.Tensor:
        """(2L, B, T): the RMS of what each branch adds to the residual stream over the RMS of the
        stream it is added to.

        What is added: the branch output, or its post-norm's output where the family has one
        (Gemma's sandwich, OLMo 2). The stream: the input of the branch's pre-norm (pre-norm and
        sandwich: x_l for attention, x_l + attn for the MLP; with NeoX's parallel residual both
        norms read x_l), or the branch's own input where no norm precedes it (OLMo 2)."""
        s = self.stats
        index = {n: j for j, n in enumerate(self.norm_names)}
        added, streams = [], []
        for j, name in enumerate(self.branch_names):
            post = index.get(f"{name}_post_norm")
            added.append(s["branch_rms"][j] if post is None else s["norm_out_rms"][post])
            pre = index.get(f"{name}_norm")
            streams.append(s["branch_in_rms"][j] if pre is None else s["norm_in_rms"][pre])
        return torch.stack(added) / torch.stack(streams).clamp_min(torch.finfo(torch.float32).tiny)

    def first_nonfinite(self) -> dict | None:
        """Where a NaN or inf first appeared: the earliest module in execution order, and in it the
        first (batch row, token) affected; None when every observed value was finite. "positions":
        how many (row, token) outputs of that module hold one; "total": the same over all modules."""
        counts = self.stats["nonfinite"]  # (sites, B, T) 0/1
        hit = counts.flatten(1).sum(-1).nonzero()
        if not len(hit):
            return None
        j = int(hit[0])
        # the first *position* hit, over all batch rows, is the origin (later ones see it via attention)
        t = int((counts[j] > 0).any(0).nonzero()[0])
        b = int((counts[j][:, t] > 0).nonzero()[0])
        name = self.sites.tracked[j]
        return {"module": name, "layer": _layer_of(name), "batch": b, "position": t,
                "positions": int(counts[j].sum()), "total": int(counts.sum())}

    def massive_activations(self, top: int = 5, min_ratio: float = 0.0) -> list[dict]:
        """Per layer, the channels with the largest |x| over all tokens: channel, signed value, the
        (batch row, token) where it peaks, how many tokens have it in their top-k, and |x| over that
        token's RMS (a channel holding all of a token's energy would give sqrt(hidden)). min_ratio:
        keep only channels whose peak holds at least that many times its token's RMS (massive ones),
        so a layer with none lists none."""
        s = self.stats
        ch, val, rms = s["resid_top_channels"], s["resid_top_values"], s["resid_rms"]
        rows = []
        for layer in range(ch.shape[0]):
            c, v = ch[layer].flatten(), val[layer].flatten()  # (B*T*k,)
            # NaN magnitudes rank last (first_nonfinite() reports them); inf ranks first
            mag = v.abs().nan_to_num(nan=-1.0)
            real = c >= 0  # pad positions hold channel -1
            counts = torch.bincount(c[real], minlength=self.model.config.hidden_size)
            peak = torch.full(counts.shape, -1.0).scatter_reduce(0, c[real], mag[real], reduce="amax")
            for channel in peak.topk(min(top, int((peak >= 0).sum()))).indices.tolist():
                where = int(((c == channel) & (mag == peak[channel])).nonzero()[0, 0])
                b, t = divmod(where // self.topk, rms.shape[2])
                value = float(v[where])
                if abs(value) < min_ratio * float(rms[layer, b, t]):
                    continue
                rows.append({"layer": layer, "channel": channel, "value": value, "batch": b,
                             "position": t, "tokens_in_topk": int(counts[channel]),
                             "ratio_to_rms": abs(value) / max(float(rms[layer, b, t]), 1e-30)})
        return rows

    def summary(self) -> dict:
        """Per-layer numbers averaged over the tokens of the last forward, plus the softmax of the
        last position (the distribution the next token is drawn from), averaged over the batch."""
        s = self.stats
        index = {n: j for j, n in enumerate(self.norm_names)}
        mask = self.mask
        def per_layer(key, suffix):  # None where the family has no such norm (OLMo 2: no pre-norms)
            return [float(masked_mean(s[key][index[f"layers.{i}.{suffix}"]], mask))
                    if f"layers.{i}.{suffix}" in index else None for i in range(self.num_layers)]
        # each row's last real position (its last one, without padding)
        last = (mask.sum(1) - 1 if mask is not None and self.logits_len == self.shape[1]
                else torch.full((self.shape[0],), self.logits_len - 1))
        logits = s["logits"][:, torch.arange(self.shape[0]), last].mean(-1)  # (6,) at the last position
        final = index.get("final_norm")
        real = s["mask"]
        return {"residual_rms": masked_mean(s["resid_rms"], mask).tolist(),
                "residual_absmax": s["resid_absmax"][:, real].amax(-1).tolist(),
                "attn_norm_in": per_layer("norm_in_rms", "attn_norm"),
                "attn_norm_out": per_layer("norm_out_rms", "attn_norm"),
                "mlp_norm_in": per_layer("norm_in_rms", "mlp_norm"),
                "mlp_norm_out": per_layer("norm_out_rms", "mlp_norm"),
                "final_norm_in": float(masked_mean(s["norm_in_rms"][final], mask)) if final is not None else None,
                "final_norm_out": float(masked_mean(s["norm_out_rms"][final], mask)) if final is not None else None,
                **{f"logit_{k}" if k in ("max", "min", "std") else k: float(v)
                   for k, v in zip(LOGIT_STATS, logits)},
                # the norms on the branch outputs, for the families that have them (Gemma's
                # sandwich, OLMo 2's reordered norm)
                **({f"{kind}_{io}": per_layer(f"norm_{io}_rms", kind)
                    for kind in ("attn_post_norm", "mlp_post_norm") for io in ("in", "out")}
                   if "layers.0.attn_post_norm" in index else {})}

    def to_records(self) -> list[dict]:
        """Long-format rows (one per site, batch row and token) for CSV or JSON."""
        s, B, T = self.stats, *self.shape
        rows: list[dict] = []
        real = s["mask"]
        for layer in range(self.num_layers + 1):
            for b in range(B):
                for t in range(T):
                    if not real[b, t]:
                        continue
                    rows.append({"kind": "residual", "layer": layer, "batch": b, "position": t,
                                 "rms": float(s["resid_rms"][layer, b, t]),
                                 "var": float(s["resid_var"][layer, b, t]),
                                 "absmax": float(s["resid_absmax"][layer, b, t]),
                                 "top_channels": s["resid_top_channels"][layer, b, t].tolist(),
                                 "top_values": s["resid_top_values"][layer, b, t].tolist()})
        gain, ratio = self.norm_gain(), self.branch_ratio()
        for j, name in enumerate(self.norm_names):
            rows += [{"kind": "norm", "module": name, "layer": _layer_of(name), "batch": b, "position": t,
                      "in_rms": float(s["norm_in_rms"][j, b, t]), "out_rms": float(s["norm_out_rms"][j, b, t]),
                      "gain": float(gain[j, b, t])} for b in range(B) for t in range(T) if real[b, t]]
        for j, name in enumerate(self.branch_names):
            rows += [{"kind": "branch", "module": name, "layer": _layer_of(name), "batch": b, "position": t,
                      "rms": float(s["branch_rms"][j, b, t]), "ratio_to_stream": float(ratio[j, b, t])}
                     for b in range(B) for t in range(T) if real[b, t]]
        for b in range(B):
            for t in range(self.logits_len):
                if not real[b, t + T - self.logits_len]:
                    continue
                row = {"kind": "logits", "batch": b, "position": t + T - self.logits_len,
                       "top1_id": int(s["top1_id"][b, t])}
                row.update({k: float(s["logits"][i, b, t]) for i, k in enumerate(LOGIT_STATS)})
                rows.append(row)
        return rows

