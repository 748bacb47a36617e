"""config.json values that make no sense are refused by name, never coerced or replaced; absent
fields get the default transformers' own config class assumes."""

import json
import math

import pytest
import transformers as T

from sluice import ConfigError, ModelConfig

# Minimal config.json per family: the fields from_hf requires, nothing else.
BASE = {
    "llama": {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
              "num_hidden_layers": 3, "num_attention_heads": 4},
    # Mistral and Qwen3 assume 8 and 32 kv heads when none are given: 32 heads keep that valid.
    "mistral": {"architectures": ["MistralForCausalLM"], "vocab_size": 96, "hidden_size": 64,
                "intermediate_size": 112, "num_hidden_layers": 3, "num_attention_heads": 32},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
              "num_hidden_layers": 3, "num_attention_heads": 32},
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "vocab_size": 96, "n_embd": 64, "n_layer": 3, "n_head": 4},
    "neox": {"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
             "num_hidden_layers": 3, "num_attention_heads": 4},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
               "num_hidden_layers": 3, "num_attention_heads": 4},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
               "intermediate_size": 112, "num_hidden_layers": 3, "num_attention_heads": 4},
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
POS = "a positive finite number"


def read(family, **changes):
    return ModelConfig.from_hf_dict({**BASE[family], **changes}, source="config.json")


@pytest.mark.parametrize("family, changes, message", [
    # the examples: each was silently replaced or coerced
    ("llama", {"rope_theta": 0}, f"config.json: rope_theta must be {POS}, got 0"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta must be"),
    ("llama", {"head_dim": 0}, r"config.json: head_dim must be an integer in \[1, \d+\], got 0"),
    ("llama", {"eos_token_id": True}, "eos_token_id must be a token id.*got True"),
    ("llama", {"eos_token_id": [2, "3"]}, "eos_token_id must be a token id"),
    ("llama", {"eos_token_id": []}, "eos_token_id must be a token id"),
    ("llama", {"bos_token_id": -1}, "bos_token_id must be a token id"),
    ("llama", {"bos_token_id": 1.0}, "bos_token_id must be a token id"),
    ("llama", {"rms_norm_eps": math.nan}, f"rms_norm_eps must be {POS}, got nan"),
    ("llama", {"rms_norm_eps": -1e-5}, f"rms_norm_eps must be {POS}"),
    ("llama", {"rms_norm_eps": 0}, f"rms_norm_eps must be {POS}"),
    ("llama", {"rms_norm_eps": "1e-5"}, f"rms_norm_eps must be {POS}, got '1e-5'"),
    ("llama", {"rms_norm_eps": math.inf}, f"rms_norm_eps must be {POS}"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 0}}, f"rope_scaling.factor must be {POS}"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, f"rope_scaling.factor must be {POS}"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": math.nan}}, "rope_scaling.factor must be"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": True}}, "rope_parameters.factor must be"),
    ("llama", {"rope_scaling": "linear"}, "rope_scaling must be a JSON object"),
    # a value beside rope_parameters, which wins, is still checked (issue 29)
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": math.inf},
     f"config.json: rope_theta must be {POS}, got inf"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
               "rope_scaling": {"rope_type": "yarn", "factor": -4}}, f"config.json: rope_scaling.factor must be {POS}"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
               "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_parameters says rope_type 'default' but rope_scaling says 'yarn'"),
    ("llama", {"rope_parameters": LLAMA3, "rope_scaling": {**LLAMA3, "low_freq_factor": math.nan}},
     "rope_scaling.low_freq_factor must be"),
    ("llama", {"rope_scaling": [{"type": "linear", "factor": 2.0}]}, "rope_scaling must be a JSON object"),
    ("llama", {"rope_parameters": ["default"]}, "rope_parameters must be a JSON object"),
    ("llama", {"rope_scaling": {"rope_type": 3}}, "rope_scaling.rope_type must be a string"),
    ("llama", {"rope_scaling": {"rope_type": "linear"}}, "RoPE type 'linear' needs factor"),
    ("llama", {"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor > low_freq_factor"),
    ("llama", {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 32.5}},
     "original_max_position_embeddings must be an integer"),
    ("mistral", {"sliding_window": -1}, r"sliding_window must be an integer in \[1"),
    ("mistral", {"sliding_window": 0}, r"sliding_window must be an integer in \[1"),
    ("mistral", {"sliding_window": 8.0}, r"sliding_window must be an integer in \[1"),
    ("gemma2", {"attn_logit_softcapping": 0}, f"attn_logit_softcapping must be {POS}"),
    ("gemma2", {"final_logit_softcapping": -30.0}, f"final_logit_softcapping must be {POS}"),
    ("gemma2", {"final_logit_softcapping": "30"}, f"final_logit_softcapping must be {POS}"),
    ("gemma2", {"query_pre_attn_scalar": 0}, f"query_pre_attn_scalar must be {POS}"),
    ("gemma2", {"layer_types": "sliding_attention"}, "layer_types must be a list of strings"),
    ("gemma2", {"layer_types": ["full_attention", "sliding_attention", 1]}, "layer_types must be a list"),
    ("gemma2", {"sliding_window_pattern": 0}, r"sliding_window_pattern must be an integer in \[1"),
    ("gemma3", {"rope_local_base_freq": -1}, f"rope_local_base_freq must be {POS}"),
    ("llama", {"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of "
                                          r"num_key_value_heads \(3\)"),
    ("llama", {"num_key_value_heads": 0}, r"num_key_value_heads must be an integer in \[1"),
    # strings, bools, floats and negatives where sizes are expected
    ("llama", {"hidden_size": "64"}, r"hidden_size must be an integer in \[1, \d+\], got '64'"),
    ("llama", {"num_hidden_layers": True}, "num_hidden_layers must be an integer.*got True"),
    ("llama", {"num_attention_heads": 4.0}, "num_attention_heads must be an integer.*got 4.0"),
    ("llama", {"vocab_size": -96}, "vocab_size must be an integer"),
    ("llama", {"intermediate_size": 0}, "intermediate_size must be an integer"),
    ("llama", {"max_position_embeddings": 1e9}, "max_position_embeddings must be an integer"),
    ("llama", {"max_position_embeddings": 2 ** 40}, "max_position_embeddings must be an integer"),
    ("llama", {"num_hidden_layers": 10 ** 9}, "num_hidden_layers must be an integer in"),
    ("gpt2", {"n_inner": -1}, "n_inner must be an integer"),
    ("llama", {"hidden_size": 2}, r"hidden_size \(2\) is smaller than num_attention_heads \(4\)"),
    # bools that must be bools: bool("false") is True
    ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ("llama", {"attention_bias": 1}, "attention_bias must be true or false, got 1"),
    ("qwen3", {"use_sliding_window": "no"}, "use_sliding_window must be true or false"),
    ("neox", {"use_parallel_residual": 0}, "use_parallel_residual must be true or false"),
    ("gpt2", {"scale_attn_weights": 0}, "scale_attn_weights must be true or false"),
    ("neox", {"rotary_pct": 0}, r"rotary_pct must be a number in \(0.0, 1.0\]"),
    ("neox", {"rotary_pct": 1.5}, r"rotary_pct must be a number in \(0.0, 1.0\]"),
    ("llama", {"hidden_act": 5}, "hidden_act must be a string, got 5"),
    ("llama", {"torch_dtype": 5}, "torch_dtype must be a string"),
    ("llama", {"architectures": "LlamaForCausalLM"}, "architectures must be a non-empty list"),
    ("llama", {"architectures": []}, "architectures must be a non-empty list"),
])
def test_nonsense_values_are_refused_by_name(family, changes, message):
    with pytest.raises(ConfigError, match=message):
        read(family, **changes)


def test_long_values_are_shortened_in_messages():
    with pytest.raises(ConfigError) as e:
        read("llama", hidden_act="x" * 100_000)
    assert "100002 characters" in str(e.value) and len(str(e.value)) < 500


@pytest.mark.parametrize("family, cls, arch", [
    ("llama", T.LlamaConfig, "LlamaForCausalLM"), ("mistral", T.MistralConfig, "MistralForCausalLM"),
    ("qwen3", T.Qwen3Config, "Qwen3ForCausalLM"), ("gpt2", T.GPT2Config, "GPT2LMHeadModel"),
    ("neox", T.GPTNeoXConfig, "GPTNeoXForCausalLM"), ("gemma2", T.Gemma2Config, "Gemma2ForCausalLM"),
    ("gemma3", T.Gemma3TextConfig, "Gemma3ForCausalLM")])
def test_absent_fields_get_transformers_defaults(family, cls, arch):
    """A config.json with only the required fields: sluice assumes what transformers assumes."""
    ours = read(family)
    ref = cls.from_dict(BASE[family]).to_dict()
    eps = ref.get("rms_norm_eps", ref.get("layer_norm_eps", ref.get("layer_norm_epsilon")))
    assert ours.norm_eps == eps
    assert ours.max_position_embeddings == ref.get("max_position_embeddings", ref.get("n_positions"))
    assert ours.tie_word_embeddings == ref["tie_word_embeddings"]
    heads = BASE[family].get("num_attention_heads", 4)
    head_dim = ref.get("head_dim") or 64 // heads
    assert ours.head_dim == head_dim
    assert ours.num_kv_heads == (ref.get("num_key_value_heads") or heads)
    rope = ref.get("rope_parameters") or {}
    if family == "gemma3":
        assert (ours.rope_theta, ours.rope_theta_local) == (rope["full_attention"]["rope_theta"],
                                                           rope["sliding_attention"]["rope_theta"])
    elif rope:
        assert ours.rope_theta == rope["rope_theta"]
        assert ours.rotary_dim == (None if rope.get("partial_rotary_factor", 1.0) == 1.0
                                   else int(head_dim * rope["partial_rotary_factor"]))
    if family in ("mistral", "gemma2", "gemma3"):
        assert ours.sliding_window == ref["sliding_window"]
    if family.startswith("gemma"):
        assert ours.attn_softcap == ref["attn_logit_softcapping"]
        assert ours.final_softcap == ref["final_logit_softcapping"]
        assert ours.attn_scale == ref["query_pre_attn_scalar"] ** -0.5
    if family == "gpt2":
        assert ours.intermediate_size == 4 * 64 and ours.hidden_act == "gelu_new"
    if family == "neox":
        assert ours.hidden_act == "gelu" and ours.parallel_residual is True and ours.qkv_bias is True


def test_null_is_off_where_transformers_reads_it_so():
    """Gemma 2 caps by default, but `null` (what save_pretrained writes for "no cap") means none;
    Mistral's window likewise."""
    assert read("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None).final_softcap is None
    assert read("gemma2").final_softcap == 30.0
    assert read("mistral", sliding_window=None).sliding_window is None
    assert read("mistral").sliding_window == 4096


def test_present_values_are_kept(tmp_path):
    c = read("llama", rope_theta=500000, head_dim=32, num_key_value_heads=1, eos_token_id=[2, 7],
             rms_norm_eps=1e-5, tie_word_embeddings=True)
    assert (c.rope_theta, c.head_dim, c.num_kv_heads, c.eos_token_id, c.norm_eps) == (500000.0, 32, 1, [2, 7], 1e-5)
    assert c.tie_word_embeddings is True


def test_config_file_itself(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)  # deeper than Python's JSON parser recurses
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    with open(path, "wb") as fh:  # sparse: 17 MiB on paper, nothing on disk
        fh.truncate(17 << 20)
    with pytest.raises(ConfigError, match="is not a model config"):
        ModelConfig.from_hf(tmp_path)
    path.unlink()
    path.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)


def test_json_round_trip_of_the_base_configs(tmp_path):
    """The dicts above are what a config.json holds (NaN aside), read through the file path too."""
    (tmp_path / "config.json").write_text(json.dumps(BASE["llama"]))
    assert ModelConfig.from_hf(tmp_path).num_layers == 3


def test_both_rope_spellings_that_agree_are_read_from_rope_parameters():
    """Configs resaved by a newer transformers may carry rope_scaling and rope_parameters together."""
    cfg = read("llama", rope_theta=1e4, rope_scaling={**LLAMA3, "factor": 4.0},
               rope_parameters={**LLAMA3, "rope_theta": 5e5})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["factor"] == 8.0
