"""sluice.observe: every statistic against an independent computation on transformers' own modules,
logits untouched (eager and compiled), non-finite values traced to their origin."""

import math

import pytest
import torch

import sluice
from ckpt import ARCHS, build
from sluice.engine import Runner
from sluice.errors import ObservatoryError
from sluice.observatory import observe


def rms(x):
    return x.float().flatten(2).pow(2).mean(-1).sqrt()  # (B, T)


# Per family: where transformers keeps the blocks and the final norm, and which of its modules is
# which sluice site (norms by sluice name; the two branches).
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_GEMMA_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
HF_LAYOUT = {
    "gpt2": ("transformer", "h", "ln_f", {"attn_norm": "ln_1", "mlp_norm": "ln_2"}, "attn", "mlp"),
    "neox": ("gpt_neox", "layers", "final_layer_norm", _LLAMA_NORMS, "attention", "mlp"),
    "gemma2": ("model", "layers", "norm", _GEMMA_NORMS, "self_attn", "mlp"),
    "gemma3": ("model", "layers", "norm", _GEMMA_NORMS, "self_attn", "mlp"),
    "olmo2": ("model", "layers", "norm", {"attn_post_norm": "post_attention_layernorm",
                                          "mlp_post_norm": "post_feedforward_layernorm"}, "self_attn", "mlp"),
}


def hf_reference(ref, ids, arch):
    """Everything the probe measures, read off transformers' modules with hooks of our own."""
    seen = {}

    def keep(name, which="out"):
        def hook(_m, args, kwargs, out):  # some modules are called with hidden_states=...
            out = out[0] if isinstance(out, tuple) else out
            inp = args[0] if args else kwargs.get("hidden_states")
            seen[name] = (inp.detach(), out.detach()) if which == "both" else out.detach()
        return hook

    base, blocks, final, norms, attn, mlp = HF_LAYOUT.get(arch, ("model", "layers", "norm", _LLAMA_NORMS,
                                                                 "self_attn", "mlp"))
    inner = getattr(ref, base)
    layers = getattr(inner, blocks)
    handles = [layers[-1].register_forward_hook(with_kwargs=True, hook=keep("x_L")),
               getattr(inner, final).register_forward_hook(with_kwargs=True, hook=keep("final_norm", "both"))]
    for i, layer in enumerate(layers):
        for ours, theirs in norms.items():
            handles.append(getattr(layer, theirs).register_forward_hook(with_kwargs=True, hook=keep(f"layers.{i}.{ours}", "both")))
        handles.append(getattr(layer, attn).register_forward_hook(with_kwargs=True, hook=keep(f"layers.{i}.attn", "both")))
        handles.append(getattr(layer, mlp).register_forward_hook(with_kwargs=True, hook=keep(f"layers.{i}.mlp", "both")))
        att = getattr(layer, attn)
        if hasattr(att, "q_norm"):
            handles.append(att.q_norm.register_forward_hook(with_kwargs=True, hook=keep(f"layers.{i}.attn.q_norm", "both")))
            handles.append(att.k_norm.register_forward_hook(with_kwargs=True, hook=keep(f"layers.{i}.attn.k_norm", "both")))
    try:
        out = ref(ids, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return out, seen


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_statistic_matches_transformers(tmp_path, arch):
    ref = build(tmp_path, arch)
    model = sluice.load(tmp_path)
    L = model.config.num_layers
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        hf, seen = hf_reference(ref, ids, arch)
        with observe(model, topk=3) as obs:
            model(ids)
    s = obs.stats
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    # the residual stream per layer AND per token: x_0..x_{L-1} are hidden_states[0..L-1] (HF's
    # hidden_states[L] is after the final norm, so x_L comes from a hook on HF's last layer)
    streams = list(hf.hidden_states[:L]) + [seen["x_L"]]
    assert s["resid_rms"].shape == (L + 1, 2, 29)
    for layer, x in enumerate(streams):
        close(s["resid_rms"][layer], rms(x))
        close(s["resid_var"][layer], x.var(-1, correction=0))
        top = x.abs().topk(3, dim=-1)
        close(s["resid_absmax"][layer], top.values[..., 0])
        assert torch.equal(s["resid_top_channels"][layer], top.indices)
        close(s["resid_top_values"][layer], x.gather(-1, top.indices))
    # every norm: RMS in and out, hence the gain
    branches = {f"layers.{i}.{b}" for i in range(L) for b in ("attn", "mlp")}
    assert set(obs.norm_names) == {k for k, v in seen.items() if isinstance(v, tuple)} - branches
    for j, name in enumerate(obs.norm_names):
        x_in, x_out = seen[name]
        if x_in.dim() == 4 and x_in.shape[1] != 29:  # Gemma 3 normalises q/k laid out (B, heads, T, D)
            x_in, x_out = x_in.transpose(1, 2), x_out.transpose(1, 2)
        close(s["norm_in_rms"][j], rms(x_in))
        close(s["norm_out_rms"][j], rms(x_out))
        # (Gemma's padding token embeds to zeros: a zero input, where the gain is 0 / tiny)
        close(obs.norm_gain()[j], rms(x_out) / rms(x_in).clamp_min(torch.finfo(torch.float32).tiny))
    # branches and their ratio to the stream they join: what is added is the post-norm's output
    # where there is one (Gemma, OLMo 2); the stream is the pre-norm's input, or the branch's own
    # input where no norm precedes it (OLMo 2)
    for j, name in enumerate(obs.branch_names):
        close(s["branch_rms"][j], rms(seen[name][1]))
        added = seen[name + "_post_norm"][1] if name + "_post_norm" in seen else seen[name][1]
        stream = seen[name + "_norm"][0] if name + "_norm" in seen else seen[name][0]
        close(obs.branch_ratio()[j], rms(added) / rms(stream).clamp_min(torch.finfo(torch.float32).tiny))
    # logits per position
    z = hf.logits
    logp = z.log_softmax(-1)
    expected = torch.stack([z.amax(-1), z.amin(-1), z.std(-1, correction=0), z.logsumexp(-1),
                            -(logp.exp() * logp).sum(-1), logp.exp().amax(-1)])
    close(s["logits"], expected)
    assert torch.equal(s["top1_id"], z.argmax(-1))
    assert obs.first_nonfinite() is None and int(s["nonfinite"].sum()) == 0


@pytest.mark.slow
def test_logits_bit_identical_eager_and_compiled(tmp_path):
    build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    ids = torch.randint(0, 96, (1, 21), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids)
        with observe(model) as eager_obs:
            probed = model(ids)
        eager_stats = {k: v.clone() for k, v in eager_obs.stats.items()}
        assert torch.equal(plain, probed)
        assert not model.embed._forward_hooks and not model._forward_pre_hooks  # all removed on exit

        # Two fresh traces, whatever earlier tests compiled (dynamo keeps the shapes it saw per code object): in
        # the full suite, not alone, the two once differed in the last bits; the message below says by how much.
        torch._dynamo.reset()
        compiled_plain = torch.compile(model, fullgraph=True)(ids)
        torch._dynamo.reset()
        with observe(model) as obs:
            compiled = torch.compile(model, fullgraph=True)
            compiled_probed = compiled(ids)
        torch._dynamo.reset()
    assert torch.equal(compiled_plain, compiled_probed), \
        f"max |diff| {(compiled_plain - compiled_probed).abs().max():.3g}, {torch.get_num_threads()} threads"
    assert (compiled_probed - plain).abs().max() <= 1e-5
    # the hooks ran inside the compiled graph and measured the same thing
    for k, v in eager_stats.items():
        if k == "resid_top_channels":
            assert (obs.stats[k] == v).float().mean() > 0.99  # near-ties may swap order
        elif v.is_floating_point():
            torch.testing.assert_close(obs.stats[k], v, rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(obs.stats[k], v), k


@pytest.mark.slow
def test_compiled_decode_step_runs_the_probes(tiny_llm):
    """The engine's compiled decode step (T = 1 after a T = 4 prefill) measures what eager does."""
    model = tiny_llm.model

    def run(compile):
        with observe(model) as obs:
            runner = Runner(model, compile=compile)
            runner.prefill([[5, 6, 7, 8]], 64)
            assert obs.shape == (1, 4)
            steps, tok = [], torch.tensor([9])
            for _ in range(2):
                logits = runner.step(tok)
                assert obs.shape == (1, 1)
                torch.testing.assert_close(obs.stats["logits"][3, 0, 0], logits[0].logsumexp(-1))
                steps.append({k: v.clone() for k, v in obs.stats.items()})
                tok = logits.argmax(-1)
            runner.release()
        return steps

    eager = run(compile=False)
    torch._dynamo.reset()
    compiled = run(compile=True)
    torch._dynamo.reset()
    assert not torch.equal(eager[0]["resid_rms"], eager[1]["resid_rms"])  # each step is its own
    for e, c in zip(eager, compiled):
        for k in ("resid_rms", "resid_var", "norm_in_rms", "norm_out_rms", "branch_rms", "logits"):
            torch.testing.assert_close(c[k], e[k], rtol=1e-4, atol=1e-5)
        assert torch.equal(c["nonfinite"], e["nonfinite"]) and not c["nonfinite"].any()


def _poison_output(module, batch, position, channel, value=float("nan")):
    def hook(_m, _inputs, out):
        out = out.clone()
        out[batch, position, channel] = value
        return out
    return module.register_forward_hook(hook)


def test_injected_nan_is_reported_at_its_layer_module_and_position(tmp_path):
    build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    ids = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    handle = _poison_output(model.layers[1].attn.v, batch=1, position=9, channel=2)
    try:
        with torch.inference_mode(), observe(model) as obs:
            logits = model(ids)
    finally:
        handle.remove()
    assert torch.isnan(logits[1, 9:]).all()  # it really broke the output
    assert obs.first_nonfinite() == {"module": "layers.1.attn.v", "layer": 1, "batch": 1,
                                     "position": 9, "positions": 1, "total": obs.first_nonfinite()["total"]}
    # nothing upstream of it is flagged, and in v itself only that one value. (Downstream, even
    # positions < 9 turn NaN: attention multiplies the masked-out value rows by probability 0, and
    # 0 * NaN is NaN, so the poison leaks backwards in time. The origin is still exact.)
    s = obs.stats["nonfinite"]
    j = obs.sites.tracked.index("layers.1.attn.v")
    assert int(s[:j].sum()) == 0 and int(s[j].sum()) == 1 and int(s[j, 1, 9]) == 1


def test_poisoned_weight_and_inf_embedding_are_located(tmp_path):
    build(tmp_path, "llama")
    model = sluice.load(tmp_path)
    ids = torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11]])
    with torch.inference_mode():
        model.layers[2].mlp.up.weight[7, 3] = float("nan")
        with observe(model) as obs:
            model(ids)
        assert obs.first_nonfinite()["module"] == "layers.2.mlp.up"
        assert obs.first_nonfinite()["layer"] == 2 and obs.first_nonfinite()["position"] == 0
        # x_3 (after the poisoned MLP) is NaN everywhere: no channel to rank there, and no crash
        layers = {r["layer"] for r in obs.massive_activations()}
        assert layers == {0, 1, 2}
        model.layers[2].mlp.up.weight[7, 3] = 0.0
        model.embed.weight[8, 0] = float("inf")  # token 8 sits at position 4
        with observe(model) as obs:
            model(ids)
    got = obs.first_nonfinite()
    assert (got["module"], got["layer"], got["position"]) == ("embed", None, 4)
    # the other views still answer on a broken forward: inf ranks as the biggest activation
    rows = obs.massive_activations()
    assert rows[0]["layer"] == 0 and rows[0]["channel"] == 0 and rows[0]["value"] == float("inf")
    assert rows[0]["position"] == 4


def test_massive_activation_is_found(tmp_path):
    build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    handle = _poison_output(model.layers[0], batch=0, position=4, channel=13, value=80.0)
    try:
        with torch.inference_mode(), observe(model) as obs:
            model(ids)
    finally:
        handle.remove()
    rows = [r for r in obs.massive_activations() if r["layer"] == 1]  # x_1 is layers[0]'s output
    top = rows[0]
    assert (top["channel"], top["position"], top["value"]) == (13, 4, 80.0)
    assert top["ratio_to_rms"] > 5
    for later in range(2, model.config.num_layers + 1):  # the residual stream carries it on
        best = [r for r in obs.massive_activations() if r["layer"] == later][0]
        assert best["channel"] == 13 and best["position"] == 4


def test_capacity_grows_and_size_is_checked_before_allocating(tmp_path):
    build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    with torch.inference_mode(), observe(model, capacity=(1, 8)) as obs:
        model(torch.zeros(1, 5, dtype=torch.long))
        assert obs.stats["resid_rms"].shape[1:] == (1, 5)
        model(torch.zeros(3, 40, dtype=torch.long))  # bigger than the capacity: re-allocated
        assert obs.stats["resid_rms"].shape[1:] == (3, 40)
        model(torch.zeros(1, 2, dtype=torch.long))
        assert obs.stats["resid_rms"].shape[1:] == (1, 2)
    with observe(model, capacity=(1, 4)) as obs:
        with torch.inference_mode():
            model(torch.zeros(1, 10, dtype=torch.long))  # grown inside inference mode ...
        with torch.no_grad():
            model(torch.zeros(1, 3, dtype=torch.long))  # ... and still writable outside it
        assert obs.stats["resid_rms"].shape[1:] == (1, 3)
    need = obs.bytes_for(4, 1000)
    with pytest.raises(ObservatoryError, match="4 x 1000 tokens needs"):
        observe(model, capacity=(4, 1000), max_bytes=need - 1)
    with pytest.raises(ObservatoryError, match="topk"):
        observe(model, topk=0)
    with pytest.raises(ObservatoryError, match="nothing observed"):
        observe(model).stats


def test_summary_and_records_agree_with_stats(tmp_path):
    ref = build(tmp_path, "qwen3")
    model = sluice.load(tmp_path)
    ids = torch.randint(0, 96, (1, 33), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with observe(model) as probe:
            model(ids)
        hf = ref(ids, output_hidden_states=True)
    s = probe.summary()
    L = model.config.num_layers
    mean_rms = lambda h: h.float().pow(2).mean(-1).sqrt().mean().item()  # noqa: E731
    for i in range(L):
        assert math.isclose(s["residual_rms"][i], mean_rms(hf.hidden_states[i]), rel_tol=1e-5)
    assert math.isclose(s["final_norm_out"], mean_rms(hf.hidden_states[L]), rel_tol=1e-5)
    assert math.isclose(s["final_norm_in"], s["residual_rms"][L], rel_tol=1e-6)
    z = hf.logits[0, -1]
    p = z.softmax(-1)
    assert math.isclose(s["logit_max"], z.max().item(), rel_tol=1e-5)
    assert math.isclose(s["logsumexp"], z.logsumexp(-1).item(), rel_tol=1e-5)
    assert math.isclose(s["top1_prob"], p.max().item(), rel_tol=1e-5)
    assert math.isclose(s["entropy"], -(p * p.log()).sum().item(), rel_tol=1e-4)
    rows = probe.to_records()
    kinds = [r["kind"] for r in rows]
    T, n_norms = 33, len(probe.norm_names)
    assert kinds.count("residual") == (L + 1) * T and kinds.count("norm") == n_norms * T
    assert kinds.count("branch") == 2 * L * T and kinds.count("logits") == T
    r = next(r for r in rows if r["kind"] == "residual" and r["layer"] == 2 and r["position"] == 7)
    assert math.isclose(r["rms"], rms(hf.hidden_states[2])[0, 7].item(), rel_tol=1e-5)
