"""The softmax toll booth: online == safe, naive breaks exactly past log(finfo.max), honest table."""

import json
import math

import pytest
import torch

from sluice.errors import ObservatoryError
from sluice.observatory.softmax import (METHODS, naive_softmax, online_softmax, overflow_threshold,
                                        safe_softmax, softmax_safety)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def test_thresholds():
    assert overflow_threshold(torch.float16) == pytest.approx(11.0898, abs=1e-4)
    assert overflow_threshold(torch.float32) == pytest.approx(88.7228, abs=1e-4)
    assert overflow_threshold(torch.bfloat16) == pytest.approx(88.7189, abs=1e-4)


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0, 40.0])
@pytest.mark.parametrize("chunk", [4096, 1000, 777, 10000, 20000])
def test_online_equals_safe_fp32(scale, chunk):
    g = torch.Generator().manual_seed(int(scale * 10) + chunk)
    z = torch.randn(5, 10000, generator=g) * scale + 3 * scale  # shifted, so the max moves about
    z[0] = torch.sort(z[0]).values  # ascending: the running max grows in every chunk (max rescaling)
    safe, online = safe_softmax(z, torch.float32), online_softmax(z, torch.float32, chunk=chunk)
    assert (online.probs - safe.probs).abs().max() < 1e-6
    assert torch.allclose(online.log_z, safe.log_z, rtol=0, atol=1e-5)
    assert torch.allclose(safe.probs.double(), torch.softmax(z.double(), -1), rtol=0, atol=1e-6)


def _rows_around(dtype):
    """Rows whose largest logit (after the cast to dtype) is clearly above / below the threshold.
    The other logits are N(0, 1): their exp() sum stays far from overflowing in any dtype."""
    t = overflow_threshold(dtype)
    maxima = [t - 0.5, t + 0.5, 0.0, 5.0, t + 30, 1000.0, t - 2]
    z = torch.randn(len(maxima), 3000, generator=torch.Generator().manual_seed(1))
    z[:, 17] = torch.tensor(maxima)
    above = z.to(dtype).double().amax(-1) > t  # decided on the values the dtype really holds
    assert above.tolist() == [False, True, False, False, True, True, False]
    return z, above


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_breaks_exactly_past_the_threshold(dtype):
    z, above = _rows_around(dtype)
    out = naive_softmax(z, dtype)
    broken = ~torch.isfinite(out.probs).all(-1)
    assert torch.equal(broken, above)
    assert torch.equal(out.exp_inf > 0, above)
    ok = ~above
    ref = torch.softmax(z.to(dtype).double(), -1)
    assert (out.probs[ok].double() - ref[ok]).abs().max() < 1e-2  # healthy rows are right
    for fn in (safe_softmax, online_softmax):  # max subtraction: never an inf in exp()
        good = fn(z, dtype)
        assert torch.isfinite(good.probs).all() and (good.exp_inf == 0).all()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert (good.probs.double() - torch.softmax(z.double(), -1)).abs().max() < tol


def test_naive_underflows_when_all_logits_are_very_negative():
    z = torch.randn(2, 500, generator=torch.Generator().manual_seed(2)) - 200.0  # exp() == 0 in fp32
    naive = naive_softmax(z, torch.float32)
    assert naive.denom_zero.all() and torch.isnan(naive.probs).all()
    assert torch.isfinite(online_softmax(z, torch.float32).probs).all()


def test_fp16_denominator_overflows_on_a_flat_150k_vocab():
    """A real limit, not a bug: sum of 150k terms near 1 exceeds 65504, so p = e / inf = 0."""
    z = torch.randn(1, 150_000, generator=torch.Generator().manual_seed(3)) * 0.01
    for fn in (safe_softmax, online_softmax):
        out = fn(z, torch.float16)
        assert out.denom_inf.all() and (out.probs == 0).all()
        assert not fn(z, torch.float32).denom_inf.any()


def test_table_rows_and_values():
    z, above = _rows_around(torch.float32)
    table = softmax_safety(z, rows_per_block=3)  # blocks that do not divide N
    assert [(r["method"], r["dtype"]) for r in table] == [
        (m, d) for m in METHODS for d in ("float32", "float16", "bfloat16")]
    json.loads(json.dumps(table))  # plain Python numbers only
    row = {(r["method"], r["dtype"]): r for r in table}
    naive = row["naive", "float32"]
    assert naive["rows"] == len(above) and naive["vocab"] == 3000
    assert naive["rows_broken"] == int(above.sum()) and naive["nan"] > 0
    assert math.isnan(naive["max_abs_err"]) and naive["max_logz_err"] == math.inf
    assert naive["max_abs_err_ok"] < 1e-6
    assert naive["logit_max"] == 1000.0 and naive["threshold"] == overflow_threshold(torch.float32)
    for method in ("safe", "online"):
        r = row[method, "float32"]
        assert r["overflow"] == r["nan"] == r["rows_broken"] == 0
        assert r["max_abs_err"] < 1e-6 and r["max_logz_err"] < 1e-4
    # every row of the fp16 naive softmax has a logit far past 11.09
    assert row["naive", "float16"]["rows_broken"] == len(above) - 2  # rows with max 0 or 5 survive


def test_fp64_reference_matches_torch_and_errors_are_small():
    z = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)) * 5
    row = {(r["method"], r["dtype"]): r for r in softmax_safety(z.half())}  # any float input dtype
    assert row["safe", "float32"]["max_abs_err"] < 1e-7
    assert row["online", "float16"]["max_abs_err"] < 1e-3
    assert row["online", "bfloat16"]["max_abs_err"] < 2e-2


def test_bad_input():
    with pytest.raises(ObservatoryError, match="shape"):
        softmax_safety(torch.zeros(5))
    with pytest.raises(ObservatoryError):
        softmax_safety(torch.zeros(0, 4))
