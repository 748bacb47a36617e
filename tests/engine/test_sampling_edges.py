"""The sampler at its edges: tokens exactly at the min_p threshold (the plain sampler and the fused LM
head), and a batch slot reused for a new request (Sampler.set_row) starting from a clean penalty state."""

import pytest
import torch

from sluice.engine.sampling import Sampler, SamplingParams, filtered_probs



def test_min_p_keeps_the_tokens_exactly_at_its_threshold():
    """min_p keeps p >= min_p * p_max: a token exactly at the threshold stays. With min_p = 1 the
    threshold is p_max itself, so the tokens tied with the most likely one are exactly at it (equal
    logits give bit-equal probabilities), and they share the mass."""
    logits = torch.tensor([1.0, 3.0, 0.5, 3.0, -2.0, 3.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert probs.tolist() == pytest.approx([0, 1 / 3, 0, 1 / 3, 0, 1 / 3], abs=1e-7)
    assert probs[[1, 3, 5]].unique().numel() == 1  # exactly the same, not merely close


def test_min_p_ties_at_the_threshold_are_drawn_by_the_sampler_and_the_fused_head():
    """The sampler's race and the fused LM head (engine/fused_head.py, its own min_p cut on
    candidates) both keep the tied tokens: seeded draws give each of them, the same on both paths."""
    from sluice.engine.fused_head import FusedHead

    V = 8
    z = torch.tensor([[0.0, 2.0, -1.0, 2.0, 1.0, -3.0, 2.0, 0.5]])
    params = [SamplingParams(temperature=0.7, min_p=1.0, seed=s) for s in range(60)]
    plain = Sampler(params, V)(z.expand(60, V)).tolist()
    fused = FusedHead(Sampler(params, V), chunk=4, candidates=V)(z.expand(60, V).contiguous(), torch.eye(V))
    assert set(plain) == {1, 3, 6}  # every tied token drawn, nothing below the threshold
    assert fused.tokens.tolist() == plain and not fused.fallback.any()


def test_set_row_gives_the_new_request_a_fresh_repetition_penalty_state():
    """A batch slot reused for a new request must forget what the previous one generated: its seen
    mask starts from the new prompt alone, so it draws what a fresh sampler draws."""
    V = 12
    p = SamplingParams(temperature=0, repetition_penalty=3.0)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(10, 2, V, generator=g)
    used = Sampler([p, p], V)
    for x in logits:  # both rows generate (and mark seen) 10 tokens
        used(x)
    before = used.seen[1].clone()
    assert before.sum() > 2
    used.set_row(1, p, context=[0])
    assert torch.nonzero(used.seen[1])[:, 0].tolist() == [0]
    fresh = Sampler([p], V)
    fresh.add_context(0, [0])
    # the logits favour what row 1 generated before: a stale mask would push those tokens down
    steps = logits[:, 1] + 3.0 * before.float()
    assert [used(torch.stack([x, x]))[1].item() for x in steps] == [fresh(x[None]).item() for x in steps]
