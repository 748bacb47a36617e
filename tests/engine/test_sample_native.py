"""engine/sample.py: the batch sampler's native step draws exactly the torch path's tokens, and leaves the
same penalty state and stream positions, over random logits and param mixes (ties, extreme temperatures,
every filter, penalties, NaN / inf rows, greedy rows among sampled ones). Where it cannot prove torch's
decision it defers, and the torch path draws: the tokens are the same either way."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from avx2_build import run_avx2_build
from sluice.engine import sample
from sluice.engine.batch_sampling import BatchDraw, FullHead
from sluice.engine.native.build import cpu_flags
from sluice.engine.sampling import NONFINITE, Sampler, SamplingParams

pytestmark = pytest.mark.skipif(sample.why_unavailable() is not None, reason="needs sluice's batch sampling kernel")


def params_strategy(V: int):
    sampled = st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.01, 0.3, 0.8, 1.0, 2.0]),
        top_k=st.sampled_from([0, -1, 1, 2, 5, 40, max(1, V // 4), V - 1, V, V + 7]),
        top_p=st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.1]),
        min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=st.sampled_from([1.0, 1.0, 1.3]),
        presence_penalty=st.sampled_from([0.0, 0.0, 0.5, -0.5]),
        frequency_penalty=st.sampled_from([0.0, 0.0, 0.4]),
        seed=st.integers(0, 2**40),
    )
    greedy = st.builds(SamplingParams, temperature=st.just(0.0), repetition_penalty=st.sampled_from([1.0, 1.2]),
                       presence_penalty=st.sampled_from([0.0, 0.5]))
    return st.one_of(sampled, sampled, greedy)


def logits(kind: str, B: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * {"narrow": 0.5, "wide": 4.0, "ties": 2.0, "huge": 3e4}[kind]
    return (x * 2).round() / 2 if kind == "ties" else x  # halves: long runs of equal logits


def run(params: list[SamplingParams], V: int, steps: list[torch.Tensor], native: bool, context=None):
    """Each step's tokens, and the sampler's state after the last: seen, counts, stream positions."""
    s = Sampler(params, V)
    for row, ids in (context or {}).items():
        s.add_context(row, ids)
    saved = sample.kernel
    if not native:
        sample.kernel = lambda: None
    try:
        tokens = [s(x).tolist() for x in steps]
    finally:
        sample.kernel = saved
    return tokens, s.seen.clone(), None if s.counts is None else s.counts.clone(), [r.draws for r in s.streams]


def assert_same(params, V, steps, context=None):
    got = run(params, V, steps, True, context)
    want = run(params, V, steps, False, context)
    assert got[0] == want[0], [(p.temperature, p.top_k, p.top_p, p.min_p) for p in params]
    assert torch.equal(got[1], want[1])
    assert (got[2] is None) == (want[2] is None) and (got[2] is None or torch.equal(got[2], want[2]))
    assert got[3] == want[3]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), V=st.sampled_from([1, 7, 50, 301, 1000 + 3, 8192 + 5]), B=st.integers(1, 8),
       kind=st.sampled_from(["narrow", "wide", "ties", "huge"]), seed=st.integers(0, 10_000))
def test_the_native_draw_equals_the_torch_path(data, V, B, kind, seed):
    params = [data.draw(params_strategy(V)) for _ in range(B)]
    steps = [logits(kind, B, V, seed + t) for t in range(3)]
    context = {0: list(range(0, V, 3))}  # a prompt, for the repetition penalty
    assert_same(params, V, steps, context)


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_row_defers_and_draws_as_torch(poison):
    V = 1000
    params = [SamplingParams(temperature=0.8, top_k=40, seed=1, repetition_penalty=1.2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=2)]
    steps = [logits("wide", 3, V, t) for t in range(3)]
    steps[1][2, 17] = poison
    assert_same(params, V, steps)
    assert run(params, V, steps, True)[0][1][2] == NONFINITE


def test_a_penalty_that_overflows_a_finite_logit_defers():
    """A huge negative logit times the repetition penalty is -inf, though the raw row was finite."""
    V = 64
    x = logits("wide", 2, V, 0)
    x[:, 5] = -3e38
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.7, seed=3,
                                                                                     repetition_penalty=2.0)]
    before = sample.STATS["fallback"]
    assert_same(params, V, [x, x], context={0: [5], 1: [5]})
    assert sample.STATS["fallback"] > before


def test_a_top_p_cut_that_exact_arithmetic_and_torch_floats_place_differently_is_torchs():
    """Three equal top logits under top_p = 2/3: exactly, the mass before the third is 2/3, below fp32's
    2/3 (0.66666669), so the third token would be kept; torch's fp32 probabilities (0.33333334 each) put it
    at 0.66666669, not below, and drop it. The kernel must see that its margin proves nothing and defer."""
    V = 50
    x = torch.full((1, V), -20.0)
    x[0, [3, 8, 30]] = 1.0
    for seed in range(40):
        params = [SamplingParams(temperature=1.0, top_k=3, top_p=2 / 3, seed=seed)]
        assert_same(params, V, [x])
        assert run(params, V, [x], True)[0][0][0] in (3, 8)


def test_the_kernel_decides_almost_every_filtered_step():
    """The bounds are tight enough to be useful: on random logits, 8 rows with top_k, top_p, min_p and
    penalties, the native step hands under a tenth of its steps to the torch path."""
    V, B = 8192, 8
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                             presence_penalty=0.5, seed=i) for i in range(B)]
    s = Sampler(params, V)
    calls, fallback = sample.STATS["calls"], sample.STATS["fallback"]
    for t in range(100):
        s(logits("wide", B, V, t))
    assert sample.STATS["calls"] - calls == 100
    assert sample.STATS["fallback"] - fallback < 10


def test_a_joined_samplers_parts_share_its_penalty_state():
    """BatchDraw's joined sampler writes the drawn tokens straight into each sequence's own state."""
    class Seq:
        def __init__(self, i, sampler):
            self.id, self.sampler = i, sampler

    V = 300
    head = FullHead(V, torch.device("cpu"))
    seqs = [Seq(i, head.sampler(SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.3,
                                               frequency_penalty=0.2, seed=i))) for i in range(3)]
    draw = BatchDraw(head)
    for t in range(4):
        tokens = draw(seqs, logits("wide", 3, V, t)).tolist()
        for s, tok in zip(seqs, tokens, strict=True):
            assert s.sampler.seen[0, tok] and s.sampler.counts[0, tok] >= 1
    assert all(s.sampler.counts.sum() == 4 for s in seqs)


@pytest.mark.slow
def test_the_avx2_build_draws_the_same_on_an_avx512_cpu():
    """The AVX2 paths of sample.cpp (what an AVX2-only CPU runs) built with SLUICE_KERNEL_FLAGS=-mno-avx512f
    (about a minute) pass the tests above in a subprocess."""
    if "avx512f" in cpu_flags() and not os.environ.get("SLUICE_KERNEL_FLAGS"):
        assert sample.kernel().has_avx512()
    run_avx2_build("sample", __file__, "not avx2")
