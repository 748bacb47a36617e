"""NaN or inf logits never pass for a completion: non-finite weights, or a row that goes bad mid-
generation, raise NumericsError naming the step and prompt, on the plain and the fused head."""

import pytest
import torch

import sluice
from sluice import SamplingParams
from sluice.errors import NumericsError


@pytest.fixture
def nan_llm(tiny_dir):
    return sluice.LLM(str(tiny_dir), batching=False)  # poisons runner.step; the scheduler: test_scheduler.py


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_non_finite_weights_raise_instead_of_an_empty_completion(nan_llm, fused, poison):
    nan_llm.fused_head = fused
    with torch.no_grad():
        nan_llm.model.layers[1].mlp.down.weight[0, 0] = float(poison)
    p = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=1)
    with pytest.raises(NumericsError, match=r"non-finite logits \(NaN or inf\) at step 0 of prompt 0.*sluice inspect"):
        nan_llm.generate("hi", p)
    with pytest.raises(NumericsError):
        list(nan_llm.stream("hi", p))
    with pytest.raises(NumericsError):  # greedy rows too
        nan_llm.generate("hi", SamplingParams(max_tokens=5, temperature=0))


def _poison_steps_from(llm, monkeypatch, step: int, row: int):
    """Make decode step `step` (1 = the first after prefill) and later give NaN for batch row `row`."""
    real, calls = llm.runner.step, [0]

    def step_fn(tokens, hidden=False):
        out = real(tokens, hidden=hidden).clone()  # an inference tensor takes no in-place write outside
        calls[0] += 1
        if calls[0] >= step:
            out[row] = float("nan")
        return out
    monkeypatch.setattr(llm.runner, "step", step_fn)


@pytest.mark.parametrize("fused", [False, True])
def test_nan_mid_generation_is_not_returned_as_a_completion(nan_llm, monkeypatch, fused):
    nan_llm.fused_head = fused
    params = [SamplingParams(max_tokens=8, seed=s, temperature=1.0, top_k=20, ignore_eos=True) for s in (1, 2)]
    _poison_steps_from(nan_llm, monkeypatch, step=3, row=1)
    with pytest.raises(NumericsError, match="at step 3 of prompt 1"):
        nan_llm.generate(["hello", "world"], params)
    monkeypatch.undo()
    _poison_steps_from(nan_llm, monkeypatch, step=3, row=0)
    with pytest.raises(NumericsError, match="at step 3 of prompt 0"):
        for _ in nan_llm.stream("hello", params[0]):
            pass
    assert nan_llm.generate("x", SamplingParams(max_tokens=1))  # the LLM is free again


@pytest.mark.parametrize("fused", [False, True])
def test_nan_in_a_finished_row_does_not_stop_the_others(nan_llm, monkeypatch, fused):
    nan_llm.fused_head = fused
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=20, seed=1),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=2, ignore_eos=True)]
    _poison_steps_from(nan_llm, monkeypatch, step=1, row=0)
    outs = nan_llm.generate(["hello", "world"], params)
    assert len(outs[0].token_ids) == 1 and len(outs[1].token_ids) == 6
