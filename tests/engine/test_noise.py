"""engine/noise.py, the counter-based draws every sampler uses: the native kernel against the numpy
definition bit for bit, pieces of a row against the whole row, and the draws' statistics."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare, kstest

from sluice.engine import noise, select
from sluice.engine.noise import ACCEPT, RACE, RowStream, exp_noise, uniforms_at, uniforms_range

native = pytest.mark.skipif(select.why_unavailable() is not None, reason="no native selection kernel here")


def streams(seeds, draws=0):
    out = [RowStream(s) for s in seeds]
    for s in out:
        s.draws = draws
    return out


@native
def test_native_uniforms_equal_the_numpy_definition():
    g = torch.Generator().manual_seed(0)
    rows = streams([0, 1, 2**63 + 5, 2**64 - 1, None, 123456789], draws=7)
    ids = torch.randint(0, 152_000, (len(rows), 300), generator=g)
    ids[0, :3] = torch.tensor([0, 2**40, 151_935])
    for domain in (RACE, ACCEPT):
        assert torch.equal(uniforms_at(rows, ids, domain), uniforms_at(rows, ids, domain, native=False))
        for start, n in [(0, 8192), (17, 1), (150_000, 1936), (5, 0)]:
            got = uniforms_range(rows, start, n, domain)
            assert got.shape == (len(rows), n)
            assert torch.equal(got, uniforms_range(rows, start, n, domain, native=False))


def test_a_piece_of_a_row_is_the_whole_rows_values():
    """The fused head's chunks, a tensor-parallel rank's shard and the top-k candidates all get the values
    the whole row has at those token ids, at the same draw."""
    rows = streams([3, 4, 5], draws=2)
    whole = uniforms_range(rows, 0, 5000)
    assert torch.equal(uniforms_range(rows, 1200, 800), whole[:, 1200:2000])
    ids = torch.tensor([[4999, 0, 17], [5, 5, 3000], [1, 2, 3]])
    assert torch.equal(uniforms_at(rows, ids), whole.gather(1, ids))


def test_draws_seeds_and_domains_give_new_values_and_a_seed_repeats():
    a, b = RowStream(11), RowStream(11)
    first = uniforms_range([a], 0, 64)
    assert torch.equal(first, uniforms_range([b], 0, 64))  # same seed, same draw
    a.advance()
    assert not torch.equal(first, uniforms_range([a], 0, 64))
    assert not torch.equal(first, uniforms_range([RowStream(12)], 0, 64))
    assert not torch.equal(first, uniforms_range([b], 0, 64, ACCEPT))
    assert RowStream(None).key != RowStream(None).key  # unseeded rows: fresh random keys


def test_uniforms_are_uniform_and_exp_noise_is_exponential():
    rows = streams(range(64))
    u = torch.cat([uniforms_range(rows, 0, 4096) for _ in range(1)] +
                  [uniforms_range(streams(range(64), draws=d), 0, 4096) for d in (1, 2)]).flatten()
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert torch.equal(u * 2**24, (u * 2**24).round())  # 24-bit values, exact in fp32
    counts = torch.histc(u, bins=64, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-4
    assert kstest(exp_noise(u[:20000]).double().numpy(), "expon").pvalue > 1e-4
    # neighbouring tokens, draws and seeds are uncorrelated
    grid = uniforms_range(rows, 0, 4096) - 0.5
    for x, y in [(grid[:, 1:], grid[:, :-1]), (grid[1:], grid[:-1]),
                 (grid, uniforms_range(streams(range(64), draws=1), 0, 4096) - 0.5)]:
        r = float((x * y).mean() / (x.std() * y.std()))
        assert abs(r) < 5 / math.sqrt(x.numel()), r


def test_the_race_with_this_noise_draws_p():
    """argmax(log p - log E) over 20,000 rows (seeds) picks each token with its probability."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    rows = streams(range(20000))
    e = exp_noise(uniforms_range(rows, 0, 5))
    picks = (p.log() - e.log()).argmax(-1)
    counts = torch.bincount(picks, minlength=5).double()
    assert chisquare(counts.numpy(), (p * 20000).double().numpy()).pvalue > 1e-4


def test_bases_are_int64_bits_of_the_uint64_definition():
    s = RowStream(2**64 - 1)
    b = s.base()
    assert -(2**63) <= b < 2**63
    want = noise._mix(((s.key ^ RACE) + GOLDEN_1) & noise.M64)
    assert b % 2**64 == want


GOLDEN_1 = noise.GOLDEN  # (draws + 1) * GOLDEN at draw 0
