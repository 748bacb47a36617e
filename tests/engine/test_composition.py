"""Every engine feature composes with every other (docs/engine.md's composition table): one generation
path, the continuous-batching scheduler, with speculative decoding (draft, prompt lookup), the fused
head and compile as options of its step, on fp32, bf16, int8 and int4 weights, the native step or the
torch forward, under a forward hook (the observatory's way in).

A cell is a pair of features. Its greedy output (a batch of prompts of different lengths, decoded while
another stream is open) equals the output of the same weights on the plain path (no speculation, no
fused head, no compile), token for token; so do its logprobs and its tokens under every penalty; and a
seeded sampled batch repeats. Tensor parallelism and the server have their own cells in tests/parallel
and tests/server."""

from __future__ import annotations

import itertools

import pytest
import torch

import sluice
from sluice import SamplingParams
from sluice.engine import fast_step, gemv, mixed

# The features that must not change a greedy token: the rest (weights, the native step) define the reference.
OUTPUT_NEUTRAL = ("draft_model", "speculative", "fused_head", "compile")
FEATURES = {
    "draft": dict(draft_model="SELF"), "prompt-lookup": dict(speculative="prompt-lookup"),
    "fused-head": dict(fused_head=True), "compile": dict(compile=True), "bf16": dict(dtype="bfloat16"),
    "int8": dict(quantize="int8"), "int4": dict(quantize="int4"), "torch-forward": dict(kernels=False),
    "hooks": {},
}
SLOW = {"compile"}  # torch.compile traces per shape: its cells are marked slow
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7], [3, 4], list(range(20, 60))]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PENALIZED = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, repetition_penalty=1.3,
                           presence_penalty=0.5, frequency_penalty=0.4)


def _cells():
    for a, b in itertools.combinations(FEATURES, 2):
        if {a, b} in ({"draft", "prompt-lookup"}, {"int8", "int4"}, {"bf16", "int8"}, {"bf16", "int4"},
                      {"compile", "torch-forward"}):
            continue  # one or the other: the same option (speculative=, quantize=, dtype / weights, the forward)
        marks = [pytest.mark.slow] if {a, b} & SLOW else []
        yield pytest.param(a, b, marks=marks, id=f"{a}+{b}")


def _kwargs(tiny_dir, names) -> dict:
    kw = {}
    for n in names:
        kw.update({k: (str(tiny_dir) if v == "SELF" else v) for k, v in FEATURES[n].items()})
    return kw


def _hooked(llm, on: bool):
    calls = []
    if on:  # a forward hook on a block: the native step and the fused head step aside for it
        return calls, llm.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    return calls, None


def _run(llm, params):
    """The batch, decoded while a stream of the first prompt is open (its first delta read)."""
    s = llm.stream(PROMPTS[0], params)
    next(s, None)
    outs = llm.generate(PROMPTS, params)
    s.close()
    return outs


@pytest.mark.parametrize("a, b", list(_cells()))
def test_cell_greedy_logprobs_penalties_equal_the_plain_path_and_seeds_repeat(tiny_dir, a, b, monkeypatch):
    # bf16 weights with fp32 products, where the torch forward and the native step differ by summation order only;
    # the bf16 dot mode ("auto" on a CPU with AVX512_BF16) has its own cells below
    monkeypatch.setattr(mixed, "BF16_DOT", "fp32")
    if {a, b} & {"compile", "hooks"}:
        # where the torch forward meets the native step's reference, int8 and int4 weights with fp32 products too:
        # the integer dots round each input to int8, and fp32 sums in another order (compile's) can put an input
        # on the other side of a rounding tie (~1e-2 of a logit); that mode has its own cells below
        monkeypatch.setattr(gemv, "INT8_DOT", "fp32")
        monkeypatch.setattr(gemv, "INT4_DOT", "fp32")
    kw = _kwargs(tiny_dir, (a, b))
    ref_kw = {k: v for k, v in kw.items() if k not in OUTPUT_NEUTRAL}
    llm, ref = sluice.LLM(str(tiny_dir), **kw), sluice.LLM(str(tiny_dir), fused_head=False, **ref_kw)
    calls, handle = _hooked(llm, "hooks" in (a, b))
    proposed = 0
    try:
        for params in (GREEDY, PENALIZED):
            got, want = _run(llm, params), ref.generate(PROMPTS, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in want], (a, b, params)
            if params.logprobs:
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(torch.tensor([t.logprob for t in g.logprobs]),
                                               torch.tensor([t.logprob for t in w.logprobs]), atol=2e-3, rtol=0)
            proposed += llm.last_stats.proposed
        sampled = [SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=s, ignore_eos=True) for s in (1, 2, 3)]
        one, two = llm.generate(PROMPTS, sampled), llm.generate(PROMPTS, sampled)
        assert [o.token_ids for o in one] == [o.token_ids for o in two]
    finally:
        if handle is not None:
            handle.remove()
    assert bool(calls) == ("hooks" in (a, b))
    assert (proposed > 0) == ("draft" in (a, b) or "prompt-lookup" in (a, b))  # it did speculate


@pytest.mark.skipif(fast_step.kernel() is None or not fast_step.kernel().has_bf16_dot(),
                    reason="needs the native step on a CPU with AVX512_BF16")
@pytest.mark.parametrize("feature", ["hooks", pytest.param("compile", marks=pytest.mark.slow)])
def test_bf16_dot_mode_torch_forward_keeps_the_native_steps_tokens(tiny_dir, feature, monkeypatch):
    """In the bf16 dot mode both paths round each linear's input to bf16; their fp32 sums differ in order, so now
    and then an input lands on the other side of a bf16 rounding boundary (test_fast_step_bf16_dot.py bounds the
    step against the model). So: the same greedy tokens under every penalty, logprobs within the mode's bound
    (2e-2 of the largest |logit|, as a logprob bound: twice it), and the hooked and compiled torch forwards agree
    with each other to summation order."""
    monkeypatch.setattr(mixed, "BF16_DOT", "bf16")
    native = sluice.LLM(str(tiny_dir), dtype="bfloat16")
    llm = sluice.LLM(str(tiny_dir), dtype="bfloat16", compile=feature == "compile")
    hooked = sluice.LLM(str(tiny_dir), dtype="bfloat16")
    calls, handle = _hooked(hooked, True)
    _, own = _hooked(llm, feature == "hooks")
    try:
        for params in (GREEDY, PENALIZED):
            want, got, torch_ref = native.generate(PROMPTS, params), _run(llm, params), hooked.generate(PROMPTS, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in want] == [o.token_ids for o in torch_ref]
            if params.logprobs:
                with torch.inference_mode():
                    bound = 2 * 2e-2 * native.model(torch.tensor([PROMPTS[2]])).abs().max().item()
                for g, w, t in zip(got, want, torch_ref, strict=True):
                    lp = lambda o: torch.tensor([x.logprob for x in o.logprobs])  # noqa: E731
                    torch.testing.assert_close(lp(g), lp(w), atol=bound, rtol=0)
                    torch.testing.assert_close(lp(g), lp(t), atol=2e-4, rtol=0)
        assert native.last_stats is not None and calls
    finally:
        handle.remove()
        if own is not None:
            own.remove()


@pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")
@pytest.mark.parametrize("feature", ["hooks", pytest.param("compile", marks=pytest.mark.slow)])
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_integer_dot_mode_torch_forward_keeps_the_native_steps_tokens(tiny_dir, quantize, feature, monkeypatch):
    """The integer dots (gemv.INT8_DOT / INT4_DOT "int8", the default) round each linear's input per block of 32
    to int8 on both paths (the native step's q8t.h / q4i.h, the torch forward's round_blocks_int8); their fp32 sums
    upstream differ in order, and compile's more than a hooked forward's, so now and then an input lands on the
    other side of a rounding tie: one step of x, ~1e-2 of a logit (test_fast_step_int4_dot.py). So: the same greedy
    tokens under every penalty, logprobs within twice 2e-2 of the largest |logit| of each other, and most of them
    within 2e-3."""
    monkeypatch.setattr(gemv, "INT8_DOT", "int8")
    monkeypatch.setattr(gemv, "INT4_DOT", "int8")
    native = sluice.LLM(str(tiny_dir), quantize=quantize)
    llm = sluice.LLM(str(tiny_dir), quantize=quantize, compile=feature == "compile")
    calls, handle = _hooked(llm, feature == "hooks")
    try:
        for params in (GREEDY, PENALIZED):
            want, got = native.generate(PROMPTS, params), _run(llm, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            if params.logprobs:
                with torch.inference_mode():
                    bound = 2 * 2e-2 * native.model(torch.tensor([PROMPTS[2]])).abs().max().item()
                lp = lambda outs: torch.cat([torch.tensor([x.logprob for x in o.logprobs]) for o in outs])  # noqa: E731
                diff = (lp(got) - lp(want)).abs()
                assert diff.max() <= bound, (diff, bound)
                # a flip is an event (its row differs from there on), not the rule: most logprobs agree to summation
                # order (a torch forward that did not round as the step rounds differs at nearly every one)
                assert (diff <= 2e-3).float().mean() >= 0.5, diff
        ran = native.batch_engine().scheduler.forward, llm.batch_engine().scheduler.forward
        assert ran[0].use_fast and not ran[1].use_fast  # the native step against the torch forward
        assert bool(calls) == (feature == "hooks")
    finally:
        if handle is not None:
            handle.remove()
