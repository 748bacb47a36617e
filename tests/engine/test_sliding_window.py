"""A sliding window (Mistral's) in the KV-cached path: generation past the window, prefill in slices
included, equals full recompute and transformers."""

import pytest
import torch
from ckpt import build, build_with_tokenizer, hf_greedy
from tok_fixtures import VOCAB_SIZE

import sluice
import sluice.engine.runner as runner_mod
from sluice import SamplingParams

WINDOW = 8
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """A tiny Mistral whose window (8) is far shorter than prompt + output (12 + 20)."""
    d = tmp_path_factory.mktemp("mistral-window")
    ref = build_with_tokenizer(d, "mistral", sliding_window=WINDOW)
    return d, ref


@torch.inference_mode()
def full_recompute_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))  # no cache: the whole sequence each time
    return ids[len(prompt):]


def test_sliding_window_is_in_force(sliding, tmp_path):
    # The same weights without a window give other logits on a long prompt: the tests below can tell.
    d, ref = sliding
    wide = build(tmp_path, "mistral", vocab_size=VOCAB_SIZE, sliding_window=4096)
    ids = torch.arange(3, 33)[None]
    with torch.no_grad():
        assert (ref(ids).logits[0, -1] - wide(ids).logits[0, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("sliced_prefill", [False, True])
def test_cached_generation_past_the_window_matches_recompute_and_transformers(sliding, monkeypatch, sliced_prefill):
    d, ref = sliding
    llm = sluice.LLM(str(d))
    assert llm.model.config.sliding_window == WINDOW and all(llm.model.sliding)
    if sliced_prefill:  # three positions per forward: the window also spans prefill slices
        per_token = runner_mod.PREFILL_BYTES // runner_mod.prefill_tokens_per_forward(llm.model.config, 64, 4)
        monkeypatch.setattr(runner_mod, "PREFILL_BYTES", 3 * per_token)
    prompts = [[1, 5, 9, 33, 60, 7, 81, 14, 200, 3, 77, 41], [9, 8, 7]]  # batched, unequal lengths
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_greedy(ref, torch.tensor([prompt]), 20)
        assert out.token_ids == expected
        assert out.token_ids == full_recompute_greedy(llm.model, prompt, 20)


