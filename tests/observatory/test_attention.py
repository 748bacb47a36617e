"""Per-head attention statistics (observatory/attention.py) against transformers' eager attention on
every family: probabilities from output_attentions=True, scores and q/k from the eager function's
own inputs. Soft-caps (Gemma 2) and sliding windows (Gemma 2/3, Mistral) bind at 20 tokens."""

import sys

import pytest
import torch

import sluice
from ckpt import build
from sluice.engine.kv_cache import KVCache
from sluice.errors import ObservatoryError
from sluice.observatory import observe

CASES = {
    "llama": ("llama", {}),
    "mistral-window-6": ("mistral", {"sliding_window": 6}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gpt2": ("gpt2", {}),
    "neox": ("neox", {}),
    "gemma2-softcaps-window-8": ("gemma2", {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                                            "initializer_range": 0.3}),
    "gemma3-local-global": ("gemma3", {}),
    "olmo2": ("olmo2", {}),
}
TOL = dict(rtol=1e-5, atol=1e-5)


def ids_of(B=2, T=20, seed=3):
    return torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(seed))


def hf_eager(ref, ids, monkeypatch):
    """transformers' probabilities per layer (B, H, T, T) and, per layer, the eager function's
    inputs: query (B, H, T, D), key (B, K, T, D), the additive mask, scaling, softcap."""
    ref.set_attn_implementation("eager")
    seen = []
    for name in {type(m).__module__ for m in ref.modules() if type(m).__name__.endswith("Attention")}:
        module = sys.modules[name]
        original = module.eager_attention_forward

        def capture(mod, query, key, value, attention_mask, *args, _original=original, **kwargs):
            seen.append({"q": query.detach(), "k": key.detach(), "mask": attention_mask,
                         "scaling": kwargs.get("scaling"), "softcap": kwargs.get("softcap")})
            return _original(mod, query, key, value, attention_mask, *args, **kwargs)
        monkeypatch.setattr(module, "eager_attention_forward", capture)
    with torch.no_grad():
        out = ref(ids, output_attentions=True)
    assert len(seen) == len(out.attentions)
    return out, seen


def hf_scores(s):
    """The scores the softmax receives, from the eager function's inputs (hidden keys hugely negative)."""
    q, k = s["q"], s["k"]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    raw = (q @ k.transpose(-1, -2)) * s["scaling"]
    capped = raw if s["softcap"] is None else torch.tanh(raw / s["softcap"]) * s["softcap"]
    mask = s["mask"]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    if mask is None:
        return raw, capped
    return raw + mask[..., :raw.shape[-1]], capped + mask[..., :raw.shape[-1]]


@pytest.mark.parametrize("case", CASES)
def test_per_head_statistics_match_transformers_eager(tmp_path, monkeypatch, case):
    arch, over = CASES[case]
    ref = build(tmp_path, arch, **over)
    ids = ids_of()
    out, seen = hf_eager(ref, ids, monkeypatch)
    model = sluice.load(tmp_path)
    with torch.inference_mode():
        plain = model(ids)
    with observe(model) as obs, torch.inference_mode():
        observed = model(ids)
    assert torch.equal(plain, observed)  # the hooks only read
    assert (observed - out.logits).abs().max() < 1e-4
    got = obs.attention.per_position()  # (L, H, B, T)
    T = ids.shape[1]
    for layer, (p, s) in enumerate(zip(out.attentions, seen)):  # p (B, H, T, T)
        at = lambda name: got[name][layer].transpose(0, 1)  # noqa: E731 - (B, H, T) as transformers has it
        torch.testing.assert_close(at("entropy"), torch.special.entr(p).sum(-1), **TOL)
        torch.testing.assert_close(at("sink_mass"), p[..., 0], **TOL)
        torch.testing.assert_close(at("top_mass"), p.amax(-1), **TOL)
        top2 = p.topk(2, -1).values
        clear = (top2[..., 0] - top2[..., 1]) > 1e-4  # where the top key is unambiguous
        assert torch.equal(at("top_position")[clear], p.argmax(-1)[clear])
        raw, capped = hf_scores(s)
        torch.testing.assert_close(at("max_logit"), capped.amax(-1), **TOL)
        torch.testing.assert_close(at("max_logit_raw"), raw.amax(-1), **TOL)
        torch.testing.assert_close(at("q_norm"), s["q"].norm(dim=-1), **TOL)
        torch.testing.assert_close(got["k_norm"][layer].transpose(0, 1), s["k"].norm(dim=-1), **TOL)
        visible = (p > 0).sum(-1)[:, 0]  # (B, T): the keys transformers' mask let through
        assert torch.equal(got["keys_visible"][layer], visible)
    # the means leave out the first query (it sees only itself) and average the rest
    means = obs.attention.head_means()
    torch.testing.assert_close(means["sink_mass"], got["sink_mass"][..., 1:].mean((-1, -2)), **TOL)
    assert means["entropy"].shape == (model.config.num_layers, model.config.num_heads)
    assert means["k_norm"].shape == (model.config.num_layers, model.config.num_kv_heads)


def test_windows_and_caps_bind_in_these_cases(tmp_path):
    """The sliding windows hide keys at 20 tokens and the cap bends the scores, so the cases above
    test them: with them ignored the statistics would differ."""
    arch, over = CASES["gemma2-softcaps-window-8"]
    build(tmp_path, arch, **over)
    model = sluice.load(tmp_path)
    with observe(model) as obs, torch.inference_mode():
        model(ids_of())
    s = obs.attention.per_position()
    assert model.sliding[0] and not model.sliding[1]
    assert s["keys_visible"][0].max() == 8 and s["keys_visible"][1].max() == 20
    assert (s["max_logit_raw"] - s["max_logit"]).max() > 0.1  # the cap of 2 is active
    assert s["max_logit"].max() <= 2.0  # tanh saturates to exactly the cap in fp32


def test_a_decode_step_sees_what_the_full_forward_saw(tmp_path):
    """With a KV cache (slots beyond the prompt, a window that now hides old slots) the statistics of
    the last token equal the last row of a full forward."""
    arch, over = CASES["gemma3-local-global"]
    build(tmp_path, arch, **over)
    model = sluice.load(tmp_path)
    ids = ids_of(B=1, T=14)
    with observe(model) as obs, torch.inference_mode():
        model(ids)
        full = obs.attention.per_position()
        cache = KVCache(model.config, 1, 32, torch.float32)
        model(ids[:, :-1], cache=cache)
        model(ids[:, -1:], positions=torch.tensor([[13]]), cache=cache)
        step = obs.attention.per_position()
    for name, value in step.items():
        expected = full[name][..., -1:]
        if value.is_floating_point():
            torch.testing.assert_close(value, expected, **TOL)
        else:
            assert torch.equal(value, expected), name


def test_observe_without_attention_refuses_clearly(tmp_path):
    build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    with observe(model, attention=False) as obs, torch.inference_mode():
        model(ids_of())
    with pytest.raises(ObservatoryError, match="attention=True"):
        obs.attention.head_means()
    assert not any(m._forward_hooks for m in model.modules())  # and the probes are gone after the with
