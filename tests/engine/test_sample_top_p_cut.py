"""native/top_p_cut.h: top_p with top_k off cut without sorting the row. It brackets torch's softmax sum,
cuts at both ends of the bracket and takes the cut only where the two agree; elsewhere the kernel sorts the
head of the row as before. Every draw here is compared with the torch path's, bit for bit, and the kernel's
counters say which of the two ways each row went, so both are known to run."""

from __future__ import annotations

import pytest
import torch

from avx2_build import run_avx2_build
from sluice.engine import sample
from sluice.engine.sampling import SamplingParams
from test_sample_native import assert_same, logits

pytestmark = pytest.mark.skipif(sample.why_unavailable() is not None, reason="needs sluice's batch sampling kernel")


def cut_rows(params, V, steps, context=None, moving: bool = False) -> tuple[int, ...]:
    """assert_same, and how many rows the kernel cut without a sort and how many it sorted (moving: and how
    many it drew from a cut proven to within a few tokens; without it those count as cut)."""
    before = sample.kernel().top_p_rows()
    assert_same(params, V, steps, context)
    bounded, sorted_, moved = (a - b for a, b in zip(sample.kernel().top_p_rows(), before, strict=True))
    return (bounded, sorted_, moved) if moving else (bounded + moved, sorted_)


@pytest.mark.parametrize("V", [1, 7, 16, 50, 1003, 8192 + 5])
@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.95, 0.999, 0.9999999])
@pytest.mark.parametrize("kind", ["narrow", "wide", "ties"])
def test_draws_are_torchs_for_every_top_p_and_row_shape(V, top_p, kind):
    for seed in range(2):
        params = [SamplingParams(temperature=T, top_p=top_p, seed=10 * seed + i) for i, T in enumerate((0.05, 0.8, 1.0, 1.7))]
        cut_rows(params, V, [logits(kind, 4, V, 7 * seed + t) for t in range(3)])


def test_peaked_rows_are_cut_without_a_sort():
    """Logits like a model's (a few tokens hold most of the mass): the bracket of the sum is far narrower than
    the mass of a token at the cut, so no row needs the sort."""
    V = 8192
    params = [SamplingParams(temperature=0.8, top_p=p, seed=i) for i, p in enumerate((0.5, 0.8, 0.9, 0.9))]
    bounded, sorted_ = cut_rows(params, V, [logits("wide", 4, V, t) for t in range(6)])
    assert bounded >= 22 and sorted_ <= 2


def test_flat_rows_near_top_p_one_draw_from_a_moving_cut_or_sort():
    """8,192 nearly equal probabilities and top_p 0.999: a token at the cut holds ~1e-4 of the mass, within
    the bracket of torch's sum (~3e-5 of it), so the cut is proven only to within a token or two. A draw whose
    winner every such cut keeps stands; the others sort the row. Same tokens either way."""
    V = 8192
    params = [SamplingParams(temperature=1.0, top_p=0.999, seed=i) for i in range(4)]
    bounded, sorted_, moving = cut_rows(params, V, [logits("narrow", 4, V, t) for t in range(3)], moving=True)
    assert bounded == 0 and moving >= 8 and moving + sorted_ >= 12


@pytest.mark.parametrize("above", [False, True])
def test_a_winner_the_cut_may_drop_is_drawn_again_after_the_exact_cut(above):
    """64 equal logits and top_p = 0.5 (torch keeps 32: the mass before the 33rd is 0.5, not below it) or one
    ulp above (torch keeps 33): the bracket of the sum cannot tell the two apart, so the 33rd token is
    uncertain. Where the race picks it (~1 draw in 33), the row is sorted and raced again; 128 draws in all,
    each torch's."""
    V = 64
    top_p = float(torch.nextafter(torch.tensor(0.5), torch.tensor(1.0))) if above else 0.5
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(64)]
    bounded, sorted_, moving = cut_rows(params, V, [torch.zeros(64, V)] * 2, moving=True)
    assert bounded == 0 and moving == 128 and sorted_ >= 1


def test_a_top_p_exactly_on_torchs_mass_is_cut_where_torch_cuts():
    """top_p equal to torch's own fp32 mass before a token: only the exact sum can say which side of it the
    token falls, so the bracket cannot decide, and one ulp above it, neither. The third token is uncertain:
    draws it wins go to the sort (a third of the mass: some of these 8 seeds), the rest stand."""
    V = 4099
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, V, generator=g) * 2
    x[0, [11, 22, 33]] = torch.tensor([8.0, 7.9, 7.8])
    probs = (x - x.amax(-1, keepdim=True)).sort(dim=-1, descending=True, stable=True)[0].softmax(-1)
    at = probs.cumsum(-1)[0, 1]
    for top_p in (at, torch.nextafter(at, torch.tensor(1.0))):
        params = [SamplingParams(temperature=1.0, top_p=float(top_p), seed=s) for s in range(8)]
        bounded, sorted_, moving = cut_rows(params, V, [x.expand(8, V).contiguous()], moving=True)
        assert bounded == 0 and moving == 8 and sorted_ >= 1


def test_ties_across_the_cut_keep_the_lowest_ids():
    """43 equal top tokens and top_p 0.5: the cut falls among them (no sort needed), and the stable order
    (ids ascending) decides which are kept: a race on one seed per kept set would show a wrong id."""
    V = 300
    x = torch.full((1, V), -5.0)
    x[0, ::7] = 2.0
    for top_p in (0.25, 0.5, 0.8):
        params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(16)]
        bounded, sorted_ = cut_rows(params, V, [x.expand(16, V).contiguous()] * 3)
        assert bounded == 48 and sorted_ == 0


@pytest.mark.parametrize(("V", "stride"), [(1000, 9), (3001, 20), (8192 + 5, 41)])  # 112-200 ties: the radix sort
def test_a_bracket_of_many_ties_keeps_the_lowest_ids(V, stride):
    """The cut among more tied tokens than the insertion sort takes (64): the radix sort orders the bracket,
    and a few scattered tokens just below the ties sit on either side of the row's vector part and tail."""
    x = torch.full((1, V), -6.0)
    x[0, ::stride] = 2.0
    x[0, 1::stride * 3] = 1.5
    x[0, V - 1] = 2.0  # a tied token in the scalar tail
    # Each tie holds 1/S of the mass: a top_p halfway between two multiples of it is proven for either lane
    # count (0.7 itself falls 0.01/S from one at V = 8197, inside the 8-lane bracket of S, and is sorted there).
    S = (x - 2.0).double().exp().sum().item()
    for top_p in ((int(0.3 * S) + 0.5) / S, (int(0.7 * S) + 0.5) / S):
        params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(8)]
        bounded, sorted_ = cut_rows(params, V, [x.expand(8, V).contiguous()] * 2)
        assert bounded == 16 and sorted_ == 0


@pytest.mark.parametrize(("kind", "cut_unsorted"), [("wide", 2), ("ties", 0)])  # ties: flatter rows, all sorted
def test_with_min_p_penalties_and_the_qwen_vocabulary(kind, cut_unsorted):
    V = 151936
    params = [SamplingParams(temperature=T, top_p=p, min_p=m, repetition_penalty=1.2, presence_penalty=0.4, seed=i)
              for i, (T, p, m) in enumerate([(0.7, 0.95, 0.0), (0.8, 0.9, 0.05), (1.0, 0.5, 0.2)])]
    bounded, _ = cut_rows(params, V, [logits(kind, 3, V, t) for t in range(2)], context={0: list(range(0, V, 11))})
    assert bounded >= cut_unsorted


@pytest.mark.slow
def test_the_avx2_build_cuts_the_same_on_an_avx512_cpu():
    run_avx2_build("sample", __file__, "not avx2")
