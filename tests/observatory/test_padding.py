"""Prompts of different lengths in one padded forward == each prompt alone, for every statistic;
and what stats returns is a copy that the next forward leaves alone."""

import math

import pytest
import torch

import sluice
from ckpt import build
from sluice.errors import ObservatoryError
from sluice.observatory import observe
from sluice.observatory.attach import logit_lens
from sluice.observatory.padding import check_mask, pad_prompts

LENGTHS = (9, 4, 13)


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(params=["qwen3", "gpt2", "gemma2"])
def model(request, tmp_path):
    build(tmp_path, request.param)
    return sluice.load(tmp_path)


def _close(a, b, name):
    assert a.shape == b.shape, name
    if a.is_floating_point():
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True), (name, (a - b).abs().max())
    else:
        assert torch.equal(a, b), name


def test_stats_are_copies_that_the_next_forward_leaves_alone(model):
    a, b = _prompts()[0], _prompts(seed=1)[0]  # same length: the same buffer slots are rewritten
    with observe(model, capacity=(1, 16)) as obs, torch.inference_mode():
        model(torch.tensor([a]))
        kept, summary = obs.stats, obs.summary()
        model(torch.tensor([b]))
        again = obs.stats
    assert not torch.equal(kept["resid_rms"], again["resid_rms"])  # a view would now equal it
    assert not torch.equal(kept["logits"], again["logits"])
    with observe(model, capacity=(1, 16)) as fresh, torch.inference_mode():
        model(torch.tensor([a]))
        assert all(torch.equal(kept[k], v) for k, v in fresh.stats.items()), "kept stats changed"
        assert fresh.summary() == summary


def test_padded_batch_equals_one_at_a_time(model):
    prompts = _prompts()
    with observe(model, capacity=(3, 16)) as obs:
        logits = obs.run(prompts)
        batch = obs.stats
        summaries = obs.summary()
        records = obs.to_records()
        massive = obs.massive_activations(top=3)
        gain, ratio = obs.norm_gain(), obs.branch_ratio()
    T = max(LENGTHS)
    assert logits.shape[:2] == (3, T) and batch["mask"].sum(1).tolist() == list(LENGTHS)
    singles, all_records = [], []
    for b, p in enumerate(prompts):
        n = len(p)
        with observe(model, capacity=(1, 16)) as one, torch.inference_mode():
            own = model(torch.tensor([p]))
            s = one.stats
            singles.append((s, one.summary()))
            all_records += [{**r, "batch": b} for r in one.to_records()]
            assert torch.allclose(logits[b, :n], own[0], atol=1e-5)
            for name, t in s.items():  # every statistic, at the real positions
                got = batch[name][..., b:b + 1, :n] if not name.startswith("resid_top") else batch[name][:, b:b + 1, :n]
                _close(got, t, name)
            _close(gain[:, b:b + 1, :n], one.norm_gain(), "gain")
            _close(ratio[:, b:b + 1, :n], one.branch_ratio(), "ratio")
        # pad positions hold no numbers at all
        pad = slice(n, T)
        assert torch.isnan(batch["resid_rms"][:, b, pad]).all() and torch.isnan(batch["logits"][:, b, pad]).all()
        assert (batch["resid_top_channels"][:, b, pad] == -1).all() and (batch["top1_id"][b, pad] == -1).all()
        assert (batch["nonfinite"][:, b, pad] == 0).all()
    assert obs.first_nonfinite() is None  # NaN at pads is not a finding
    # the summary's means are over real tokens only: the token-weighted mean of the singles'
    w = [n / sum(LENGTHS) for n in LENGTHS]
    for key in ("residual_rms", "attn_norm_in", "mlp_norm_out"):
        want = sum(wi * torch.tensor(s[key], dtype=torch.float64) for wi, (_, s) in zip(w, singles))
        assert torch.allclose(torch.tensor(summaries[key], dtype=torch.float64), want, rtol=1e-5), key
    assert summaries["final_norm_in"] == pytest.approx(sum(wi * s["final_norm_in"] for wi, (_, s) in zip(w, singles)), rel=1e-5)
    # the last position's logits: each row's own last real token, averaged over rows
    assert summaries["entropy"] == pytest.approx(sum(s["entropy"] for _, s in singles) / 3, rel=1e-5)
    assert summaries["residual_absmax"] == pytest.approx([max(s["residual_absmax"][l] for _, s in singles)
                                                           for l in range(len(singles[0][1]["residual_absmax"]))], rel=1e-5)
    assert len(records) == len(all_records)
    key = lambda r: (r["kind"], r.get("module", ""), r.get("layer") or 0, r["batch"], r["position"])  # noqa: E731
    for got, want in zip(sorted(records, key=key), sorted(all_records, key=key)):
        assert got.keys() == want.keys()
        for k, v in want.items():
            if isinstance(v, float):
                assert math.isclose(got[k], v, rel_tol=1e-4, abs_tol=1e-5), (k, got, want)
    assert all(r["position"] < LENGTHS[r["batch"]] for r in massive)


def test_padded_lens_equals_one_at_a_time(model):
    ids, mask = pad_prompts(_prompts(), pad_id=0)
    both = logit_lens(model, ids, topk=3, attention_mask=mask)
    ms = torch.zeros_like(both.mean_square, dtype=torch.float64)
    for b, n in enumerate(LENGTHS):
        one = logit_lens(model, ids[b:b + 1, :n], topk=3)
        for name in ("top_probs", "predicted_prob", "kl", "entropy", "top_ids"):
            _close(getattr(both, name)[:, b:b + 1, :n], getattr(one, name), name)
            assert not getattr(both, name)[:, b, n:].isfinite().any() if name != "top_ids" else \
                (both.top_ids[:, b, n:] == -1).all()
        assert torch.equal(both.predicted[b, :n], one.predicted[0]) and (both.predicted[b, n:] == -1).all()
        ms += one.mean_square.double() * n / sum(LENGTHS)
    assert torch.allclose(both.mean_square.double(), ms, rtol=1e-5)


def test_bad_masks_are_named(model):
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ObservatoryError, match="not right-padded"):
        check_mask(ids, torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
    with pytest.raises(ObservatoryError, match="no real token"):
        check_mask(ids, torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]))
    with pytest.raises(ObservatoryError, match="shape"):
        check_mask(ids, torch.ones(2, 4))
    with pytest.raises(ObservatoryError, match="0/1"):
        check_mask(ids, torch.full((2, 5), 2))
    with pytest.raises(ObservatoryError, match="non-empty"):
        pad_prompts([[1, 2], []])
    with observe(model) as obs, pytest.raises(ObservatoryError, match="attention_mask goes with ids"):
        obs.run([[1, 2]], attention_mask=torch.ones(1, 2))
