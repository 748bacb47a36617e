"""Every school of norm against transformers: GPT-2 and GPT-NeoX (LayerNorm), Gemma 2/3 ((1 + w)
RMSNorm, sandwich norms, soft-caps, local/global layers), OLMo 2 (reordered norm, full-width q/k
norm). Logits, greedy decoding through the KV cache, bf16, batching, and refused configs."""

import json

import pytest
import torch

import sluice
from ckpt import build, build_with_tokenizer, hf_greedy
from sluice import RequestError, SamplingParams
from sluice.engine import Runner
from sluice.errors import ConfigError

# Each case names the valves it exercises. Non-default values for every field the mapping reads.
CASES = {
    "gpt2-tied": ("gpt2", {}),
    "gpt2-untied-erf-gelu-unscaled": ("gpt2", {"tie_word_embeddings": False, "activation_function": "gelu",
                                               "scale_attn_weights": False, "layer_norm_epsilon": 1e-3}),
    "neox-parallel-rotary-half-untied": ("neox", {}),
    "neox-sequential-rotary-quarter-tied": ("neox", {
        "use_parallel_residual": False, "tie_word_embeddings": True, "attention_bias": False,
        "layer_norm_eps": 1e-3, "hidden_act": "gelu_new",
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}}),
    # caps small and weights large, so both soft-caps bend the numbers; window 8 < the 40 tokens
    "gemma2-softcaps-active": ("gemma2", {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 2.0,
                                          "initializer_range": 0.3}),
    "gemma2-untied-no-caps-biases": ("gemma2", {"final_logit_softcapping": None, "attn_logit_softcapping": None,
                                                "tie_word_embeddings": False, "attention_bias": True,
                                                "query_pre_attn_scalar": 32}),
    "gemma3-local-global-rope": ("gemma3", {}),
    "gemma3-linear-rope-final-cap-mqa": ("gemma3", {
        "final_logit_softcapping": 4.0, "num_key_value_heads": 1, "layer_types":
            ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}}),
    "olmo2-untied-gqa": ("olmo2", {}),
    "olmo2-tied-mha-bias": ("olmo2", {"tie_word_embeddings": True, "num_key_value_heads": 4,
                                      "attention_bias": True}),
    # eps away from each family's default, with live norm gains (see ckpt.build's random_norms)
    "gemma2-eps-erf-gelu": ("gemma2", {"rms_norm_eps": 1e-5, "random_norms": True, "hidden_activation": "gelu"}),
    "olmo2-eps": ("olmo2", {"rms_norm_eps": 1e-6, "random_norms": True}),
    "gemma3-eps-untied-erf-gelu": ("gemma3", {"rms_norm_eps": 1e-5, "random_norms": True, "tie_word_embeddings": False,
                                              "hidden_activation": "gelu"}),
}


def max_diff(a, b):
    return (a - b).abs().max().item()


def ids_of(B=2, T=40, seed=1):
    return torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_fp32(tmp_path, case):
    arch, over = CASES[case]
    ref = build(tmp_path, arch, **over)
    ids = ids_of()
    with torch.no_grad():
        expected = ref(ids).logits
    got = sluice.load(tmp_path)(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert max_diff(got, expected) <= 1e-4, case


def test_soft_caps_are_active_in_the_capped_case(tmp_path):
    """The caps matter in the test above: without them sluice would be far off (and exceed 3)."""
    arch, over = CASES["gemma2-softcaps-active"]
    ref = build(tmp_path, arch, **over)
    ids = ids_of()
    with torch.no_grad():
        expected = ref(ids).logits
    model = sluice.load(tmp_path)
    assert model.config.final_softcap == 3.0 and model.config.attn_softcap == 2.0
    assert expected.abs().max() < 3.0
    model.final_softcap = None
    uncapped = model(ids)
    assert uncapped.abs().max() > 3.0 and max_diff(uncapped, expected) > 1.0
    model.final_softcap = 3.0
    for layer in model.layers:
        layer.attn.softcap = None
    assert max_diff(model(ids), expected) > 0.1


@pytest.mark.parametrize("case", ["gpt2-tied", "neox-parallel-rotary-half-untied",
                                  "neox-sequential-rotary-quarter-tied", "gemma2-softcaps-active",
                                  "gemma3-local-global-rope", "olmo2-untied-gqa"])
def test_cached_greedy_decoding_matches_transformers(tmp_path, case):
    """sluice's KV-cached decode (prefill + steps) against transformers' generate; 26 tokens run far
    past Gemma's window of 8, so the cache's sliding mask is exercised too."""
    arch, over = CASES[case]
    ref = build(tmp_path, arch, **over)
    prompt = torch.tensor([[1, 5, 9, 33, 60, 7]])
    expected = hf_greedy(ref, prompt, 20)
    runner = Runner(sluice.load(tmp_path))
    logits = runner.prefill([prompt[0].tolist()], 64)
    got = []
    for _ in range(20):
        tok = logits.argmax(-1)
        got.append(int(tok))
        logits = runner.step(tok)
    assert got == expected


# Relative to the largest logit. 1e-3: the same bf16 math in the same cast order (measured: bit-
# identical; the bound only allows for kernel order). Looser where sluice deliberately keeps fp32:
# the final soft-cap (transformers caps bf16 logits, sluice caps them in fp32), and Gemma 2 without
# soft-caps, where transformers still runs its eager attention (bf16 probabilities) and sluice SDPA.
# GPT-2 with scale_attn_weights=false goes through a different transformers attention path.
BF16_BOUND = {"gpt2-untied-erf-gelu-unscaled": 0.01, "gemma2-softcaps-active": 0.01, "gemma2-eps-erf-gelu": 0.01,
              "gemma2-untied-no-caps-biases": 0.05, "gemma3-linear-rope-final-cap-mqa": 0.01}


@pytest.mark.parametrize("case", CASES)
def test_bf16_matches_transformers_bf16(tmp_path, case):
    arch, over = CASES[case]
    build(tmp_path, arch, **over)
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = ids_of(1, 40)
    with torch.no_grad():
        expected = ref(ids).logits.float()
    got = sluice.load(tmp_path, dtype="bfloat16")(ids)
    assert max_diff(got, expected) <= BF16_BOUND.get(case, 1e-3) * expected.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "neox", "gemma2", "gemma3", "olmo2"])
def test_engine_on_every_family(tmp_path, arch):
    """Batched generation equals one by one, and the cached decode equals full recompute."""
    build_with_tokenizer(tmp_path, arch)
    llm = sluice.LLM(str(tmp_path))
    prompts = [[5, 17, 99, 230, 4, 61, 7, 8, 9, 10, 11], [3], [40, 41, 42]]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    batched = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batched, strict=True):
        assert out.token_ids == llm.generate([prompt], params)[0].token_ids
        ids = list(prompt)
        with torch.inference_mode():
            for tok in out.token_ids:
                assert int(llm.model(torch.tensor([ids]))[0, -1].argmax()) == tok
                ids.append(tok)


def test_learned_positions_bound_the_context(tmp_path):
    """GPT-2 has n_positions rows of position embeddings and no more: longer is refused, and a
    request that ends exactly at the limit runs."""
    build_with_tokenizer(tmp_path, "gpt2", max_position_embeddings=80)  # = n_positions
    llm = sluice.LLM(str(tmp_path))
    assert llm.max_model_len == 80
    with pytest.raises(RequestError, match="do not fit the context of 80"):
        llm.generate([list(range(3, 73))], SamplingParams(max_tokens=11, ignore_eos=True))
    outs = llm.generate([list(range(3, 73)), [5, 6]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [10, 10]


def _config(tmp_path, arch, **changes):
    build(tmp_path, arch)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("arch, changes, message", [
    ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal"),
    ("gemma3", {"vision_config": {"hidden_size": 8}}, "vision_config"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"layer_types": ["sliding_attention"]}, "layer_types"),
    ("gemma2", {"hidden_activation": "relu2"}, "hidden_activation 'relu2'"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ("neox", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ("neox", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}}, "partial_rotary_factor"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding-window layers"),
])
def test_unsupported_settings_of_listed_families_are_refused(tmp_path, arch, changes, message):
    _config(tmp_path, arch, **changes)
    with pytest.raises(ConfigError, match=message):
        sluice.load(tmp_path)


def _rewrite_config(path, drop=(), **add):
    raw = json.loads((path / "config.json").read_text())
    for key in drop:
        raw.pop(key, None)
    raw.update(add)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("arch, over, drop, add", [
    # Pythia checkpoints on the hub predate rope_parameters
    ("neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}},
     ("rope_parameters",), {"rotary_pct": 0.25, "rotary_emb_base": 500}),
    # Gemma 3 as first released: a period instead of layer_types, a separate local RoPE base
    ("gemma3", {}, ("layer_types", "rope_parameters"),
     {"sliding_window_pattern": 2, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}),
    # Gemma 2 as first released: no layer_types, every other layer (the even ones) windowed
    ("gemma2", {}, ("layer_types",), {}),
])
def test_older_config_spellings_give_the_same_model(tmp_path, arch, over, drop, add):
    ref = build(tmp_path, arch, **over)
    _rewrite_config(tmp_path, drop, **add)
    ids = ids_of()
    with torch.no_grad():
        assert max_diff(sluice.load(tmp_path)(ids), ref(ids).logits) <= 1e-4


def test_original_gpt2_tensor_names_load(tmp_path):
    """The GPT-2 files on the hub lack the "transformer." prefix and carry causal-mask buffers."""
    from safetensors.torch import load_file, save_file
    ref = build(tmp_path, "gpt2")
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed["h.0.attn.bias"] = torch.ones(1, 1, 256, 256).tril()
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = ids_of()
    with torch.no_grad():
        assert max_diff(sluice.load(tmp_path)(ids), ref(ids).logits) <= 1e-4


@pytest.mark.parametrize("arch, pre, post", [("olmo2", False, True), ("gemma2", True, True), ("gpt2", True, False)])
def test_valves_table_shows_the_norms_each_family_has(tmp_path, arch, pre, post):
    from rich.console import Console

    from sluice.observatory import observe
    from sluice.observatory.tables import valves_table
    build(tmp_path, arch)
    model = sluice.load(tmp_path)
    with torch.inference_mode(), observe(model) as obs:
        model(ids_of(1, 12))
    s = obs.summary()
    assert all((v is not None) == pre for v in s["attn_norm_in"] + s["mlp_norm_out"])
    # post-norm keys only where the family has post-norms (so a Qwen3 training log does not carry them)
    assert ("attn_post_norm_in" in s) == post
    if post:
        assert all(v is not None for v in s["attn_post_norm_in"] + s["mlp_post_norm_out"])
    if post:  # the post-norm's input is what the branch produced
        j = obs.norm_names.index("layers.1.mlp_post_norm")
        assert s["mlp_post_norm_in"][1] == pytest.approx(float(obs.stats["norm_in_rms"][j].mean()))
    console = Console(record=True, width=200)
    console.print(valves_table(s, 12, model.config.vocab_size))
    text = console.export_text()
    assert ("1. attn norm" in text) == pre and ("attn post-norm" in text) == post and "none" not in text
