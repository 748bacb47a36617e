"""The fused LM head + sampler (engine/fused_head.py) against the plain path (full logits, Sampler).

Vocabularies are odd (V = 1001 with chunks of 256: the last chunk is short) and batches mix rows
with different params, as the engine runs them.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

import sluice
from sluice.engine import batch_sampling, sample
from sluice.engine.fused_head import AUTO_PROBATION, params_want_fused
from sluice.engine.fused_head import FusedHead
from sluice.engine.sampling import Sampler, SamplingParams, filtered_probs

V, C, CHUNK = 1001, 48, 256
N = 4000  # draws per distribution


def head_weight(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, C, generator=g) / C ** 0.5).to(dtype)  # (V, C)


def hidden(n, scale, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, C, generator=g) * scale).to(dtype)  # (n, C): logits ~ N(0, scale^2)


def plain_logits(h, W, softcap=None):
    z = F.linear(h, W).float()  # as Transformer.logits
    return torch.tanh(z / softcap) * softcap if softcap is not None else z


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_identical_to_plain_path_including_ties(dtype):
    W = head_weight(dtype=dtype)
    W[900] = W[300]  # an exact tie across chunks: the first index must win, as argmax's does
    W[301] = W[300]  # and one within a chunk
    h = hidden(16, 4.0, dtype=dtype)
    h[0] = W[300] * 3  # row 0's maximum is that tie
    for softcap, penalty in [(None, 1.0), (3.0, 1.0), (None, 1.5)]:
        params = [SamplingParams(temperature=0, repetition_penalty=penalty)] * len(h)
        plain, fused = Sampler(params, V), Sampler(params, V)
        for s in (plain, fused):
            s.add_context(1, [5, 17, 300])
        ref = plain(plain_logits(h, W, softcap))
        out = FusedHead(fused, chunk=CHUNK)(h, W, softcap)
        assert torch.equal(out.tokens, ref) and not out.fallback.any()
        assert ref[0] == 300
        assert torch.equal(fused.seen, plain.seen)  # the penalty mask is updated the same way


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_log_z_and_logprobs(softcap):
    W, h = head_weight(), hidden(5, 6.0)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(top_p=0.8, seed=2), SamplingParams(top_k=3, seed=3),
              SamplingParams(min_p=0.2, repetition_penalty=1.3, seed=4)]
    out = FusedHead(Sampler(params, V), chunk=CHUNK)(h, W, softcap, logprobs=True)
    z = plain_logits(h, W, softcap)
    ref = torch.logsumexp(z.double(), -1)
    assert ((out.log_z.double() - ref).abs() / ref.abs()).max() <= 1e-5
    logp = torch.log_softmax(z.double(), -1).gather(1, out.tokens[:, None])[:, 0]
    assert (out.logprobs.double() - logp).abs().max() <= 1e-4


# name -> (params, hidden scale, soft-cap, seen tokens): one group of N rows each, in one batch.
GROUPS = {
    "temperature": (dict(temperature=0.8), 3.0, None, ()),
    "top_k": (dict(top_k=7, temperature=1.3), 2.0, None, ()),
    "top_p": (dict(top_p=0.7), 4.0, None, ()),
    "min_p": (dict(min_p=0.1, temperature=0.9), 4.0, None, ()),
    "penalty": (dict(top_p=0.9, repetition_penalty=1.8), 4.0, None, "top3"),
    "softcap": (dict(top_p=0.8), 6.0, 8.0, ()),  # raw logits reach ~17, capped at 7.8
}


def counts_vs_expected(tokens, expected):
    """Chi-square p-value of the token counts against expected probs; rare tokens pooled in one bin."""
    counts = np.bincount(tokens, minlength=V).astype(float)
    assert counts[expected == 0].sum() == 0, "a filtered-out token was drawn"
    big = expected * len(tokens) >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum()) * len(tokens)
    keep = exp > 0
    return chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue


def run_groups(groups, W, candidates=128):
    """One batch: N rows per group (each row its own seed), the group's hidden state in every row.

    128 candidates of 1001 tokens: the exactness proofs are exercised, not skipped (K >= V is exact)."""
    names = list(groups)
    h = torch.cat([hidden(1, groups[n][1], seed=10 + i).expand(N, C) for i, n in enumerate(names)])
    params, seen_ids = [], []
    for i, n in enumerate(names):
        kw, scale, cap, seen = groups[n]
        z = plain_logits(h[i * N: i * N + 1], W, cap)[0]
        ids = z.topk(3).indices.tolist() if seen == "top3" else []
        params += [SamplingParams(seed=100_000 * i + r, **kw) for r in range(N)]
        seen_ids += [ids] * N
    caps = {groups[n][2] for n in names}
    assert len(caps) == 1, "one soft-cap per batch (it is the model's)"
    cap = caps.pop()
    sampler = Sampler(params, V)
    for row, ids in enumerate(seen_ids):
        if ids:
            sampler.add_context(row, ids)
    seen = sampler.seen.clone()
    out = FusedHead(sampler, chunk=CHUNK, candidates=candidates)(h, W, cap)
    results = {}
    for i, n in enumerate(names):
        rows = slice(i * N, (i + 1) * N)
        z = plain_logits(h[i * N: i * N + 1], W, cap)
        expected = filtered_probs(z, [params[i * N]], seen[i * N: i * N + 1])[0].double().numpy()
        results[n] = (out.tokens[rows].numpy(), expected / expected.sum(), out.fallback[rows])
    return results


def check_cut_margins(z, kw):
    """No top_p / min_p cut within 1e-4 of a boundary, so fp32 rounding cannot move a token across."""
    p = torch.softmax(z.double() / kw.get("temperature", 1.0), -1).sort(descending=True).values
    if "top_p" in kw:
        assert (p.cumsum(0) - kw["top_p"]).abs().min() > 1e-4
    if "min_p" in kw:
        assert (p / p[0] - kw["min_p"]).abs().min() > 1e-4


@pytest.mark.parametrize("split", ["mixed", "softcap"])
def test_draws_follow_the_reference_filtered_distribution(split):
    W = head_weight()
    names = [n for n in GROUPS if (n == "softcap") == (split == "softcap")]
    groups = {n: GROUPS[n] for n in names}
    results = run_groups(groups, W)
    for n, (tokens, expected, fallback) in results.items():
        kw, scale, cap, _ = groups[n]
        if n != "penalty":
            check_cut_margins(plain_logits(hidden(1, scale, seed=10 + names.index(n)), W, cap)[0], kw)
        if n != "temperature":
            assert (expected == 0).any(), f"{n}: the filter should remove something"
        assert not fallback.any(), f"{n}: these distributions are peaked enough to be proven exact"
        assert counts_vs_expected(tokens, expected) > 1e-3, n


def test_fallback_when_candidates_cannot_prove_the_cut():
    """With 8 candidates a top-p nucleus of dozens of tokens, or a min_p threshold below the 8th
    candidate, cannot be resolved on the candidates: those rows take the plain path, still exact."""
    W = head_weight()
    groups = {"top_p": (dict(top_p=0.8), 2.0, None, ()),
              "min_p": (dict(min_p=0.05), 2.0, None, ()),
              "greedy": (dict(temperature=0), 2.0, None, ())}
    results = run_groups(groups, W, candidates=8)
    for n in ("top_p", "min_p"):
        tokens, expected, fallback = results[n]
        assert fallback.all(), n
        assert (expected > 0).sum() > 8, "the kept set must be larger than the candidates"
        assert counts_vs_expected(tokens, expected) > 1e-3, n
    tokens, expected, fallback = results["greedy"]
    assert not fallback.any() and (tokens == expected.argmax()).all()


def test_top_k_tie_at_the_last_candidate_falls_back():
    """bf16-like ties: the k-th value equals the K-th candidate's, so the kept set (every token
    tied with the k-th) may extend past the candidates."""
    W = head_weight()
    h = hidden(2, 3.0)
    z = plain_logits(h, W)
    tied = z[0].topk(10).indices
    for t in tied[2:]:
        W[t] = W[tied[2]]  # tokens 3..10 of row 0 tie with its 3rd
    h = h[[0, 1, 0]]
    # Row 2 adds top_p, whose cut falls among the certain candidates (so it claims exactness), but
    # its probabilities are normalised over the top-k set, which is not known: still the plain path.
    params = [SamplingParams(top_k=3, seed=1), SamplingParams(top_k=3, seed=2),
              SamplingParams(top_k=3, top_p=0.05, seed=3)]
    out = FusedHead(Sampler(params, V), chunk=CHUNK, candidates=5)(h, W)
    assert out.fallback.tolist() == [True, False, True]


def test_fused_head_in_the_engine(tiny_dir):
    plain = sluice.LLM(str(tiny_dir), fused_head=False)
    fused = sluice.LLM(str(tiny_dir), fused_head=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 7, 50)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.2)
    a, b = plain.generate(prompts, greedy), fused.generate(prompts, greedy)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    one, two = fused.generate(prompts, params), fused.generate(prompts, params)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]  # seeded: reproducible
    with pytest.raises(sluice.ConfigError, match="fused_head"):
        sluice.LLM(str(tiny_dir), fused_head="yes")


def test_engine_uses_the_plain_head_while_hooks_watch_the_logits(tiny_dir):
    llm = sluice.LLM(str(tiny_dir), fused_head=True)
    seen = []
    handle = llm.model.register_forward_hook(lambda _m, _i, out: seen.append(out.shape[-1]))
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        handle.remove()
    assert seen and set(seen) == {llm.model.config.vocab_size}  # logits, never hidden states


@pytest.mark.slow
def test_auto_returns_to_the_plain_head_when_rows_keep_falling_back(tiny_dir, monkeypatch):
    heads = []

    class Spy(FusedHead):  # with fewer candidates than the 512 tokens, so that proofs can fail
        def __init__(self, sampler):
            super().__init__(sampler, candidates=64)
            heads.append(self)

    monkeypatch.setattr(batch_sampling, "FusedHead", Spy)  # the scheduler's draw makes one a step
    monkeypatch.setattr(sample, "kernel", lambda: None)  # "auto" is fused only without the native sampler
    # A random model is flat: top-p's nucleus is most of the 512 tokens, far over 64 candidates.
    p = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True)  # not greedy
    assert len(sluice.LLM(str(tiny_dir)).generate([[5, 6, 7]], p)[0].token_ids) == 30
    assert sum(h.calls for h in heads) == AUTO_PROBATION
    assert sum(h.rows_fallback for h in heads) > 0.25 * sum(h.rows_filtered for h in heads)
    heads.clear()
    sluice.LLM(str(tiny_dir), fused_head=True).generate([[5, 6, 7]], p)
    assert sum(h.calls for h in heads) == 30  # forced: every token through the fused head


def test_auto_takes_the_plain_head_where_the_native_sampler_runs(monkeypatch):
    """The native sampler draws filtered rows from the step's logits faster than the fused head (see
    params_want_fused): "auto" keeps the plain head then, and the fused one where it is missing."""
    filtered = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95).with_defaults(None)]
    plain = [SamplingParams(temperature=0.8).with_defaults(None)]
    if sample.kernel() is not None:
        assert not params_want_fused("auto", filtered)
    assert params_want_fused(True, filtered) and not params_want_fused(False, filtered)
    monkeypatch.setattr(sample, "kernel", lambda: None)
    assert params_want_fused("auto", filtered) and not params_want_fused("auto", plain)


def test_top_p_one_row_keeps_far_tail_next_to_a_filtered_row(monkeypatch):
    """As test_sampling.py's test of the same name, on the fused head's candidate filter: a row
    with top_p = 1 (and a min_p that keeps its tail) shares the batch with a top_p = 0.5 row. The race
    is replaced by "pick the lowest-ranked kept candidate", so the pick shows whether the tail survived."""
    import sluice.engine.fused_head as fh

    def last_kept(x, rows, generators):
        return x.isfinite().sum(-1) - 1  # candidates are sorted by value, so this is the lowest kept
    monkeypatch.setattr(fh, "_race", last_kept)
    n = 64
    z = torch.full((2, n), -30.0)
    z[:, 5] = 0.0  # the top token
    z[:, 40] = -29.0  # the best of the tail: the last kept candidate is among the -30s after it
    params = [SamplingParams(top_p=0.5, seed=1), SamplingParams(top_p=1.0, min_p=1e-30, seed=2)]
    out = FusedHead(Sampler(params, n), chunk=16, candidates=n)(z, torch.eye(n))
    assert not out.fallback.any()
    assert out.tokens[0] == 5  # top_p 0.5 keeps only the top token
    assert out.tokens[1] not in (5, 40) and z[1, out.tokens[1]] == -30.0  # the far tail was kept


def test_seeded_filtered_rows_draw_the_plain_samplers_tokens():
    """With counter-based noise (engine/noise.py) a token's noise at a draw is the same on every path, so
    the fused head's candidate race picks the plain Sampler's token for the same seed, step after step."""
    V, C, B = 3000, 24, 6
    g = torch.Generator().manual_seed(4)
    w, h = torch.randn(V, C, generator=g), torch.randn(B, C, generator=g) * 2
    params = [SamplingParams(temperature=[0.7, 1.0, 1.3][i % 3], top_k=[5, 40, 200][i % 3], top_p=[1.0, 0.9][i % 2],
                             seed=100 + i) for i in range(B)]
    plain, fused = Sampler(params, V), FusedHead(Sampler(params, V))
    for step in range(20):
        x = h + 0.3 * step
        want, got = plain(F.linear(x, w)), fused(x, w).tokens
        assert torch.equal(got, want), step
