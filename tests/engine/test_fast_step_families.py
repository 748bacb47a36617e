"""The native step (engine/fast_step.py, step.cpp) on every family sluice loads beyond the pre-norm RMSNorm
ones of test_fast_step.py: GPT-2 (LayerNorm with bias, learned positions, ungated GELU MLP), GPT-NeoX
(partial rotary, parallel residual), Gemma 2/3 ((1 + w) RMSNorm, sandwich norms, soft-caps, embedding
scale, a local RoPE base) and OLMo 2 (post norms, full-width qk-norm). Each case sets non-default values
of the fields the mapping reads. Against the torch path (test_families checks that one against
transformers): a prefill chunk and a decode step on the static cache, a run of chunks and decode steps on
a scrambled paged pool, bf16 linear weights, and greedy generation through sluice.LLM."""

import pytest
import torch

import sluice
from ckpt import build, build_with_tokenizer
from sluice import SamplingParams
from sluice.engine import fast_step, mixed
from sluice.engine.fast_step import FastStep, native_check, unsupported
from test_fast_step import BF16_DOTS, check_chunk, load, prefilled, random_model
from test_fast_step_paged import check_paged_equals_static, check_paged_matches_torch

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")

CASES = {
    "gpt2-tied": ("gpt2", {}),  # gelu_new, LayerNorm biases, learned positions, biases everywhere
    "gpt2-untied-erf-gelu-unscaled": ("gpt2", {"tie_word_embeddings": False, "activation_function": "gelu",
                                               "scale_attn_weights": False, "layer_norm_epsilon": 1e-3,
                                               "random_norms": True}),
    "neox-parallel-rotary-half": ("neox", {}),  # exact GELU, o and MLP biases
    "neox-sequential-rotary-quarter-tied": ("neox", {
        "use_parallel_residual": False, "tie_word_embeddings": True, "attention_bias": False,
        "layer_norm_eps": 1e-3, "hidden_act": "gelu_new", "random_norms": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}}),
    # caps small and weights large, so both soft-caps bend the numbers; window 8 < the positions reached
    "gemma2-softcaps-active": ("gemma2", {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 2.0,
                                          "initializer_range": 0.3}),
    "gemma2-untied-no-caps-biases": ("gemma2", {"final_logit_softcapping": None, "attn_logit_softcapping": None,
                                                "tie_word_embeddings": False, "attention_bias": True,
                                                "query_pre_attn_scalar": 32}),
    "gemma2-eps-erf-gelu": ("gemma2", {"rms_norm_eps": 1e-5, "random_norms": True, "hidden_activation": "gelu"}),
    "gemma3-local-global-rope": ("gemma3", {}),
    "gemma3-linear-rope-final-cap-mqa": ("gemma3", {
        "final_logit_softcapping": 4.0, "num_key_value_heads": 1, "layer_types":
            ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}}),
    "olmo2-untied-gqa": ("olmo2", {}),
    "olmo2-tied-mha-bias": ("olmo2", {"tie_word_embeddings": True, "num_key_value_heads": 4, "attention_bias": True}),
    "olmo2-eps": ("olmo2", {"rms_norm_eps": 1e-6, "random_norms": True}),
}


def build_live(out, arch: str, **over):
    """ckpt.build with every bias drawn too (transformers starts them at zero, where a bias step.cpp dropped
    would not show) and GPT-2's LayerNorm gains (ln_*, which ckpt.build's random_norms does not match)."""
    model = build(out, arch, **over)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif ".ln_" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    out = {}
    for name, (arch, over) in CASES.items():
        out[name] = tmp_path_factory.mktemp(name)
        build_live(out[name], arch, **over)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_family_takes_the_native_step(ckpt_dirs, name):
    model = load(ckpt_dirs[name])
    assert unsupported(model) is None
    assert native_check(model, None)[1] is not None


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [1, 5])
def test_chunk_logits_and_cache_equal_the_torch_path(ckpt_dirs, name, T):
    """Logits, final-normed hidden states and the keys and values written, after a prefill of two rows."""
    check_chunk(load(ckpt_dirs[name]), T)


@pytest.mark.parametrize("name", ["gpt2-tied", "neox-parallel-rotary-half", "gemma2-softcaps-active",
                                  "gemma3-local-global-rope", "olmo2-untied-gqa"])
def test_a_prefill_sized_chunk_equals_the_torch_path(ckpt_dirs, name):
    model = load(ckpt_dirs[name])
    # Gemma's keys reach 8-25 (embeddings scaled by sqrt(hidden)), where an fp32 ulp is 1-2e-6 and 133 tokens
    # of differently ordered sums put the last layer's keys ~10 ulps apart (measured 2.6e-6 and 1.3e-6 of the
    # scale): the bound is 5e-6 of the cache's scale there, 1e-5 absolute below a scale of 2.
    check_chunk(model, 2 * fast_step.MAX_CHUNK + 5, cache_atol=max(1e-5, 5e-6 * scale_of_cache(model)))


def scale_of_cache(model) -> float:
    """The largest key the torch path writes for a prefill of test_fast_step's prompts."""
    return float(prefilled(model).cache.k.abs().max())


@pytest.mark.parametrize("name", list(CASES))
def test_paged_pool_matches_the_torch_forward_and_the_static_cache(ckpt_dirs, name):
    """Two chunks (the second from rewound positions) and decode steps on a scrambled pool of 5-slot
    blocks, against the torch forward on a static cache; and bit for bit the native step's static run."""
    model = load(ckpt_dirs[name])
    check_paged_equals_static(model, 5)
    check_paged_matches_torch(model, 5)


@pytest.mark.parametrize("name", ["gpt2-tied", "neox-parallel-rotary-half", "gemma2-untied-no-caps-biases",
                                  "gemma3-local-global-rope", "olmo2-tied-mha-bias"])
@pytest.mark.parametrize("bf16_dot", BF16_DOTS)
def test_bf16_weights_with_fp32_compute(ckpt_dirs, name, bf16_dot, monkeypatch):
    """mixed.py's mode: bf16 linear weights (and the bf16 biases it leaves on them), everything else fp32. In the
    bf16 dot mode the torch path rounds each linear's input as the native step does; what is left is summation
    order, which can flip an input's rounding to bf16 somewhere upstream (test_fast_step_bf16_dot.py): the bound
    is then the dot mode's own against the model, 2e-2 of the largest logit."""
    monkeypatch.setattr(mixed, "BF16_DOT", bf16_dot)
    model = load(ckpt_dirs[name], "bfloat16")
    assert model.layers[0].mlp.up.weight.dtype == torch.bfloat16 and unsupported(model) is None
    if bf16_dot == "fp32":
        check_chunk(model, 3)
    else:
        check_chunk(model, 3, rtol=2e-2, cache_atol=2e-2)
    check_paged_equals_static(model, 16)


def test_learned_positions_past_the_table_are_refused(ckpt_dirs):
    model = load(ckpt_dirs["gpt2-tied"])
    rows = model.pos_embed.weight.shape[0]
    k = torch.zeros(model.config.num_layers, 1, model.config.num_kv_heads, rows + 4, model.config.head_dim)
    with pytest.raises(RuntimeError, match=f"position {rows} is past the model's {rows} learned positions"):
        FastStep(model)(torch.ones(1, 1, dtype=torch.long), torch.tensor([[rows]]), k, k.clone())


def test_surgery_on_a_soft_cap_or_a_norm_rebuilds_the_step(ckpt_dirs):
    """Surgery changes attributes and modules live: native_check builds a new step when the model is no
    longer the one its step was built over, and that step follows the torch path again."""
    model = load(ckpt_dirs["gemma2-softcaps-active"])
    _, fast = native_check(model, None)
    assert fast.current() and native_check(model, fast)[1] is fast
    model.final_softcap = 1.5
    for layer in model.layers:
        layer.attn.softcap = None
    assert not fast.current()
    why, fresh = native_check(model, fast)
    assert why is None and fresh is not fast and fresh.current()
    # keys up to ~24 here, where differently ordered sums (the AVX2 build's 8-lane products) land 1-2e-6 of the
    # scale apart (measured 2.1e-5 and 3.0e-5 absolute): the prefill test's bound, relative to the cache's scale
    check_chunk(model, 2, cache_atol=max(1e-5, 5e-6 * scale_of_cache(model)))
    model.final_norm = None
    assert native_check(model, fresh)[1] is not fresh
    check_chunk(model, 2, cache_atol=max(1e-5, 5e-6 * scale_of_cache(model)))


def test_what_stays_outside_is_refused_by_name():
    model = random_model()
    model.layers[1].mlp_norm = torch.nn.LayerNorm(model.config.hidden_size)
    assert "LayerNorm from torch.nn.modules.normalization, not layers.py's" in unsupported(model)
    model = random_model()
    model.layers[0].mlp.act = torch.relu
    assert "layer 0's MLP activation is 'relu'" in unsupported(model)
    model = random_model(hidden_act="gelu")
    model.layers[1].mlp.act = torch.nn.functional.silu
    assert "MLP activations or qk-norm widths differ" in unsupported(model)
    model = random_model(norm_kind="layer", norm_bias=True)
    assert unsupported(model) is None
    from sluice.model.layers import RMSNorm
    model.layers[0].attn_norm = RMSNorm(model.config.hidden_size, 1e-6)
    assert "mixes RMSNorm and LayerNorm" in unsupported(model)
    model = random_model(parallel_residual=True)
    assert unsupported(model) is None
    model.layers[0].mlp_post_norm = RMSNorm(model.config.hidden_size, 1e-6)
    assert "post-norms and a parallel residual" in unsupported(model)


@pytest.mark.parametrize("arch", ["gpt2", "neox", "gemma2", "gemma3", "olmo2"])
def test_greedy_generation_through_the_llm_equals_the_torch_path(tmp_path, arch):
    build_with_tokenizer(tmp_path, arch)
    prompts = ["def add(a, b):", "x", "import os\nimport sys\n"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = sluice.LLM(str(tmp_path))
    got = [o.token_ids for o in llm.generate(prompts, params)]
    forward = llm.batch_engine().scheduler.forward
    assert forward.native_reason is None and forward.use_fast
    want = [o.token_ids for o in sluice.LLM(str(tmp_path), kernels=False).generate(prompts, params)]
    assert got == want
