"""Issue 15, tests that catch what they should: engine behaviour that mutation testing found
unguarded (a sliding window in the KV-cached path, config.json's eos fallback, decode tok/s)."""

import json
import shutil

import pytest
import torch
from ckpt import build, build_with_tokenizer, hf_greedy
from tok_fixtures import VOCAB_SIZE

import sluice
import sluice.engine.runner as runner_mod
from sluice import SamplingParams
from sluice.engine import Stats

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


def _copy(src, dst, generation_config):
    shutil.copytree(src, dst)
    if generation_config is None:
        (dst / "generation_config.json").unlink()
    else:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


def test_eos_falls_back_to_config_json_without_a_generation_config_eos(tiny_dir, tiny_llm, tmp_path):
    free = tiny_llm.generate("abc", SamplingParams(max_tokens=12, **GREEDY))[0].token_ids
    target = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # first seen at step i >= 2
    cut = free.index(target) + 1

    def with_config_eos(name, generation_config):
        d = _copy(tiny_dir, tmp_path / name, generation_config)
        cfg = json.loads((d / "config.json").read_text())
        cfg["eos_token_id"] = target
        (d / "config.json").write_text(json.dumps(cfg))
        return sluice.LLM(str(d))

    p = SamplingParams(max_tokens=12, temperature=0)
    for name, gen in (("no-eos-field", {"do_sample": False}), ("no-file", None)):
        llm = with_config_eos(name, gen)
        assert target in llm.eos_token_ids, name
        out = llm.generate("abc", p)[0]
        assert out.token_ids == free[:cut] and out.finish_reason == "stop", name
    # generation_config.json's own eos list wins: config.json's is not added to it
    llm = with_config_eos("own-eos", {"do_sample": False, "eos_token_id": 2})
    assert target not in llm.eos_token_ids
    assert llm.generate("abc", p)[0].token_ids[:cut + 1] == free[:cut + 1]


def test_decode_tok_s_counts_tokens_after_the_first_over_decode_time(tiny_llm):
    s = Stats(prompt_tokens=8, generated_tokens=11, prefill_seconds=0.5, decode_seconds=2.0)
    assert s.decode_tok_s == 5.0  # (11 - 1) / 2.0: the first token is prefill's
    assert s.prefill_tok_s == 16.0
    assert Stats(generated_tokens=1, decode_seconds=0.1).decode_tok_s == 0.0
    assert Stats(generated_tokens=5, decode_seconds=0.0).decode_tok_s == 0.0
    assert s.as_dict()["decode_tok_s"] == 5.0
    assert Stats(generated_tokens=11, decode_seconds=2.0, rows=3).decode_tok_s == 4.0  # (11 - 3) / 2.0
    outs = tiny_llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=n, **GREEDY) for n in (9, 4)])
    st = tiny_llm.last_stats
    assert st.generated_tokens == 13 and st.prompt_tokens == 5
    # 2 of the 13 tokens came out of prefill, one per row; 11 were decoded
    assert st.decode_seconds > 0 and st.decode_tok_s == pytest.approx(11 / st.decode_seconds)
    assert sum(len(o.token_ids) for o in outs) == st.generated_tokens


@pytest.mark.parametrize("kwargs,words", [(dict(max_model_len=True), "max_model_len"),
                                          (dict(compile="yes"), "compile must be True or False")])
def test_llm_arguments_of_the_wrong_type_are_refused(tiny_dir, kwargs, words):
    with pytest.raises(sluice.SluiceError, match=words):
        sluice.LLM(tiny_dir, **kwargs)


def test_chat_messages_that_are_a_string_are_refused(tiny_llm):
    with pytest.raises(sluice.RequestError, match="messages must be a list of dicts.*got str"):
        tiny_llm.chat("hi")
