"""The distributed sampler equals the full-vocabulary one, at 2 and 4 gloo ranks.

Every rank builds the same random logits, samples its shard with ParallelSampler, and also runs the
single-process Sampler on the whole row (cheap here), so each rank checks itself. Settings cover
every filter and penalty, alone and together, over many seeds and several steps (the penalties'
history is carried from step to step), on flat and peaked rows; plus ties across shards, a cut that
lands exactly on a rounding decision (the gathered fallback), log Z (with -inf shards), and a
chi-square test of many distributed draws against filtered_probs of the whole row.
"""

from __future__ import annotations

import pytest
import torch

from test_parallel_spawn import ok, run_ranks

pytestmark = pytest.mark.slow  # gloo ranks spawned, 2 and 4

V = 480  # 2 and 4 ranks: 240 / 120 columns each
SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.2, top_p=0.9),
    dict(temperature=0.9, top_p=0.5),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, top_k=40, top_p=0.8, min_p=0.02),
    dict(temperature=1.1, repetition_penalty=1.3, top_p=0.95),
    dict(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, min_p=0.1),
    dict(temperature=0.6, top_k=20, top_p=0.7, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.4,
         frequency_penalty=0.3),
    dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0),  # greedy, penalised
    dict(temperature=0.0),
]
STEPS, SEEDS = 6, 8


def _compare(ranks):
    from sluice import parallel as P
    from sluice.engine.sampling import SamplingParams, Sampler
    lo, hi = ranks.rank * V // ranks.world, (ranks.rank + 1) * V // ranks.world
    g = torch.Generator().manual_seed(123)
    same = total = 0
    mismatches = []
    for scale in (0.3, 2.0, 6.0):  # flat (the nucleus reaches far down) to peaked
        params = [SamplingParams(**s, seed=1000 * i + j) for i, s in enumerate(SETTINGS) for j in range(SEEDS)]
        tp, single = P.ParallelSampler(params, V, lo, hi), Sampler(params, V)
        for b in range(len(params)):  # a prompt for the repetition penalty
            prompt = torch.randint(0, V, (12,), generator=g).tolist()
            tp.add_context(b, prompt)
            single.add_context(b, prompt)
        for step in range(STEPS):
            x = scale * torch.randn(len(params), V, generator=g)
            a, b = tp(x[:, lo:hi]), single(x)
            same += int((a == b).sum())
            total += len(params)
            mismatches += [(scale, step, r) for r in (a != b).nonzero()[:, 0].tolist()]
    # joined() over one-row samplers, as the scheduler calls it, equals one sampler over all rows
    rows = [P.ParallelSampler([SamplingParams(**s, seed=7 + i)], V, lo, hi) for i, s in enumerate(SETTINGS)]
    whole = Sampler([SamplingParams(**s, seed=7 + i) for i, s in enumerate(SETTINGS)], V)
    joined_same = True
    for _ in range(3):
        x = 2 * torch.randn(len(SETTINGS), V, generator=g)
        j = P.ParallelSampler.joined(rows)
        a = j(x[:, lo:hi])
        j.write_back()
        joined_same &= torch.equal(a, whole(x))
    # a real vocabulary's width (Qwen's), where flat rows put many prefix masses near the cut
    big = 151936
    blo, bhi = ranks.rank * big // ranks.world, (ranks.rank + 1) * big // ranks.world
    params = [SamplingParams(temperature=1.0, seed=s, **f) for s, f in enumerate(
        [dict(top_p=0.9), dict(top_p=0.95, top_k=50), dict(min_p=0.05), dict(top_p=0.7, min_p=0.01)])]
    tp, single = P.ParallelSampler(params, big, blo, bhi), Sampler(params, big)
    for scale in (1.0, 3.0, 8.0):
        x = scale * torch.randn(len(params), big, generator=g)
        a, b = tp(x[:, blo:bhi]), single(x)
        same += int((a == b).sum())
        total += len(params)
        mismatches += [("big", scale, r) for r in (a != b).nonzero()[:, 0].tolist()]
    return dict(same=same, total=total, mismatches=mismatches[:10], joined=joined_same)


def _edges(ranks):
    """Ties across shards, a top_p cut exactly on a mass boundary, a min_p cut on a ratio, log Z."""
    from sluice import parallel as P
    from sluice.engine.sampling import SamplingParams, Sampler
    lo, hi = ranks.rank * V // ranks.world, (ranks.rank + 1) * V // ranks.world
    x = torch.full((4, V), -5.0)
    x[0] = -30.0  # the rest too small to matter in fp32: the leaders' masses are 0, 1/4, 1/2, 3/4
    x[0, [7, V // 2 + 3, V - 1, 130]] = 3.0  # four equal leaders on different ranks: top_p=0.5 keeps exactly 2
    x[1, [V - 2, 1, V // 3]] = 2.0
    x[2, :] = 0.0  # flat: every mass boundary is a multiple of 1/V
    x[3, 0] = 1.0
    x[3, 1] = 1.0 + torch.log(torch.tensor(0.25)).item()  # p_1 / p_0 = 0.25 = min_p: a ratio on the cut
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=s) for s in range(3)] + [
        SamplingParams(temperature=1.0, min_p=0.25, seed=9)]
    draws = []
    for rep in range(20):
        tp = P.ParallelSampler(params, V, lo, hi)
        single = Sampler(params, V)
        for p, sp in ((tp, params), (single, params)):
            for i, q in enumerate(sp):
                p.set_row(i, SamplingParams(**{**q.__dict__, "seed": 100 * rep + i}))
        draws.append((tp(x[:, lo:hi]).tolist(), single(x).tolist()))
    wide = 40 * torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    wide[0, :V // ranks.world] = -float("inf")  # rank 0's shard all -inf
    wide[1, :V // 2] = -float("inf")  # half the ranks' shards
    rel = ((P.log_z(wide[:, lo:hi]) - wide.logsumexp(-1)).abs() / wide.logsumexp(-1).abs()).max().item()
    empty = P.log_z(torch.full((1, hi - lo), -float("inf"))).item()
    return dict(draws=draws, log_z=rel, empty=empty)


def _chi_square(ranks, settings):
    """Many distributed draws from one row; counts per token."""
    from sluice import parallel as P
    from sluice.engine.sampling import SamplingParams, filtered_probs
    lo, hi = ranks.rank * V // ranks.world, (ranks.rank + 1) * V // ranks.world
    x = 2.5 * torch.randn(V, generator=torch.Generator().manual_seed(11))
    out = []
    for s in settings:
        B, steps = 400, 25
        sampler = P.ParallelSampler([SamplingParams(**s, seed=50_000 + b) for b in range(B)], V, lo, hi)
        counts = torch.zeros(V)
        for _ in range(steps):
            counts += torch.bincount(sampler(x.expand(B, V)[:, lo:hi].contiguous()), minlength=V).float()
        out.append((counts, filtered_probs(x, SamplingParams(**s))))
    return out


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    return request.param


def test_tokens_equal_the_single_process_sampler(tmp_path, world):
    for res in ok(run_ranks(tmp_path, world, _compare)):
        print(f"world={world}: {res['same']}/{res['total']} identical; first mismatches {res['mismatches']}")
        assert res["same"] == res["total"] and res["joined"]


def test_ties_rounding_cuts_and_log_z(tmp_path, world):
    results = ok(run_ranks(tmp_path, world, _edges))
    for res in results:
        assert all(tp == single for tp, single in res["draws"]), res["draws"]
        assert res["draws"] == results[0]["draws"]
        assert res["log_z"] < 1e-6 and res["empty"] == -float("inf")
    kept = {t for tp, _ in results[0]["draws"] for t in tp[:1]}
    assert kept == {7, 130}  # top_p 0.5 of four equal leaders: the two lowest ids, each drawn


CHI_SETTINGS = [dict(temperature=1.0), dict(temperature=0.8, top_k=60, top_p=0.85, min_p=0.01)]


def test_chi_square_of_distributed_draws_against_the_softmax(tmp_path):
    (res, *_) = ok(run_ranks(tmp_path, 2, _chi_square, CHI_SETTINGS))
    for (counts, probs), s in zip(res, CHI_SETTINGS, strict=True):
        n = counts.sum()
        assert counts[probs == 0].sum() == 0, "a filtered token was drawn"
        expected = n * probs.double()
        big = expected >= 5  # pool the rare tokens into one bin, so every bin expects >= 5
        obs = torch.cat((counts.double()[big], counts.double()[~big].sum()[None]))
        exp = torch.cat((expected[big], expected[~big].sum()[None]))
        obs, exp = obs[exp > 0], exp[exp > 0]
        chi2 = ((obs - exp) ** 2 / exp).sum()
        dof = len(obs) - 1
        p = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2).item()
        print(f"{s}: {int(n)} draws, {dof} dof, chi2={chi2.item():.1f}, p={p:.3f}")
        assert p > 1e-3  # fixed seeds: deterministic; a wrong distribution gives p ~ 0 at this sample size
