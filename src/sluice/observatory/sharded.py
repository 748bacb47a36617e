"""The observatory on one rank of a tensor-parallel model (parallel/loading.py), reduced over the ranks
to exactly what one process would report.

On a rank model most of what the probes read is *replicated*: the embedding and every row-parallel
output (attention o, MLP down) are all-reduced inside the forward, so the residual stream, every
hidden-size norm's input and output, and both branch outputs are the whole tensors on every rank.
Those statistics are taken once, as they are. What is *sharded* is combined:

- per-head q/k norms (Qwen3): each rank holds some heads. The RMS over all heads is the square root
  of the mean over heads of each head's mean square; a rank's share is its mean square weighted by
  its heads / (all heads), and a KV head replicated on several ranks (GQA with fewer KV heads than
  ranks) is weighted 1 / (its copies), so it counts once.
- the logits (B, T, V/N per rank): max and min by MAX/MIN all-reduces; mean and std over the full
  vocabulary from sums (mean first, then the sum of squared deviations); log Z by parallel.log_z's
  log-sum-exp merge; entropy = -sum p log p summed per shard with the global log Z; top-1 by
  parallel.greedy (ties to the lowest id, as torch.argmax).
- non-finite checks: a module's output has a NaN/inf iff some rank's part of it does (MAX of flags).
- the logit lens (`sharded_lens`): the final norm is replicated and the LM head vocabulary-parallel,
  so each rank gets its shard of every layer's logits; top-k per shard merged (every rank's k best
  hold the global k best), and p(predicted), KL and entropy summed per shard.

Only the softmax-safety table needs whole rows (its fp16/bf16 methods round the full-vocabulary sum
and its online method walks 4,096-id chunks that shard borders would cut): `gather_to_root` brings the
(T, V) fp32 logits, with and without the final norm, to rank 0 only, 2 * T * V * 4 bytes (128 tokens of
a 151,936-token vocabulary: 156 MB), which is what the single-process report holds as well.
A forward with a NaN or inf in its logits gathers them too (B * T * V * 4 bytes on every rank), so
the per-position statistics follow torch's own NaN rules; the lens refuses such a forward.
The hooks run collectives, so every rank must run the same forwards (eager mode, not compiled).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..engine.sampling import value_then_id
from ..errors import ObservatoryError
from ..parallel import greedy, group, log_z
from ..parallel.sharding import kv_heads_of, vocab_range
from .lens import LensResult, capture_stream, check_size, head_logits
from .probes import Observation

MAX, MIN, SUM = dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM


def _start(model) -> int:
    return vocab_range(model.full_config, model.rank, model.world).start


def _head_weights(model, names: list[str]) -> dict[int, float]:
    """Row index of each per-head norm -> this rank's weight in the mean square over ALL heads."""
    cfg, r, N = model.full_config, model.rank, model.world
    kv = kv_heads_of(cfg, r, N)
    copies = max(1, N // cfg.num_kv_heads)  # ranks holding each KV head (1 unless K < N)
    q_w = (cfg.num_heads // N) / cfg.num_heads
    k_w = len(kv) / (copies * cfg.num_kv_heads)
    out = {}
    for j, name in enumerate(names):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("q_norm", "k_norm"):
            out[j] = q_w if leaf == "q_norm" else k_w
    return out


class ParallelObservation(Observation):
    """`observe()` on a rank model: the same hooks, then one reduction per forward (in the hook on
    the model's output), after which `stats`, `summary()` and the rest are the single-process values
    on every rank."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        modules = dict(model.named_modules())
        self._head_rows = _head_weights(model, self.norm_names)
        C = model.config.hidden_size
        for j, name in enumerate(self.norm_names):  # a norm over anything but the replicated stream or
            w = getattr(modules[name], "weight", None)  # one head is sharded in a way not reduced here
            if j not in self._head_rows and w is not None and w.shape[-1] != C:
                self.remove()
                raise ObservatoryError(f"{name} normalises {w.shape[-1]} channels, neither the hidden size "
                                       f"({C}) nor one head: its statistics cannot be reduced over tensor-"
                                       "parallel ranks")
        if self._attention is not None:
            self._attention.merge = lambda s: _merge_heads(model, s)
        if self._recorder is not None:  # the stream is whole on every rank; the LM head's rows are not
            self._recorder.vocab_start = _start(model)
            self._recorder.reduce = lambda t: group.all_reduce(t, op=SUM)

    def _logits_stats(self, inputs, out):
        B, T = out.shape[:2]
        self._reduce_heads(B, T)
        self._reduce_nonfinite(B, T)
        z = out.float()
        broken = group.all_reduce((~z.isfinite()).any().float().reshape(1), op=MAX)
        if broken.item():  # NaN/inf: torch's own rules on the gathered logits (B * T * V * 4 bytes)
            return super()._logits_stats(inputs, torch.cat(list(group.all_gather(z)), -1))
        stats, top1 = logit_stats(z, _start(self.model), self.model.full_config.vocab_size)
        self._buf["logits"][:, :B, :T].copy_(stats)
        self._buf["top1_id"][:B, :T].copy_(top1)
        self.logits_len = T

    def _reduce_heads(self, B: int, T: int) -> None:
        if not self._head_rows:
            return
        rows = list(self._head_rows)
        w = torch.tensor([self._head_rows[j] for j in rows])[:, None, None]
        both = torch.stack([self._buf[k][rows, :B, :T] for k in ("norm_in_rms", "norm_out_rms")])
        ms = group.all_reduce(both.double().square() * w, op=SUM)  # (2, rows, B, T) mean squares
        for k, rms in zip(("norm_in_rms", "norm_out_rms"), ms.sqrt().float(), strict=True):
            self._buf[k][rows, :B, :T] = rms

    def _reduce_nonfinite(self, B: int, T: int) -> None:
        view = self._buf["nonfinite_sum"][:, :B, :T]
        flag = group.all_reduce((~view.isfinite()).float(), op=MAX)
        view.copy_(torch.where(flag > 0, math.nan, 0.0))


def _merge_heads(model, s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's per-head attention statistics (its own heads) -> every head's, on every rank: query
    heads lie in rank order; a KV head replicated on several ranks is taken from the first of them."""
    cfg, N = model.full_config, model.world
    out = dict(s)
    for name, t in s.items():
        if name in ("k_norm", "keys_visible"):
            continue
        gathered = group.all_gather(t)  # (N, L, H/N, B, T)
        out[name] = gathered.transpose(0, 1).flatten(1, 2)  # (L, H, B, T)
    kv = group.all_gather(s["k_norm"])  # (N, L, K_rank, B, T)
    owner = {}
    for r in range(N):
        for j, g in enumerate(kv_heads_of(cfg, r, N)):
            owner.setdefault(g, (r, j))
    out["k_norm"] = torch.stack([kv[r, :, j] for r, j in (owner[g] for g in range(cfg.num_kv_heads))], 1)
    return out


def logit_stats(z: torch.Tensor, start: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite (B, T, V/N) fp32 logits shard -> (6, B, T) probes.LOGIT_STATS over the full vocabulary
    and the (B, T) top-1 ids, the same on every rank."""
    B, T, Vn = z.shape
    x = z.reshape(-1, Vn)  # (BT, V/N)
    ext = group.all_reduce(torch.stack([x.amax(-1), -x.amin(-1)]), op=MAX)  # (2, BT)
    mean = group.all_reduce(x.double().sum(-1), op=SUM) / V
    lz = log_z(x)  # (BT,)
    logp = x - lz[:, None]
    sums = group.all_reduce(torch.stack([(x.double() - mean[:, None]).square().sum(-1),
                                         -(logp.exp() * logp).sum(-1).double()]), op=SUM)
    top1 = greedy(x, start)
    stats = torch.stack([ext[0], -ext[1], (sums[0] / V).sqrt().float(), lz, sums[1].float(),
                         (ext[0] - lz).exp()])
    return stats.reshape(6, B, T), top1.reshape(B, T)


def _merge_topk(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, ..., k') per-rank top values and global ids -> (..., k) the global top k, best first,
    ties to the lowest id."""
    v = vals.movedim(0, -2).flatten(-2)  # (..., N*k'), rank order = id order
    i = ids.movedim(0, -2).flatten(-2)
    order = value_then_id(v, i)[..., :k]
    return v.gather(-1, order), i.gather(-1, order)


def sharded_lens(model, ids: torch.Tensor, topk: int = 5, max_bytes: int = 2 << 30) -> LensResult:
    """lens.whole_lens on a rank model: the same LensResult on every rank, except final_logits, which
    is this rank's (B, T, V/N) shard. Each rank holds its stream copy and V/N-wide logits only."""
    V = model.full_config.vocab_size
    if ids.ndim != 2:
        raise ObservatoryError(f"logit_lens takes token ids of shape (B, T), got {tuple(ids.shape)}")
    if not 1 <= topk <= V:
        raise ObservatoryError(f"topk must be in [1, {V}], got {topk}")
    B, T = ids.shape
    L, C = len(model.layers), model.config.hidden_size
    check_size(model, B, T, max_bytes)  # this rank's cost: its V/N columns of logits
    w = model.embed.weight
    stream = torch.empty(L + 1, B, T, C, dtype=w.dtype, device=w.device)
    start = _start(model)
    with torch.inference_mode():
        final = capture_stream(model, ids, stream)  # (B, T, V/N)
        Vn = final.shape[-1]
        k = min(topk, Vn)
        fl = final.reshape(-1, Vn)
        predicted = greedy(fl, start)  # (BT,) global ids
        logp_final = fl - log_z(fl)[:, None]
        p_final = logp_final.exp()
        local = predicted - start
        mine = (local >= 0) & (local < Vn)  # the rows whose predicted id this rank holds
        vals, tops, parts, bad = [], [], [], torch.zeros(1)
        for l in range(L + 1):
            z = head_logits(model, stream[l]).reshape(-1, Vn)  # (BT, V/N)
            bad = torch.maximum(bad, (~z.isfinite()).any().float())
            logp = z - log_z(z)[:, None]
            top = logp.topk(k, dim=-1)
            vals.append(top.values)
            tops.append(top.indices + start)
            p_pred = torch.where(mine, logp.gather(-1, local.clamp(0, Vn - 1)[:, None])[:, 0].exp(), 0.0)
            parts.append(torch.stack([p_pred, (p_final * (logp_final - logp)).sum(-1),
                                      -(logp.exp() * logp).sum(-1)]))
        if group.all_reduce(bad, op=MAX).item():  # the same decision on every rank
            raise ObservatoryError("the logit lens is not computed under tensor parallelism on a forward whose "
                                   "logits hold NaN/inf (its cross-shard top-k merge and sums need finite "
                                   "values); see the non-finite finding")
        sums = group.all_reduce(torch.stack(parts), op=SUM)  # (L+1, 3, BT)
        top_v, top_i = _merge_topk(group.all_gather(torch.stack(vals)), group.all_gather(torch.stack(tops)), topk)
        mean_square = torch.stack([stream[l].float().pow(2).mean() for l in range(L + 1)])
    shape = (L + 1, B, T)
    return LensResult(top_i.reshape(*shape, topk), top_v.exp().reshape(*shape, topk),
                      sums[:, 0].reshape(shape), sums[:, 1].reshape(shape), sums[:, 2].reshape(shape),
                      mean_square, final, predicted.reshape(B, T))


def gather_to_root(t: torch.Tensor) -> torch.Tensor | None:
    """(..., V/N) on every rank -> (..., V) on rank 0 (ids in order), None elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
    try:
        dist.gather(t.contiguous(), parts, dst=0)
    except RuntimeError as e:
        raise group.collective_failed("gather", e) from None
    return torch.cat(parts, -1) if rank == 0 else None
