"""The logit lens reproduces the model at the last layer and transformers' hidden states before it."""

import pytest
import torch

import sluice
from ckpt import build
from sluice.errors import ObservatoryError
from sluice.observatory.attach import logit_lens
from sluice.observatory.lens import head_logits

FAMILIES = [("qwen3", {}), ("llama", {"tie_word_embeddings": True})]


def _ids(B, T, seed=0):
    return torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=FAMILIES, ids=[f for f, _ in FAMILIES])
def pair(request, tmp_path):
    arch, overrides = request.param
    ref = build(tmp_path, arch, **overrides)
    return ref, sluice.load(tmp_path)


def test_last_layer_is_the_model_and_matches_transformers(pair):
    ref, model = pair
    ids = _ids(1, 21)
    lens = logit_lens(model, ids, topk=5)
    L = model.config.num_layers
    assert lens.top_ids.shape == (L + 1, 1, 21, 5) and lens.kl.shape == (L + 1, 1, 21)
    assert not model.embed._forward_hooks and not model.layers[0]._forward_hooks
    with torch.inference_mode():
        own = model(ids)
        hf = ref(ids, output_hidden_states=True)
    assert torch.equal(lens.final_logits, own)
    assert torch.equal(lens.predicted, own.argmax(-1))
    p = own.softmax(-1)
    assert (lens.top_probs[L] - p.topk(5).values).abs().max() < 1e-6
    assert torch.equal(lens.top_ids[L], p.topk(5).indices)
    assert lens.kl[L].abs().max() < 1e-6
    assert (lens.predicted_prob[L] - p.max(-1).values).abs().max() < 1e-6

    # Independent reference: transformers' hidden_states[l] (= x_l for l < L; hidden_states[L] is
    # already after the final norm) through transformers' own norm and LM head.
    with torch.inference_mode():
        for l in range(L + 1):
            z = hf.logits if l == L else ref.lm_head(ref.model.norm(hf.hidden_states[l]))
            logp = z.float().log_softmax(-1)
            q = logp.exp()
            assert (lens.top_probs[l] - q.topk(5).values).abs().max() < 1e-5  # tie-proof
            assert (q.gather(-1, lens.top_ids[l]) - lens.top_probs[l]).abs().max() < 1e-5
            assert (q.gather(-1, lens.predicted[..., None])[..., 0] - lens.predicted_prob[l]).abs().max() < 1e-5
            assert (lens.entropy[l] + (q * logp).sum(-1)).abs().max() < 1e-4
            kl = (p * (p.log() - logp)).sum(-1)
            assert (lens.kl[l] - kl).abs().max() < 1e-4
            if l < L:
                assert (head_logits(model, hf.hidden_states[l]) - z).abs().max() < 1e-4
                ms = hf.hidden_states[l].pow(2).mean()
                assert lens.mean_square[l] == pytest.approx(ms.item(), rel=1e-5)
    assert lens.kl[0].mean() > lens.kl[L].mean()  # the embeddings alone are not the answer


def test_head_logits_without_final_norm_is_the_raw_stream(pair):
    _, model = pair
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.inference_mode():
        raw = head_logits(model, x, final_norm=False)
        assert torch.allclose(raw, x @ model.lm_head.weight.T, atol=1e-5)
        assert not torch.allclose(raw, head_logits(model, x))


def test_batch_of_two_equals_one_by_one(pair):
    _, model = pair
    ids = _ids(2, 13, seed=1)
    both = logit_lens(model, ids, topk=3)
    for b in range(2):
        one = logit_lens(model, ids[b:b + 1], topk=3)
        for name in ("top_probs", "predicted_prob", "kl", "entropy"):
            assert (getattr(both, name)[:, b] - getattr(one, name)[:, 0]).abs().max() < 1e-5, name
        assert torch.equal(both.predicted[b], one.predicted[0])


def test_memory_guard_and_bad_input(tmp_path):
    build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    with pytest.raises(ObservatoryError, match=r"needs .* MiB.*max_bytes"):
        logit_lens(model, _ids(2, 64), max_bytes=1 << 10)
    with pytest.raises(ObservatoryError, match="topk"):
        logit_lens(model, _ids(1, 4), topk=0)
    with pytest.raises(ObservatoryError, match=r"\(B, T\)"):
        logit_lens(model, _ids(1, 4)[0])
    with pytest.raises(IndexError):  # an id past the vocabulary fails inside the forward...
        logit_lens(model, torch.tensor([[5, 1000]]))
    assert not model.embed._forward_hooks  # ...and the hooks are gone anyway
    assert all(not block._forward_hooks for block in model.layers)
    assert not model.layers[0]._forward_pre_hooks


def test_chunked_positions_give_the_same_lens(pair, monkeypatch):
    """The lens works through chunks of positions (lens.CHUNK_LOGITS); cutting 2 x 13 positions
    into chunks of 5 changes no number."""
    from sluice.observatory import lens as lens_mod
    _, model = pair
    ids = _ids(2, 13, seed=2)
    whole = logit_lens(model, ids, topk=4)
    monkeypatch.setattr(lens_mod, "CHUNK_LOGITS", 5 * model.config.vocab_size)
    assert lens_mod.chunk_rows(model.config.vocab_size) == 5
    chunked = logit_lens(model, ids, topk=4)
    for name in ("top_ids", "top_probs", "predicted_prob", "kl", "entropy", "mean_square", "predicted"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert torch.allclose(a.float(), b.float(), atol=1e-6), name
