"""engine/select.py: the sampler's row scans (select.cpp) give exactly what the torch versions give."""

import math

import pytest
import torch

from avx2_build import run_avx2_build
from sluice.engine import select
from sluice.engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.skipif(select.why_unavailable() is not None, reason="needs sluice's selection kernel")


def rows(kind: str, B: int, V: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct values: every selection meets long runs of equal ones
        return torch.randint(-3, 4, (B, V), generator=g).float()
    return torch.randn(B, V, generator=g) * 4


@pytest.mark.parametrize("V", [1, 7, 16, 17, 300, 8192 + 5])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_argmax_rows_equals_torch(V, kind):
    x = rows(kind, 6, V, seed=V)
    ids, bad = select.argmax_rows(x)
    assert torch.equal(ids, x.argmax(-1)) and not bad.any()
    assert ids.dtype == torch.int64 and bad.dtype == torch.bool


@pytest.mark.parametrize("at", [0, 15, 16, 4000, 8192, 8192 + 4])  # vector part, its edges, the scalar tail
def test_argmax_rows_finds_the_first_of_equal_maxima(at):
    """The max held at `at` and at every later 1000th token, a -0.0 and +0.0 max in another row: torch.argmax
    gives the first (-0.0 == +0.0), and so must the vectorised search for it."""
    x = rows("random", 2, 8192 + 5, seed=2) - 100
    x[0, at::1000] = 50.0
    x[1, at] = -0.0
    x[1, at + 1:] = 0.0
    ids, bad = select.argmax_rows(x)
    assert ids.tolist() == x.argmax(-1).tolist() == [at, at] and not bad.any()


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("at", [0, 5, 8192 + 4])  # in the vector part and in the scalar tail
def test_argmax_rows_flags_nan_and_inf_rows_only(poison, at):
    x = rows("random", 4, 8192 + 5, seed=1)
    x[2, at] = poison
    ids, bad = select.argmax_rows(x)
    assert bad.tolist() == [False, False, True, False]
    assert torch.equal(bad, select.nonfinite_rows(x))
    keep = [0, 1, 3]
    assert torch.equal(ids[keep], x[keep].argmax(-1))


@pytest.mark.parametrize("V,k", [(300, 1), (8192, 40), (8192 + 3, 97), (50, 49)])
def test_top_candidates_equal_topk_on_distinct_values(V, k):
    x = rows("random", 5, V, seed=k)
    got = select.top_candidates(x, k)
    want = select.top_candidates(x, k, native=False)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("V,k", [(300, 3), (8192, 40), (1000 + 3, 97)])
def test_top_candidates_are_the_stable_sorts_prefix_on_ties(V, k):
    x = rows("ties", 5, V, seed=k)
    values, ids, after = select.top_candidates(x, k)
    full, order = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, full[:, :k]) and torch.equal(ids, order[:, :k]) and torch.equal(after, full[:, k])


def test_top_candidates_refuses_a_bad_k():
    with pytest.raises(RuntimeError, match="k = 5"):
        select.top_candidates(torch.zeros(2, 5), 5)


def poisoned(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with NaNs of both signs, infinities and negative zeros sprinkled in."""
    m = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed))
    x = x.clone()
    for lo, value in [(0.0, math.nan), (0.04, -math.nan), (0.08, math.inf), (0.12, -math.inf), (0.16, -0.0),
                      (0.2, 0.0)]:
        x[(m >= lo) & (m < lo + 0.04)] = value
    return x


@pytest.mark.parametrize("V", [1, 2, 17, 300, 2048 + 1, 8192 + 5])
@pytest.mark.parametrize("kind", ["random", "ties", "poisoned"])
def test_sort_descending_is_torchs_stable_sort_bit_for_bit(V, kind):
    """Ties keep id order; -0.0 and 0.0 tie (and keep their bits); NaNs of either sign rank first."""
    x = rows("random" if kind == "random" else "ties", 5, V, seed=V)
    if kind == "poisoned":
        x = poisoned(x, V)
    values, ids = select.sort_descending(x)
    want_values, want_ids = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(ids, want_ids)
    assert torch.equal(values.view(torch.int32), want_values.view(torch.int32))  # NaN and -0.0 bits too


def test_sort_descending_takes_a_row_in_one_bucket_and_a_view():
    """Every key sharing a digit skips that pass; a non-contiguous input sorts as its copy would."""
    same = torch.full((3, 100), 2.5)
    assert torch.equal(select.sort_descending(same)[1], torch.arange(100).expand(3, 100))
    x = rows("ties", 40, 64, seed=3).t()
    assert torch.equal(select.sort_descending(x)[1], x.sort(dim=-1, descending=True, stable=True)[1])


def test_the_sampler_draws_the_same_with_and_without_the_kernel(monkeypatch):
    """Tie-heavy logits, greedy and sampled rows, top_k of different sizes with top_p and min_p,
    a penalty: 30 steps give the same tokens through select.cpp and through torch's argmax / topk."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=5, seed=1),
              SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, top_k=12, min_p=0.1, seed=3, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=4)]  # top_k off: the whole row sorted

    def run():
        s = Sampler(params, 2000)
        return [s(rows("ties", len(params), 2000, seed=t) + 0.25 * rows("random", len(params), 2000, seed=t)
                  ).tolist() for t in range(30)]

    native = run()
    monkeypatch.setattr(select, "_kernel", lambda x: None)
    assert run() == native


@pytest.mark.slow
def test_the_avx2_build_selects_the_same_on_an_avx512_cpu():
    """select.cpp's AVX2 paths (an AVX2-only CPU's build) pass the tests above in a subprocess."""
    run_avx2_build("select", __file__, "not avx2")
