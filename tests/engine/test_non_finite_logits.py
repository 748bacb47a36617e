"""NaN or inf logits never pass for a completion: non-finite weights, or a row that goes bad mid-
generation, raise NumericsError naming the step and prompt, on the plain and the fused head, with the
native step (kernels="auto", where it is built: tests/engine/test_native_builds.py fails where it should
be and is not) and on the torch forward (kernels=False)."""

import pytest
import torch

import sluice
from sluice import SamplingParams
from sluice.errors import NumericsError


@pytest.fixture(params=["auto", False], ids=["native", "torch"])
def nan_llm(tiny_dir, request):
    from sluice.engine import fast_step
    if request.param == "auto" and fast_step.kernel() is None:
        pytest.skip(f"no native step here: {fast_step.why_unavailable()}")
    llm = sluice.LLM(str(tiny_dir), kernels=request.param)
    yield llm
    forward = llm.batch_engine().scheduler.forward
    assert forward.use_fast == (request.param == "auto"), forward.native_reason  # the path asked for ran


def _fused(llm, fused: bool) -> None:
    llm.batch_engine().scheduler.fused_head = fused


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_non_finite_weights_raise_instead_of_an_empty_completion(nan_llm, fused, poison):
    _fused(nan_llm, fused)
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
    """Make the model's output for prompt `row` NaN from its decode step `step` on (1 = the first after
    prefill: the step that draws its token number `step`, counting from 0)."""
    forward = llm.batch_engine().scheduler.forward
    real = forward._rows

    def rows_fn(rows, fed, want):
        out = real(rows, fed, want)
        bad = [i for i, r in enumerate(rows) if r.seq.label == f"prompt {row}" and len(r.seq.token_ids) >= step]
        if out is not None and bad:
            out = out.clone()  # an inference tensor takes no in-place write outside
            out[bad] = float("nan")
        return out
    monkeypatch.setattr(forward, "_rows", rows_fn)


@pytest.mark.parametrize("fused", [False, True])
def test_nan_mid_generation_is_not_returned_as_a_completion(nan_llm, monkeypatch, fused):
    _fused(nan_llm, fused)
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
    _fused(nan_llm, fused)
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=20, seed=1),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=2, ignore_eos=True)]
    _poison_steps_from(nan_llm, monkeypatch, step=1, row=0)
    outs = nan_llm.generate(["hello", "world"], params)
    assert len(outs[0].token_ids) == 1 and len(outs[1].token_ids) == 6
