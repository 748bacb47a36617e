"""The valve probe reads the right tensors and changes nothing."""

import math

import torch

import sluice
from sluice.observatory import observe
from ckpt import build


def test_probe_matches_transformers_hidden_states_and_leaves_logits_identical(tmp_path):
    ref = build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    ids = torch.randint(0, 96, (1, 33), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids)
        with observe(model) as probe:
            probed = model(ids)
        after = model(ids)
        hf = ref(ids, output_hidden_states=True)
    assert torch.equal(plain, probed) and torch.equal(plain, after)
    assert not model.embed._forward_hooks  # removed on exit
    s = probe.summary()
    L = model.config.num_layers
    rms = lambda h: h.float().pow(2).mean(-1).sqrt().mean().item()  # noqa: E731
    # transformers' hidden_states: x_0 .. x_{L-1}, then the final norm's output.
    for i in range(L):
        assert math.isclose(s["residual_rms"][i], rms(hf.hidden_states[i]), rel_tol=1e-5)
    assert math.isclose(s["final_norm_out"], rms(hf.hidden_states[L]), rel_tol=1e-5)
    assert math.isclose(s["final_norm_in"], s["residual_rms"][L], rel_tol=1e-6)
    z = hf.logits[0, -1]
    p = z.softmax(-1)
    assert math.isclose(s["logit_max"], z.max().item(), rel_tol=1e-5)
    assert math.isclose(s["logit_min"], z.min().item(), rel_tol=1e-5)
    assert math.isclose(s["logsumexp"], z.logsumexp(-1).item(), rel_tol=1e-5)
    assert math.isclose(s["top1_prob"], p.max().item(), rel_tol=1e-5)
    assert math.isclose(s["entropy"], -(p * p.log()).sum().item(), rel_tol=1e-4)
    # what the input norm does: its output RMS is set by its weight, whatever the input's scale
    assert s["attn_norm_in"][0] == s["residual_rms"][0]
