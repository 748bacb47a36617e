"""engine/sample.py with top_p and top_k off: the native step cuts where a bound on torch's softmax sum proves
the cut (native/top_p_cut.h, tested on its own in test_sample_top_p_cut.py), or else reproduces torch's softmax
bit for bit (native/torch_softmax.h) and sorts only the head of the row, so its cut is the torch path's exactly, and so
are the tokens, the penalty state and the streams; steps are handed to the torch path only where the race
itself is too close to call (rare), or where the lane count of torch's kernels is unknown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from avx2_build import run_avx2_build
from sluice.engine import sample
from sluice.engine.sampling import SamplingParams
from test_sample_native import assert_same, logits, run

pytestmark = pytest.mark.skipif(sample.why_unavailable() is not None, reason="needs sluice's batch sampling kernel")

TOP_P = [1e-6, 0.1, 0.5, 0.9, 0.95, 0.999, 0.9999999]


def rows(B: int, T: float, seed: int, **extra) -> list[SamplingParams]:
    return [SamplingParams(temperature=T, top_p=TOP_P[(seed + i) % len(TOP_P)], seed=seed * 100 + i, **extra)
            for i in range(B)]


def drawn_natively(params, V, steps, context=None) -> int:
    """assert_same, and how many of the steps the native call decided itself."""
    calls, fallback = sample.STATS["calls"], sample.STATS["fallback"]
    assert_same(params, V, steps, context)
    # run() calls the kernel once a step on the native side only (the torch side has it switched off)
    return (sample.STATS["calls"] - calls) - (sample.STATS["fallback"] - fallback)


@pytest.mark.parametrize("V", [1, 7, 16, 50, 1003, 8192 + 5])
@pytest.mark.parametrize("kind", ["narrow", "wide", "ties", "huge"])
@pytest.mark.parametrize("T", [0.01, 0.8, 2.0])
def test_top_p_alone_is_native_and_draws_torchs_tokens(V, kind, T):
    for seed in range(3):
        params = rows(4, T, seed)
        steps = [logits(kind, 4, V, 10 * seed + t) for t in range(3)]
        assert drawn_natively(params, V, steps) >= 2  # a race too close to call may still defer a step


@pytest.mark.parametrize("kind", ["wide", "ties"])
def test_top_p_with_min_p_and_penalties_is_native_and_exact(kind):
    V = 4099
    params = rows(6, 0.9, 1, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    steps = [logits(kind, 6, V, t) for t in range(6)]
    assert drawn_natively(params, V, steps, context={0: list(range(0, V, 5)), 3: [1, 2, 3]}) >= 5


def test_a_batch_mixing_top_p_rows_with_top_k_and_greedy_rows_draws_torchs_tokens():
    """The torch path sorts every row in full once one row has top_k off; its probabilities are the same."""
    V = 2000
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.02, seed=2),
              SamplingParams(temperature=1.2, top_p=0.999, seed=3, repetition_penalty=1.1)]
    assert drawn_natively(params, V, [logits("wide", 4, V, t) for t in range(8)], context={3: [5, 6]}) >= 7


def test_qwen_vocabulary():
    V = 151936
    for T in (0.7, 1.0):
        assert drawn_natively(rows(3, T, 5), V, [logits("wide", 3, V, t) for t in range(2)]) >= 1


def test_a_cut_that_falls_on_ties_is_torchs():
    """Equal probabilities around the cut: the stable order (ids ascending) decides which are kept."""
    V = 300
    x = torch.full((1, V), -5.0)
    x[0, ::7] = 2.0  # 43 equal top tokens: each 1/43 of ~all the mass
    for top_p in (0.1, 0.5, 3 / 43, 0.9):
        for seed in range(10):
            params = [SamplingParams(temperature=1.0, top_p=top_p, seed=seed)]
            assert drawn_natively(params, V, [x]) == 1


def test_unknown_torch_lanes_defer_to_the_torch_path(monkeypatch):
    monkeypatch.setattr(sample, "LANES", 0)
    assert drawn_natively(rows(2, 0.8, 0), 500, [logits("wide", 2, 500, t) for t in range(3)]) == 0


@pytest.mark.slow
def test_torchs_avx2_softmax_is_reproduced_too():
    """Under ATEN_CPU_CAPABILITY=avx2 (an AVX2-only CPU's kernels) torch's softmax sums in 8 lanes, not 16."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("torch already runs its AVX2 kernels here: the tests above check them")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    r = subprocess.run([sys.executable, "-c", "from sluice.engine import sample; assert sample.LANES == 8"], env=env)
    assert r.returncode == 0
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "not avx2 and not qwen"], env=env, capture_output=True, text=True, timeout=1800,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
def test_the_avx2_build_draws_top_p_the_same_on_an_avx512_cpu():
    run_avx2_build("sample", __file__, "not avx2 and not qwen")


def test_a_top_p_exactly_on_torchs_cumulative_mass_cuts_where_torch_does():
    """top_p set to torch's own fp32 mass before a token (and one ulp above it): one ulp of difference in the
    softmax sum would move the cut by that token, so only the same bits give the same draws."""
    V = 4099
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, V, generator=g) * 2
    x[0, [10, 20, 30, 40]] = torch.tensor([8.0, 7.9, 7.8, 7.7])  # four tokens of ~a fifth of the mass each
    scaled = x - x.amax(-1, keepdim=True)
    probs = scaled.sort(dim=-1, descending=True, stable=True)[0].softmax(-1)
    mass_before = probs.cumsum(-1)[0]
    for j in (1, 2, 3):
        at = mass_before[j - 1]
        for top_p in (at, torch.nextafter(at, torch.tensor(1.0))):
            params = [SamplingParams(temperature=1.0, top_p=float(top_p), seed=s) for s in range(12)]
            assert drawn_natively(params, V, [x.expand(12, V).contiguous()]) == 1
