"""One x_0 for every analysis: the lens's row 0 is the first block's input, as observe() reads it.

TransformerLens is not a dependency here, so the reference is its convention computed on
transformers' own modules: row 0 is unembed(final_norm(x_0)), with x_0 = hidden_states[0] (the
input of the first block: wte + wpe for GPT-2, the embedding times sqrt(hidden) for Gemma), which is
the vector TransformerLens caches as blocks.0.hook_resid_pre."""

import pytest
import torch

import sluice
from ckpt import build
from sluice.observatory.attach import logit_lens, observe

# GPT-2: learned positions added to the token embedding; Gemma 2/3: a scaled embedding (Gemma 2 also
# soft-caps the final logits). A family without either is the control: there the two vectors agree anyway.
FAMILIES = ["gpt2", "gemma2", "gemma3", "qwen3"]


def _final_norm(ref):
    return ref.transformer.ln_f if hasattr(ref, "transformer") else ref.model.norm


def _unembed(ref, x):
    z = ref.lm_head(_final_norm(ref)(x)).float()
    cap = getattr(ref.config, "final_logit_softcapping", None)
    return torch.tanh(z / cap) * cap if cap else z


@pytest.mark.parametrize("arch", FAMILIES)
def test_row0_is_the_first_blocks_input(tmp_path, arch):
    ref = build(tmp_path, arch)
    model = sluice.load(tmp_path)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))
    lens = logit_lens(model, ids, topk=5)
    with torch.inference_mode():
        hf = ref(ids, output_hidden_states=True)
        x0 = hf.hidden_states[0]  # (B, T, C): TransformerLens's blocks.0.hook_resid_pre
        logp = _unembed(ref, x0).log_softmax(-1)
        p_final = hf.logits.float().softmax(-1)
        with observe(model, capacity=(2, 11)) as obs:
            model(ids)
    q = logp.exp()
    assert (lens.entropy[0] + (q * logp).sum(-1)).abs().max() < 1e-4
    kl = (p_final * (p_final.log() - logp)).sum(-1)
    assert (lens.kl[0] - kl).abs().max() < 1e-4
    assert (lens.top_probs[0] - q.topk(5).values).abs().max() < 1e-5
    assert (q.gather(-1, lens.predicted[..., None])[..., 0] - lens.predicted_prob[0]).abs().max() < 1e-5
    assert lens.mean_square[0] == pytest.approx(x0.pow(2).mean().item(), rel=1e-5)
    # the same vector as the probes' x_0: residual.rms[0] and lens[0] describe one thing
    rms0 = obs.stats["resid_rms"][0]  # (B, T)
    assert (rms0 - x0.pow(2).mean(-1).sqrt()).abs().max() < 1e-5
    assert lens.mean_square[0] == pytest.approx(rms0.pow(2).mean().item(), rel=1e-5)
    assert not model.layers[0]._forward_pre_hooks  # the capture hook is gone


def test_the_token_embedding_alone_would_differ(tmp_path):
    """The check above has teeth: on GPT-2 the token embedding alone (what the lens read before)
    gives a visibly different row 0."""
    ref = build(tmp_path, "gpt2")
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        x0 = ref(ids, output_hidden_states=True).hidden_states[0]
        wte_only = ref.transformer.wte(ids)
        h = lambda x: -(_unembed(ref, x).softmax(-1) * _unembed(ref, x).log_softmax(-1)).sum(-1)  # noqa: E731
        assert (h(x0) - h(wte_only)).abs().max() > 1e-2
