"""engine/accept.py: the acceptance rule's native call keeps the same guesses and draws the same final
token as the torch rule (speculative.accept), and leaves the streams at the same positions, over random
target and draft laws (filtered as sampling filters them: top_k, top_p, min_p, temperature, ties), greedy
rows among sampled ones, point-mass proposals and rounding-made empty residuals; a NaN defers."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from avx2_build import run_avx2_build
from sluice.engine import accept as accept_kernel
from sluice.engine.native.build import cpu_flags
from sluice.engine.noise import RowStream
from sluice.engine.sampling import SamplingParams, filtered_probs
from sluice.engine.speculative import accept, draw

pytestmark = pytest.mark.skipif(accept_kernel.why_unavailable() is not None,
                                reason="needs sluice's speculative acceptance kernel")


def both(p, q, draft, lengths, rows, seeds):
    """(n, final, stream positions) from the kernel and from the torch rule, each on fresh streams."""
    out = []
    for native in (True, False):
        streams = [RowStream(s) for s in seeds]
        saved = accept_kernel.kernel
        if not native:
            accept_kernel.kernel = lambda: None
        try:
            calls = accept_kernel.STATS["calls"]
            n, final = accept(p, q, draft, lengths, rows, streams)
            if native:
                assert accept_kernel.STATS["calls"] > calls
        finally:
            accept_kernel.kernel = saved
        out.append((n.tolist(), final.tolist(), [s.draws for s in streams]))
    return out


def laws(B: int, positions: int, V: int, params: list[SamplingParams], kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B * positions, V, generator=g) * {"narrow": 0.5, "wide": 4.0, "ties": 2.0}[kind]
    if kind == "ties":
        x = (x * 2).round() / 2
    rows = [p for p in params for _ in range(positions)]
    return filtered_probs(x, rows).view(B, positions, V)


param = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.3, 0.8, 1.0, 2.0]),
                  top_k=st.sampled_from([0, 1, 3, 40]), top_p=st.sampled_from([1.0, 0.95, 0.5]),
                  min_p=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**40))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), V=st.sampled_from([2, 7, 300, 8192 + 5]), B=st.integers(1, 6), K=st.integers(1, 5),
       kind=st.sampled_from(["narrow", "wide", "ties"]), point=st.booleans(), seed=st.integers(0, 10_000))
def test_the_native_rule_equals_the_torch_rule(data, V, B, K, kind, point, seed):
    params = [data.draw(param) for _ in range(B)]
    p = laws(B, K + 1, V, params, kind, seed)
    q = laws(B, K, V, params, kind, seed + 1)
    # Guesses drawn from q (from argmax-ish picks on greedy rows), so some are kept and some rejected.
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q.reshape(B * K, V), 1, generator=g).view(B, K)
    lengths = [data.draw(st.integers(1, K)) for _ in range(B)]
    rows = [i for i, sp in enumerate(params) if sp.temperature > 0]
    native, reference = both(p, None if point else q, draft, lengths, rows, [sp.seed for sp in params])
    assert native == reference


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), V=st.sampled_from([1, 7, 300, 8192 + 5]), B=st.integers(1, 6),
       kind=st.sampled_from(["narrow", "wide", "ties"]), seed=st.integers(0, 10_000))
def test_the_native_draw_equals_the_torch_draw(data, V, B, kind, seed):
    """speculative.draw (the draft's guesses): the same tokens and stream positions, greedy rows included."""
    params = [data.draw(param) for _ in range(B)]
    probs = laws(B, 1, V, params, kind, seed)[:, 0]
    rows = [i for i, sp in enumerate(params) if sp.temperature > 0]
    out = []
    for native in (True, False):
        streams = [RowStream(sp.seed) for sp in params]
        saved = accept_kernel.kernel
        if not native:
            accept_kernel.kernel = lambda: None
        try:
            out.append((draw(probs, rows, streams).tolist(), [s.draws for s in streams]))
        finally:
            accept_kernel.kernel = saved
    assert out[0] == out[1]


def test_a_draft_equal_to_the_target_keeps_every_guess_and_a_forced_rejection_uses_the_residual():
    """q == p keeps every guess (u < 1); a guess where p is 0 is rejected and the residual (p - q)+ is
    all zeros there by rounding on rows where p == q elsewhere: then p itself is drawn, in both."""
    V, K = 50, 3
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(4)]
    p = laws(4, K + 1, V, params, "wide", 0)
    q = p[:, :K].clone()
    draft = p[:, :K].argmax(-1)
    native, reference = both(p, q, draft, [K] * 4, [0, 1, 2, 3], [0, 1, 2, 3])
    assert native == reference and native[0] == [K] * 4
    p[:, 0, :] = torch.nn.functional.one_hot(torch.tensor(7), V).float()  # p(x) = 0 for any guess but 7
    q[:, 0] = p[:, 0]
    draft[:, 0] = 8
    native, reference = both(p, q, draft, [K] * 4, [0, 1, 2, 3], [0, 1, 2, 3])
    assert native == reference and native[0] == [0] * 4 and native[1] == [7] * 4


def test_a_nan_defers_to_the_torch_rule():
    V, K = 40, 2
    params = [SamplingParams(temperature=0.8, seed=1)]
    p = laws(1, K + 1, V, params, "wide", 3)
    q = laws(1, K, V, params, "wide", 4)
    p[0, 0, 5] = math.nan
    fallback = accept_kernel.STATS["fallback"]
    native, reference = both(p, q, p[:, :K].argmax(-1) * 0 + 5, [K], [0], [1])
    assert accept_kernel.STATS["fallback"] > fallback  # the rule, and the draw inside the torch rule
    assert native == reference


def test_the_kernel_decides_almost_every_round():
    """Its bound is tight enough to be useful: 40 rounds of 4 rows on 8,192-token laws, under a tenth
    handed to the torch rule."""
    V, K, B = 8192, 4, 4
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s) for s in range(B)]
    calls, fallback = accept_kernel.STATS["calls"], accept_kernel.STATS["fallback"]
    streams = [RowStream(s) for s in range(B)]
    for t in range(40):
        p = laws(B, K + 1, V, params, "wide", t)
        q = laws(B, K, V, params, "wide", t + 1000)
        accept(p, q, p[:, :K].argmax(-1), [K] * B, list(range(B)), streams)
    assert accept_kernel.STATS["calls"] - calls == 40
    assert accept_kernel.STATS["fallback"] - fallback < 4


@pytest.mark.slow
def test_the_avx2_build_decides_the_same_on_an_avx512_cpu():
    """accept.cpp built as an AVX2-only CPU builds it (SLUICE_KERNEL_FLAGS=-mno-avx512f, about a minute)
    passes the tests above in a subprocess."""
    if "avx512f" in cpu_flags() and not os.environ.get("SLUICE_KERNEL_FLAGS"):
        assert accept_kernel.kernel().has_avx512()
    run_avx2_build("accept", __file__, "not avx2")


@pytest.mark.parametrize("V", [1, 15, 16, 17, 300, 8192 + 5])
def test_a_greedy_guess_is_the_first_argmax_and_a_nonfinite_logit_defers(V):
    """The greedy rows of a draft guess (propose at temperature 0; the draw of a one-hot row): the first index
    of the largest logit, as torch.argmax gives it, wherever the ties sit (the same 16- or 8-lane block, two
    blocks, the scalar tail, +0 against -0); a NaN or an inf anywhere in a row defers the call."""
    g = torch.Generator().manual_seed(V)
    rows = [torch.randn(V, generator=g) for _ in range(6)]
    if V > 1:
        rows[1][V - 1] = rows[1].max() + 1  # the largest in the last lane (the tail where V is not a multiple of 16)
        rows[2][[V // 3, V - 1]] = rows[2].max() + 1  # a tie: the earlier one
        rows[3][:] = 0.0
        rows[3][V // 2:] = -0.0  # +0 and -0 are equal: the first index
        rows[4][[0, V // 2]] = rows[4].max() + 1
        rows[5][[min(16, V - 1), min(17, V - 1)]] = rows[5].max() + 1
    x = torch.stack(rows)
    streams = [RowStream(s) for s in range(len(rows))]
    out = accept_kernel.propose(x, torch.zeros(len(rows)), [], streams)
    assert out is not None
    q, tokens = out
    assert tokens.tolist() == x.argmax(-1).tolist()
    assert torch.equal(q, torch.nn.functional.one_hot(x.argmax(-1), V).float())
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[len(rows) - 1, V // 2] = bad
        assert accept_kernel.propose(y, torch.zeros(len(rows)), [], streams) is None
    # the draw's greedy rows over rows that hold an inf: the first of them (the scalar walk's answer)
    z = x.clone()
    z[0, V - 1] = math.inf
    z[0, 0] = -math.inf
    assert accept_kernel.draw(z, [], streams).tolist() == [V - 1] + x[1:].argmax(-1).tolist()


def test_accept_rows_names_a_malformed_round():
    """verify()'s call (accept_rows) checks its lists before it reads a row: a row of the wrong length, a guess
    outside the vocabulary, a q with too few rows or a list of the wrong length is an error that names it."""
    kern = accept_kernel.kernel()
    x, q = torch.randn(3, 20), torch.softmax(torch.randn(2, 20), -1)

    def call(logits=(x,), qs=(q,), guesses=((1, 2),), n=1):
        return kern.accept_rows(list(logits), list(qs), [list(g) for g in guesses], [True] * n, [0.8] * n, [0.9] * n,
                                [7] * n, [0] * n, accept_kernel.LANES or 16)
    n, final, deferred = call()
    assert not deferred and 0 <= n[0] <= 2 and 0 <= final[0] < 20
    with pytest.raises(RuntimeError, match=r"logits\[0\] must be a contiguous \(2, 20\)"):
        call(guesses=((1,),))
    with pytest.raises(RuntimeError, match="a guess outside the vocabulary"):
        call(guesses=((1, 20),))
    with pytest.raises(RuntimeError, match=r"q\[0\] must be a contiguous \(>= 2, 20\)"):
        call(qs=(q[:1],))
    with pytest.raises(RuntimeError, match="one entry a row in every list"):
        call(n=2)
    with pytest.raises(RuntimeError, match=r"logits\[0\] must be a contiguous"):
        call(logits=(x.t().contiguous().t(),))


def test_accept_rows_leaves_rows_off_the_cpu_to_the_torch_rule():
    """Rows on another device (here "meta") are not the kernel's: None, and no stream moves."""
    streams = [RowStream(1)]
    x = torch.empty(3, 20, device="meta")
    assert accept_kernel.accept_rows([x], None, [[1, 2]], [True], [0.8], [0.9], streams) is None
    assert streams[0].draws == 0
