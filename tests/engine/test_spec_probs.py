"""spec_probs.RoundProbs: a speculative round's filtered probabilities, bit for bit sampling.filtered_probs'
(the acceptance rule's p must be the distribution plain sampling draws from), with the rows' params kept
across calls and top_p taken from a prefix of the sort where that provably keeps the same tokens."""

from __future__ import annotations

import pytest
import torch

from sluice import SamplingParams
from sluice.engine.sample import LANES
from sluice.engine.sampling import Sampler, filtered_probs
from sluice.engine import accept as accept_kernel
from sluice.engine.spec_probs import RoundProbs

V = 8192


def _peaked(gen: torch.Generator, B: int, spread: float) -> torch.Tensor:
    """Logits like a trained model's: a few tokens far above a noisy floor (a nucleus of a few tokens)."""
    x = torch.randn(B, V, generator=gen) * spread
    x[:, :6] += torch.rand(B, 6, generator=gen) * 12
    return x


def test_equals_filtered_probs_and_takes_the_prefix_where_it_can():
    gen, rp = torch.Generator().manual_seed(0), RoundProbs()
    kinds = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, top_p=0.5), dict(temperature=0.6, top_p=0.99),
             dict(temperature=1.0, top_p=0.9, top_k=50), dict(temperature=0.7, min_p=0.1), dict(temperature=0),
             dict(temperature=1.1, repetition_penalty=1.3)]
    for t in range(240):
        B = 1 + t % 3
        params = [SamplingParams(**kinds[(t // 3 + b * (t % 2)) % len(kinds)]) for b in range(B)]
        samplers = [Sampler([p], V) for p in params]
        x = _peaked(gen, B, [0.5, 2.0, 4.0][t % 3]) if t % 4 else torch.randn(B, V, generator=gen) * 3
        seen = torch.rand(B, V, generator=gen) < 0.01
        for repeat in (1, 2):
            xs, ss = x.repeat_interleave(repeat, 0), seen.repeat_interleave(repeat, 0)
            want = filtered_probs(xs, [p for p in params for _ in range(repeat)], ss)
            assert torch.equal(rp(xs, samplers, repeat, ss), want), (t, params)
    # the prefix decided most peaked top_p rows; flat rows (a nucleus past 64 tokens) took the sort
    assert rp.nucleus_calls > 100 and 0 < rp.nucleus_fallbacks < rp.nucleus_calls


def test_a_mass_at_the_cut_takes_the_sort(monkeypatch):
    """Tokens whose mass before them lands within the margin of top_p: the prefix does not decide them (the
    torch path: the native kernel is switched off here; it decides the same without a margin)."""
    monkeypatch.setattr(accept_kernel, "kernel", lambda: None)
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(2)) * 0.1 - 30  # no ties at the prefix end
    x[0, :4] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()  # masses before: 0, 0.5, 0.75, 0.875
    rp = RoundProbs()
    for top_p in (0.75, 0.7, 0.8):
        p = SamplingParams(temperature=1.0, top_p=top_p)
        assert torch.equal(rp(x, [Sampler([p], V)]), filtered_probs(x, p))
    assert rp.nucleus_calls == 3 and rp.nucleus_fallbacks == 1  # 0.75 only


def test_params_follow_a_new_batch():
    """The kept tensors belong to the batch they were made for: other samplers get their own params."""
    x = _peaked(torch.Generator().manual_seed(1), 1, 2.0)
    rp = RoundProbs()
    for kw in (dict(temperature=0.5, top_p=0.9), dict(temperature=1.5, top_p=0.6), dict(temperature=0)):
        p = SamplingParams(**kw)
        assert torch.equal(rp(x, [Sampler([p], V)]), filtered_probs(x, p))


@pytest.mark.skipif(accept_kernel.kernel() is None or not LANES, reason="the native acceptance kernel is not built")
def test_native_probs_are_torch_bits():
    """accept.nucleus_probs (temperature and top_p alone, greedy one-hot) against filtered_probs bit for bit:
    rows shorter than torch's softmax lanes, with a remainder past them, flat and peaked, a mass exactly at
    the cut, top_p off; and RoundProbs takes it where no penalty applies."""
    gen = torch.Generator().manual_seed(3)
    kinds = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, top_p=0.5), dict(temperature=0.6, top_p=0.99),
             dict(temperature=0.7, top_p=1.0), dict(temperature=0, top_p=1.0), dict(temperature=1.3, top_p=0.75)]
    for t in range(180):
        width = [V, 7, 40, V + 5, 1000][t % 5]
        x = torch.randn(3, width, generator=gen) * [0.5, 2.0, 4.0][t % 3]
        if t % 2:
            x[:, :6] += torch.rand(3, 6, generator=gen) * 12
        if t % 7 == 0 and width >= 4:  # masses before the first tokens: 0, 0.5, 0.75, 0.875
            x[:, :4] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
            x[:, 4:] = -60
        params = [SamplingParams(**kinds[(t + b) % len(kinds)]) for b in range(3)]
        want = filtered_probs(x, params)
        temperature = torch.tensor([float(p.temperature) for p in params])
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        assert torch.equal(accept_kernel.nucleus_probs(x, temperature, top_p), want), (t, params)
        rp = RoundProbs()
        assert torch.equal(rp(x[:1], [Sampler([params[0]], width)]), want[:1])
        assert rp.nucleus_calls == 0  # the native call decided it
    bad = torch.randn(1, V)
    bad[0, 5] = float("nan")
    assert accept_kernel.nucleus_probs(bad, torch.tensor([0.8]), torch.tensor([0.9])) is None  # the torch path's


def test_native_probs_under_torchs_avx2_softmax():
    """torch's softmax sums in 8 lanes under its AVX2 kernels (16 under AVX-512): the same check in a process
    whose torch runs AVX2 (ATEN_CPU_CAPABILITY), so both lane counts are held to torch's bits."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if accept_kernel.kernel() is None or LANES != 16:
        pytest.skip("torch already runs its AVX2 kernels here (or no kernel): the test above checks them")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    probe = "from sluice.engine.sample import LANES; assert LANES == 8, LANES"
    assert subprocess.run([sys.executable, "-c", probe], env=env, timeout=300).returncode == 0
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "native_probs_are_torch_bits or bounded_cut or draft_guess"], env=env, capture_output=True, text=True, timeout=900,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout[-3000:]


def test_native_probs_take_the_bounded_cut_and_the_sort():
    """nucleus_probs' top_p takes top_p_cut.h's bounded cut where it proves torch's (most peaked rows) and
    the whole sort elsewhere (a mass exactly at the cut): both give filtered_probs' bits."""
    gen = torch.Generator().manual_seed(5)
    before = accept_kernel.top_p_rows()
    for t in range(40):
        x = _peaked(gen, 2, [0.5, 2.0][t % 2])
        if t % 4 == 0:  # masses before the first tokens: 0, 0.5, 0.75: top_p 0.75 sits on one
            x[:, :4] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
            x[:, 4:] = -60
        params = [SamplingParams(temperature=1.0, top_p=0.75), SamplingParams(temperature=0.8, top_p=0.95)]
        temperature = torch.tensor([1.0, 0.8])
        top_p = torch.tensor([0.75, 0.95], dtype=torch.float32)
        assert torch.equal(accept_kernel.nucleus_probs(x, temperature, top_p), filtered_probs(x, params)), t
    bounded, sorted_, moving = (a - b for a, b in zip(accept_kernel.top_p_rows(), before, strict=True))
    assert bounded > 40 and sorted_ >= 10 and moving == 0, (bounded, sorted_, moving)  # (probs: exact cuts only)


def test_native_draft_guess_is_probs_then_draw():
    """accept.propose (a draft guess in one call) against RoundProbs without top_p then speculative.draw in
    torch: the same q bits, the same tokens, the same stream positions; greedy rows and sampled rows left out
    of the race take their argmax; a non-finite logit gives None and changes nothing."""
    from sluice.engine.noise import RowStream
    from sluice.engine.speculative import draw

    gen = torch.Generator().manual_seed(9)
    for t in range(60):
        B, width = 4, [V, 7, 40, V + 5][t % 4]
        x = torch.randn(B, width, generator=gen) * [0.5, 2.0, 4.0][t % 3]
        if t % 2:
            x[:, :6] += torch.rand(B, 6, generator=gen) * 12
        params = [SamplingParams(temperature=[0.8, 0, 1.3, 0.6][(t + b) % 4], top_p=0.95) for b in range(B)]
        samplers = [Sampler([p], width) for p in params]
        racing = [b for b in range(B) if params[b].temperature > 0][: 1 + t % 3]
        rp = RoundProbs()
        temperature = rp.native_columns(samplers, width, x.device)[0]
        mine = [RowStream(100 + b) for b in range(B)]
        q, tokens = accept_kernel.propose(x, temperature, racing, mine)
        want_q = filtered_probs(x, params, tail_cuts=False)  # what RoundProbs computes for a draft guess
        saved = accept_kernel.kernel
        accept_kernel.kernel = lambda: None
        try:
            theirs = [RowStream(100 + b) for b in range(B)]
            want_tokens = draw(want_q, racing, theirs)
        finally:
            accept_kernel.kernel = saved
        assert torch.equal(q, want_q) and torch.equal(tokens, want_tokens), t
        assert [s.draws for s in mine] == [s.draws for s in theirs], t
    bad = torch.randn(2, V)
    bad[1, 5] = float("inf")
    streams = [RowStream(1), RowStream(2)]
    assert accept_kernel.propose(bad, torch.tensor([0.8, 0.0]), [0], streams) is None
    assert [s.draws for s in streams] == [0, 0]
