"""The family table: one row per supported architecture, read by ModelConfig.from_hf_dict.

Kept apart from config.py because it is data, not logic: adding a family means adding a row here
(ARCHITECTURE.md, house rule "families differ by config fields"), and reading the rows side by side
is easier without the dataclass around them.
"""

from __future__ import annotations

from typing import Any

# Family -> how its config.json spells things and which valves its transformers code fixes.
# "valves": ModelConfig fields that are constant for the family. "keys": where a field's value is
# read when the family uses another name than Llama's (GPT-2 says n_embd for hidden_size).
# "bias": (qkv, o, mlp) each a config.json key to read, or a constant True/False.
LLAMA_KEYS = dict(hidden_size="hidden_size", num_layers="num_hidden_layers",
                  num_heads="num_attention_heads", intermediate_size="intermediate_size",
                  max_position_embeddings="max_position_embeddings", norm_eps="rms_norm_eps",
                  hidden_act="hidden_act", num_kv_heads="num_key_value_heads")
_GEMMA = dict(norm_offset=1.0, norm_gain_fp32=True, norm_placement="sandwich", embed_scaled=True)
# What transformers' config class assumes when config.json omits a field ("defaults" in a row
# overrides these). Only absence gets a default: a value that is present is checked, never replaced.
DEFAULTS = dict(norm_eps=1e-6, max_position_embeddings=2048, hidden_act="silu", rope_theta=10000.0)
_GEMMA_DEFAULTS = dict(hidden_act="gelu_pytorch_tanh", head_dim=256, num_kv_heads=4, query_pre_attn_scalar=256.0,
                       sliding_window=4096)
FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(bias=("attention_bias", "attention_bias", "mlp_bias")),
    "MistralForCausalLM": dict(bias=(False, False, False), window="all",
                               defaults=dict(max_position_embeddings=131072, sliding_window=4096, num_kv_heads=8)),
    # Qwen2 always has q/k/v biases and never an o_proj bias.
    "Qwen2ForCausalLM": dict(bias=(True, False, False), window="refuse",
                             defaults=dict(max_position_embeddings=32768, num_kv_heads=32)),
    # Qwen3: RMSNorm over each head's q and k before RoPE; head_dim is its own field.
    "Qwen3ForCausalLM": dict(valves=dict(qk_norm="head"), bias=("attention_bias", "attention_bias", False),
                             window="refuse", defaults=dict(max_position_embeddings=32768, num_kv_heads=32,
                                                            head_dim=128)),
    # GPT-2: LayerNorm with bias, learned positions, a plain (ungated) GELU MLP, biases everywhere.
    "GPT2LMHeadModel": dict(valves=dict(norm_kind="layer", norm_bias=True, pos_embedding="learned",
                                        mlp_gated=False),
                            bias=(True, True, True), tie_default=True, inner_default=4,
                            defaults=dict(norm_eps=1e-5, max_position_embeddings=1024, hidden_act="gelu_new"),
                            keys=dict(hidden_size="n_embd", num_layers="n_layer", num_heads="n_head",
                                      intermediate_size="n_inner", max_position_embeddings="n_positions",
                                      norm_eps="layer_norm_epsilon", hidden_act="activation_function",
                                      num_kv_heads=None),
                            refuse=("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                                    "add_cross_attention")),
    # GPT-NeoX (Pythia): LayerNorm, attention and MLP side by side on the same input, partial RoPE.
    "GPTNeoXForCausalLM": dict(valves=dict(norm_kind="layer", norm_bias=True, mlp_gated=False),
                               bias=("attention_bias", "attention_bias", True), bias_default=True,
                               keys=dict(norm_eps="layer_norm_eps", num_kv_heads=None),
                               parallel="use_parallel_residual",
                               defaults=dict(norm_eps=1e-5, hidden_act="gelu", partial_rotary_factor=0.25)),
    # Gemma 2: (1 + w) RMSNorm in fp32, norms before and after each branch, scaled embeddings,
    # tanh soft-caps on attention scores and on the final logits, every other layer windowed.
    "Gemma2ForCausalLM": dict(valves=_GEMMA, bias=("attention_bias", "attention_bias", False),
                              tie_default=True, window="layer_types", window_period=2,
                              keys=dict(hidden_act="hidden_activation"),
                              defaults=dict(_GEMMA_DEFAULTS, max_position_embeddings=8192, attn_softcap=50.0,
                                            final_softcap=30.0)),
    # Gemma 3 (text): Gemma 2 plus per-head q/k norms, 5 local : 1 global layers, two RoPE bases.
    "Gemma3ForCausalLM": dict(valves=dict(_GEMMA, qk_norm="head"),
                              bias=("attention_bias", "attention_bias", False),
                              tie_default=True, window="layer_types", window_period=6,
                              keys=dict(hidden_act="hidden_activation"),
                              refuse=("use_bidirectional_attention", "vision_config", "text_config"),
                              defaults=dict(_GEMMA_DEFAULTS, max_position_embeddings=131072, rope_theta=1e6,
                                            rope_theta_local=10000.0)),
    # OLMo 2: no input norms; the norm sits on each branch's output (x + norm(f(x))), q/k norms
    # span the full projection width, and the norm gain and RoPE rotation are applied in fp32.
    "Olmo2ForCausalLM": dict(valves=dict(norm_placement="post", qk_norm="full", norm_gain_fp32=True,
                                         rope_fp32=True),
                             bias=("attention_bias", "attention_bias", False), defaults=dict(norm_eps=1e-5)),
}

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# HF activation names -> the functions sluice implements. "gelu_new" (GPT-2) and
# "gelu_pytorch_tanh" (Gemma) are the same tanh approximation, but the first is written out op by op
# (each rounded to the dtype) and the second is torch's fused kernel: in bf16 they differ, so both.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_new",
               "gelu_pytorch_tanh": "gelu_tanh"}
# Architectures people try that are close to a supported one but need code sluice lacks.
NEAR_MISSES = {"Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower is multimodal; sluice "
               "runs the text-only Gemma3ForCausalLM (a text checkpoint such as gemma-3-1b)"}
