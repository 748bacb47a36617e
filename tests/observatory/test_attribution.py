"""Attribution (observatory/attribution.py) against a manual computation on transformers' own modules,
every family: each branch's addition read off transformers' blocks, the final norm's scale frozen
from transformers' x_L, its gain and the LM head's rows from transformers' parameters."""

import pytest
import torch

import sluice
from ckpt import build
from sluice.errors import ObservatoryError
from sluice.observatory import observe

# family -> (decoder attribute, blocks, final norm, what attention adds, what the MLP adds); "post:" = a
# post-norm of the block whose output is what gets added
LAYOUT = {
    "gpt2": ("transformer", "h", "ln_f", "attn", "mlp"),
    "neox": ("gpt_neox", "layers", "final_layer_norm", "attention", "mlp"),
    "gemma2": ("model", "layers", "norm", "post_attention_layernorm", "post_feedforward_layernorm"),
    "gemma3": ("model", "layers", "norm", "post_attention_layernorm", "post_feedforward_layernorm"),
    "olmo2": ("model", "layers", "norm", "post_attention_layernorm", "post_feedforward_layernorm"),
}
CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gpt2": ("gpt2", {}),
    "neox-parallel": ("neox", {}),
    "neox-sequential": ("neox", {"use_parallel_residual": False}),
    "gemma2-final-cap": ("gemma2", {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 2.0}),
    "gemma3": ("gemma3", {}),
    "olmo2": ("olmo2", {}),
}


def hf_parts(ref, arch, ids):
    """x_0, each branch's addition (2L, B, T, C), x_L and the logits, read with hooks of our own."""
    base, blocks, final, attn, mlp = LAYOUT.get(arch, ("model", "layers", "norm", "self_attn", "mlp"))
    decoder = getattr(ref, base)
    layers = getattr(decoder, blocks)
    seen = {}

    def keep(key, pre=False):
        def hook(_m, args, kwargs, out=None):
            x = (args[0] if args else kwargs["hidden_states"]) if pre else (out[0] if isinstance(out, tuple) else out)
            seen[key] = x.detach().double()
        return hook

    handles = [layers[0].register_forward_pre_hook(keep("x0", pre=True), with_kwargs=True),
               getattr(decoder, final).register_forward_pre_hook(keep("xL", pre=True), with_kwargs=True)]
    for i, layer in enumerate(layers):
        handles += [getattr(layer, attn).register_forward_hook(keep(2 * i), with_kwargs=True),
                    getattr(layer, mlp).register_forward_hook(keep(2 * i + 1), with_kwargs=True)]
    with torch.no_grad():
        logits = ref(ids).logits
    for h in handles:
        h.remove()
    return seen["x0"], torch.stack([seen[j] for j in range(2 * len(layers))]), seen["xL"], logits, \
        getattr(decoder, final)


def hf_direct_logit_attribution(ref, norm, arch, x0, branches, xL, target):
    """The frozen-scale attribution written out from transformers' parameters."""
    W = ref.get_output_embeddings().weight.detach().double()[target]  # (B, T, C)
    parts = torch.cat([x0[None], branches])  # (1 + 2L, B, T, C)
    if isinstance(norm, torch.nn.LayerNorm):
        sigma = (xL.var(-1, correction=0) + norm.eps).sqrt()
        parts = parts - parts.mean(-1, keepdim=True)
        gain, bias = norm.weight.double(), (W * norm.bias.double()).sum(-1)[None]
    else:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        sigma = (xL.square().mean(-1) + eps).sqrt()
        gain = norm.weight.double() + (1.0 if arch.startswith("gemma") else 0.0)
        bias = torch.zeros((0, *target.shape), dtype=torch.float64)
    contribution = (parts * (W * gain / sigma[..., None])).sum(-1)
    with torch.no_grad():
        own = (norm(xL.float()).double() * W).sum(-1)  # transformers' final norm, then the head's row
    return torch.cat([contribution, bias]), own


@pytest.mark.parametrize("case", CASES)
def test_attribution_matches_a_computation_on_transformers_modules(tmp_path, case):
    arch, over = CASES[case]
    ref = build(tmp_path, arch, **over)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    x0, branches, xL, logits, norm = hf_parts(ref, arch, ids)
    target = logits.argmax(-1)  # transformers' own greedy next token at every position
    expected, own = hf_direct_logit_attribution(ref, norm, arch, x0, branches, xL, target)
    # the reference itself: its parts add up to transformers' logit (before the cap, where there is one)
    torch.testing.assert_close(expected.sum(0), own, rtol=1e-6, atol=1e-6)
    cap = ref.config.get_text_config().final_logit_softcapping if arch.startswith("gemma") else None
    capped = own if cap is None else torch.tanh(own / cap) * cap
    torch.testing.assert_close(capped.float(), logits.gather(-1, target[..., None])[..., 0], rtol=1e-5, atol=1e-5)

    model = sluice.load(tmp_path)
    with observe(model, attribution=True) as obs, torch.inference_mode():
        model(ids)
    a = obs.attribution(target)
    L = model.config.num_layers
    assert a.components[:3] == ["embed", "layers.0.attn", "layers.0.mlp"] and len(a.components) == len(expected)
    assert a.components[-1] == ("final_norm.bias" if isinstance(norm, torch.nn.LayerNorm) else f"layers.{L - 1}.mlp")
    assert "frozen" in a.note and "soft-cap" in a.note
    lg = a.logit
    assert torch.equal(lg["target"], target)
    torch.testing.assert_close(lg["contribution"].double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lg["sum"], lg["logit"], rtol=1e-5, atol=1e-5)  # the identity
    torch.testing.assert_close(lg["logit"].double(), own, rtol=1e-4, atol=1e-4)

    # growth: the change of mean square each branch causes, from transformers' own streams
    C = x0.shape[-1]
    ms = lambda x: x.square().mean(-1)  # noqa: E731
    stream, deltas = x0, []
    for i in range(L):
        a_i, m_i = branches[2 * i], branches[2 * i + 1]
        if model.config.parallel_residual:
            half = (a_i * m_i).sum(-1) / C
            deltas += [ms(stream + a_i) - ms(stream) + half, ms(stream + m_i) - ms(stream) + half]
            stream = stream + a_i + m_i
        else:
            deltas.append(ms(stream + a_i) - ms(stream))
            deltas.append(ms(stream + a_i + m_i) - ms(stream + a_i))
            stream = stream + a_i + m_i
    g = a.growth
    scale = ms(xL).max()
    torch.testing.assert_close(g["delta_mean_square"].double(), torch.stack(deltas), rtol=1e-4, atol=1e-5 * scale)
    # the identity: ms(x_0) + every branch's delta = ms(x_L), the growth fit's last point
    resid_ms = obs.stats["resid_rms"].double().square()  # (L+1, B, T)
    torch.testing.assert_close(g["mean_square"][0].double() + g["delta_mean_square"].double().sum(0), resid_ms[-1],
                               rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(g["mean_square"].double(), resid_ms, rtol=1e-5, atol=1e-5 * scale)
    along = (x0 * branches[0]).sum(-1) / x0.norm(dim=-1)  # block 0's attention along x_0
    torch.testing.assert_close(g["along_stream"][0].double(), along, rtol=1e-4, atol=1e-5)


def test_targets_and_refusals(tmp_path):
    build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    with observe(model, attribution=True) as obs, torch.inference_mode():
        logits = model(ids)
    default = obs.attribution()
    assert torch.equal(default.logit["target"], logits.argmax(-1))  # the model's own top-1 per position
    one = obs.attribution(7)
    assert torch.equal(one.logit["target"], torch.full((1, 6), 7))
    torch.testing.assert_close(one.logit["logit"], logits[..., 7], rtol=1e-5, atol=1e-5)
    with pytest.raises(ObservatoryError, match=r"\[0, 96\)"):
        obs.attribution(96)
    with pytest.raises(ObservatoryError, match="target must be"):
        obs.attribution("7")
    with pytest.raises(ObservatoryError, match=r"\(1, 6\)"):
        obs.attribution(torch.zeros(2, 6, dtype=torch.long))
    with observe(model) as plain, torch.inference_mode():
        model(ids)
    with pytest.raises(ObservatoryError, match="attribution=True"):
        plain.attribution()
    with pytest.raises(ObservatoryError, match="attribution of 1 x 1000 tokens needs 2 MiB"):
        observe(model, attribution=True, capacity=(1, 1000), max_bytes=1 << 20)
