"""The fused LM head: next tokens straight from final-normed hidden states, walking the vocabulary
in chunks of LM-head rows so that no vocabulary-sized vector is ever written.

The plain path (Transformer.logits, then Sampler) writes V fp32 logits per row and reads them back
for the max, for exp and sum, and for the filters (top-k/top-p sort the whole row) before it
samples. Here each chunk of c head rows (c, C) meets the hidden states and gives (B, c) logits that
live only while that chunk is processed; per row we keep

- a running max and a running sum of exp (the online softmax of observatory/softmax.py): log Z;
- the running best key: the logit (greedy), or logit / T - log E with E ~ Exp(1) from the row's
  own stream, for this chunk's tokens (the exponential race of sampling.py, which needs no
  normaliser at all);
- each chunk's top-K (values, ids) for rows with top_k / top_p / min_p: their union holds the
  vocabulary's top-K, from which the filters are resolved at the end.

Filters follow sampling.filter_logits exactly (order, ties, fp32). On K candidates that is exact only
when the kept set provably lies inside them. Every token outside has a logit <= the K-th
candidate's, so it suffices that top_k's k-th value, or top_p's cut, or min_p's threshold lies
strictly above that value, or that K covers the vocabulary. A row where none holds (top-p's nucleus
has more than K tokens on a flat distribution, or bf16 ties straddle the K-th value) FALLS BACK to
the plain path for that step: its full logits are computed and sampling.filter_logits runs on them.
Finding such rows is this path's one host sync. Greedy and pure-temperature rows never fall back.

Numerics are the plain path's: each chunk's matmul runs in the weight dtype and is cast to fp32 as
Transformer.logits does, then Gemma's soft-cap, then the repetition penalty. On the CPU measured a
chunk of F.linear is bit-identical to the same columns of the full product, so greedy picks the
same token (the first index on ties, like argmax); tests/engine/test_fused_head.py checks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .noise import RowStream, log_exp_noise, uniforms_at, uniforms_range
from .sampling import (NONFINITE, Sampler, SamplingParams, filter_logits, nonfinite_rows, penalize_seen,
                       value_then_id)

CHUNK = 32768  # head rows per step: a (32, 32768) fp32 block fits the L3 cache; few chunks, little overhead
CANDIDATES = 1024  # the top-K kept per row with filters; raised to max(top_k) + 1 where a row needs it
# "auto" steps taken on the fused head (by a scheduler, over all its requests) before its fallback rate
# may send the steps back to the plain head.
AUTO_PROBATION = 16


def params_want_fused(fused_head: bool | str, params: list[SamplingParams]) -> bool:
    """Sample through the fused LM head (fused_head.py) or the plain one (logits, Sampler), as the rows'
    params say (fixed for a row's life: the scheduler keeps the answer); head_allows_fused has the
    model's say, and Scheduler._fused asks both.

    "auto" takes the fused path only where the plain one would sort the vocabulary in torch: a batch
    with a sampled row that uses top-k, top-p or min-p, on a machine without the native batch sampler
    (sample.py). With it, the plain path (the native step's logits, then one native draw) measured
    1.6-2.4x the fused one's decode tok/s with top_k 40 / top_p 0.95, on the bundled model and on the
    Qwen3-0.6B shape (152k vocabulary), 1 and 8 rows; with top_p alone (which the native draw hands to
    torch's sort) still ~1.1x at 8 rows. bench/fused_head.py had measured the fused path faster than
    the torch sort alone. A fused "auto" batch whose rows keep
    falling back (over a quarter of them after AUTO_PROBATION steps: a model too flat for the
    candidates to prove its cuts, paying for the LM head twice) returns to the plain path
    (scheduler.Scheduler._fused)."""
    if fused_head is True:
        return True
    if fused_head != "auto" or not any(_has_filter(p) for p in params):
        return False
    from . import sample
    return sample.kernel() is None


def head_allows_fused(model) -> bool:
    """Whether the model lets the fused head run: a float LM head, and no hooks on the model or its
    head (the observatory needs the logits and the head module to run)."""
    m = model
    if not isinstance(m.lm_head, torch.nn.Linear):  # a quantized head (model/quant.py) has no float weight
        return False
    return not any(mod._forward_hooks or mod._forward_pre_hooks for mod in (m, m.lm_head))


@dataclass
class HeadOut:
    tokens: torch.Tensor  # (B,) int64 next tokens; NONFINITE where a row's logits were not all finite
    fallback: torch.Tensor  # (B,) bool: rows sampled by the plain path this step
    log_z: torch.Tensor | None = None  # (B,) fp32 logsumexp of the model's logits (soft-capped, T 1, no penalty)
    logprobs: torch.Tensor | None = None  # (B,) fp32 log p of each token under that distribution


def _has_filter(p: SamplingParams) -> bool:
    return p.temperature > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)


def _online(m: torch.Tensor, s: torch.Tensor, z: torch.Tensor, t: torch.Tensor | None = None):
    """Fold a chunk z (B, c) into the running max m (B,) and running sum s (B,) of exp((z - m) / t).

    When the max grows the old sum is rescaled by exp((m_old - m_new) / t) <= 1; on the first
    chunk m_old = -inf makes that factor 0."""
    m_new = torch.maximum(m, z.amax(-1))
    if t is None:
        return m_new, s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(-1)
    return m_new, s * torch.exp((m - m_new) / t) + torch.exp((z - m_new[:, None]) / t[:, None]).sum(-1)


def _race(x: torch.Tensor, ids: torch.Tensor | None, streams: list[RowStream]) -> torch.Tensor:
    """argmax(x - log E) per row of x (n, m), E the noise of row r's stream (noise.py) for the tokens ids
    (n, m), or for tokens 0..m-1 when ids is None."""
    u = uniforms_range(streams, 0, x.shape[1]) if ids is None else uniforms_at(streams, ids)
    return (x - log_exp_noise(u)).argmax(-1)


class FusedHead:
    """Samples from hidden states (B, C) and the LM-head weight (V, C) for the rows of a Sampler.

    The Sampler keeps what a row is (params, generator, repetition-penalty mask), so Sampler.set_row
    and add_context apply here too and a fallback row uses the same state as the plain path."""

    def __init__(self, sampler: Sampler, chunk: int = CHUNK, candidates: int = CANDIDATES):
        self.sampler, self.chunk, self.candidates = sampler, chunk, candidates
        self.calls = self.rows_filtered = self.rows_fallback = 0  # for callers that adapt (LLM's "auto")

    @property
    def fallback_rate(self) -> float:
        """The fraction of filtered rows so far that fell back to the plain path."""
        return self.rows_fallback / self.rows_filtered if self.rows_filtered else 0.0

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None = None,
                 logprobs: bool = False) -> HeadOut:
        smp = self.sampler
        B, V = smp.seen.shape  # (B, V) bool: the only vocabulary-sized state (1 byte a token), for penalties
        assert hidden.shape == (B, weight.shape[1]) and weight.shape[0] == V, (hidden.shape, weight.shape)
        dev, params, temp = hidden.device, smp.params, smp.rows["temperature"]
        filt = [i for i, p in enumerate(params) if _has_filter(p)]  # rows resolved on candidates
        race = [i for i, p in enumerate(params) if p.temperature > 0 and not _has_filter(p)]  # whole-vocab race
        pick = len(filt) < B  # greedy or race rows exist
        # Enough candidates to prove any row's top_k cut: the k-th value must beat the K-th.
        K = min(V, max([self.candidates] + [params[i].top_k + 1 for i in filt]))
        need_mass = any(params[i].top_p < 1 and params[i].top_k <= 0 for i in filt)
        fr = torch.tensor(filt, dtype=torch.int64, device=dev)
        temp_f = temp[fr]  # (Bf,)

        best = torch.full((B,), -math.inf, device=dev)  # (B,) running best key
        best_id = torch.zeros(B, dtype=torch.int64, device=dev)
        broken = torch.zeros(B, dtype=torch.bool, device=dev)  # a NaN or inf logit in any chunk, as the plain Sampler
        m_raw, s_raw = torch.full((B,), -math.inf, device=dev), torch.zeros(B, device=dev)
        m_t, s_t = torch.full((len(filt),), -math.inf, device=dev), torch.zeros(len(filt), device=dev)
        cand_v, cand_i = [], []  # per chunk (Bf, <=K): penalised logits and token ids
        race_streams = [smp.streams[i] for i in race]
        for start in range(0, V, self.chunk):
            z = F.linear(hidden, weight[start:start + self.chunk]).float()  # (B, c) as Transformer.logits
            c = z.shape[1]
            if softcap is not None:
                z = torch.tanh(z / softcap) * softcap
            broken |= nonfinite_rows(z)
            if logprobs:
                m_raw, s_raw = _online(m_raw, s_raw, z)
            if smp.uses_penalty:
                z = penalize_seen(z, smp.seen[:, start:start + c], smp.rows["penalty"])
            if pick:
                key = z  # greedy rows: the penalised logit; their temperature reads 1 and noise stays 1
                if race:  # the race rows' noise for this chunk's tokens; log E = 0 for the others
                    log_e = torch.zeros(B, c, device=dev)
                    log_e[race] = log_exp_noise(uniforms_range(race_streams, start, c))
                    key = z / temp[:, None] - log_e
                j = key.argmax(-1)  # (B,) the first maximum within the chunk
                v = key.gather(1, j[:, None])[:, 0]
                better = v > best  # strict: on a tie the earlier chunk wins, as in a full-row argmax
                best, best_id = torch.where(better, v, best), torch.where(better, j + start, best_id)
            if filt:
                zf = z if len(filt) == B else z[fr]  # (Bf, c)
                if need_mass:
                    m_t, s_t = _online(m_t, s_t, zf, temp_f)
                v, j = zf.topk(min(K, c), dim=-1)
                cand_v.append(v)
                cand_i.append(j + start)

        tokens, fallback = best_id, torch.zeros(B, dtype=torch.bool, device=dev)
        if filt:
            tok_f, fb_f = self._resolve(torch.cat(cand_v, 1), torch.cat(cand_i, 1), K, V, fr,
                                       s_t if need_mass else None)
            tokens[fr], fallback[fr] = tok_f, fb_f
            n_fallback = int(fb_f.sum())  # the host sync: how many rows could not be proven exact
            if n_fallback:
                idx = fr[fb_f]
                tokens[idx] = self._plain(hidden[idx], weight, softcap, idx.tolist())
            self.rows_filtered, self.rows_fallback = self.rows_filtered + len(filt), self.rows_fallback + n_fallback
        self.calls += 1
        for i in race + filt:  # one draw a sampled row, whichever path it took
            smp.streams[i].advance()
        if smp.uses_penalty:
            smp.seen.scatter_(1, tokens[:, None], True)
        out = HeadOut(tokens, fallback)
        if logprobs:
            out.log_z = m_raw + s_raw.log()
            out.logprobs = self._logits_of(hidden, weight, softcap, tokens) - out.log_z
        out.tokens = tokens.masked_fill(broken, NONFINITE)  # after the uses above, which index with it
        return out

    def _resolve(self, cand_v, cand_i, K: int, V: int, fr, s_t):
        """The filtered rows on their candidates (Bf, n >= K): -> tokens (Bf,), fallback (Bf,) bool."""
        smp = self.sampler
        rows = {name: t[fr] for name, t in smp.rows.items()}  # (Bf,) each
        # filter_logits's order: value descending, token id ascending on ties (its stable sort).
        order = value_then_id(cand_v, cand_i)[:, :K]
        v, ids = cand_v.gather(1, order), cand_i.gather(1, order)  # (Bf, K): the vocabulary's top-K
        x = (v - v[:, :1]) / rows["temperature"][:, None]  # (Bf, K) as filter_logits's x
        complete = K == V  # every token is a candidate
        certain = (v > v[:, -1:]) | complete  # (Bf, K): no token outside can rank among these
        exact = torch.full_like(certain[:, 0], complete)  # (Bf,)
        use_top_k, use_top_p, use_min_p = smp.filters
        k = rows["top_k"]
        topk_on = k < V  # off rows have k = V
        kth = (k - 1).clamp(max=K - 1)[:, None]  # (Bf, 1); off rows read the K-th: keeps every candidate
        keep = x >= x.gather(1, kth)  # top_k keeps ties with the k-th (HF's rule)
        k_proven = certain.gather(1, kth)[:, 0]  # the k-th value beats every token outside
        exact |= topk_on & k_proven
        if use_top_p or use_min_p:
            # Over the top-k survivors where top_k is on (then all candidates); else over the whole
            # vocabulary, whose normaliser is the online sum s_t = sum exp((z - max) / T).
            p = x.masked_fill(~keep, -math.inf).softmax(-1)
            if s_t is not None:
                p = torch.where(topk_on[:, None], p, torch.exp(x) / s_t[:, None])
            if use_top_p:
                top_p = rows["top_p"][:, None]
                mass_before = F.pad(p.cumsum(-1)[:, :-1], (1, 0))  # as filter_logits computes it
                keep_p = (mass_before < top_p) | (top_p >= 1)
                keep &= keep_p
                # A certain token already past the cut: everything ranked after it is out too.
                exact |= (certain & ~keep_p).any(-1)
            if use_min_p:
                keep_m = p >= rows["min_p"][:, None] * p[:, :1]
                keep &= keep_m
                exact |= ~keep_m[:, -1]  # the K-th value fails min_p, so every smaller one does
        keep[:, 0] = True
        fallback = ~exact | (topk_on & ~k_proven)  # an unproven top-k set also leaves top-p's mass unknown
        pick = _race(x.masked_fill(~keep, -math.inf), ids, [smp.streams[i] for i in fr.tolist()])
        return ids.gather(1, pick[:, None])[:, 0], fallback

    def _plain(self, hidden, weight, softcap, idx: list[int]) -> torch.Tensor:
        """The plain path for rows idx: full logits (n, V), sampling.filter_logits, the race."""
        smp = self.sampler
        z = F.linear(hidden, weight).float()
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        rows = {name: t[idx] for name, t in smp.rows.items()}
        if smp.uses_penalty:
            z = penalize_seen(z, smp.seen[idx], rows["penalty"])
        return _race(filter_logits(z, rows, *smp.filters), None, [smp.streams[i] for i in idx])

    @staticmethod
    def _logits_of(hidden, weight, softcap, tokens) -> torch.Tensor:
        """The model's logit of each chosen token (B,): one head row each, rounded as the matmul's."""
        z = (hidden.float() * weight[tokens].float()).sum(-1).to(weight.dtype).float()
        return torch.tanh(z / softcap) * softcap if softcap is not None else z
