"""ModelConfig: everything the model code needs, read from a Hugging Face config.json.

`ModelConfig.from_hf` is the only reader of config.json. Each supported architecture is one row of
`_FAMILIES`: the architecture name maps to the values of the numerical "valves" (norm kind and
placement, qk-norm, biases). The model code branches on those fields, never on family names, so a
new family is a new row here, not a new model class.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Family -> how its config.json spells things and which valves its transformers code fixes.
# "valves": ModelConfig fields that are constant for the family. "keys": where a field's value is
# read when the family uses another name than Llama's (GPT-2 says n_embd for hidden_size).
# "bias": (qkv, o, mlp) each a config.json key to read, or a constant True/False.
_LLAMA_KEYS = dict(hidden_size="hidden_size", num_layers="num_hidden_layers",
                   num_heads="num_attention_heads", intermediate_size="intermediate_size",
                   max_position_embeddings="max_position_embeddings", norm_eps="rms_norm_eps",
                   hidden_act="hidden_act", num_kv_heads="num_key_value_heads")
_GEMMA = dict(norm_offset=1.0, norm_gain_fp32=True, norm_placement="sandwich", embed_scaled=True)
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(bias=("attention_bias", "attention_bias", "mlp_bias")),
    "MistralForCausalLM": dict(bias=(False, False, False), window="all"),
    # Qwen2 always has q/k/v biases and never an o_proj bias.
    "Qwen2ForCausalLM": dict(bias=(True, False, False), window="refuse"),
    # Qwen3: RMSNorm over each head's q and k before RoPE; head_dim is its own field.
    "Qwen3ForCausalLM": dict(valves=dict(qk_norm="head"), bias=("attention_bias", "attention_bias", False),
                             window="refuse"),
    # GPT-2: LayerNorm with bias, learned positions, a plain (ungated) GELU MLP, biases everywhere.
    "GPT2LMHeadModel": dict(valves=dict(norm_kind="layer", norm_bias=True, pos_embedding="learned",
                                        mlp_gated=False),
                            bias=(True, True, True), tie_default=True,
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
                               parallel="use_parallel_residual"),
    # Gemma 2: (1 + w) RMSNorm in fp32, norms before and after each branch, scaled embeddings,
    # tanh soft-caps on attention scores and on the final logits, every other layer windowed.
    "Gemma2ForCausalLM": dict(valves=_GEMMA, bias=("attention_bias", "attention_bias", False),
                              tie_default=True, window="layer_types", window_period=2,
                              keys=dict(hidden_act="hidden_activation")),
    # Gemma 3 (text): Gemma 2 plus per-head q/k norms, 5 local : 1 global layers, two RoPE bases.
    "Gemma3ForCausalLM": dict(valves=dict(_GEMMA, qk_norm="head"),
                              bias=("attention_bias", "attention_bias", False),
                              tie_default=True, window="layer_types", window_period=6,
                              keys=dict(hidden_act="hidden_activation"),
                              refuse=("use_bidirectional_attention", "vision_config", "text_config")),
    # OLMo 2: no input norms; the norm sits on each branch's output (x + norm(f(x))), q/k norms
    # span the full projection width, and the norm gain and RoPE rotation are applied in fp32.
    "Olmo2ForCausalLM": dict(valves=dict(norm_placement="post", qk_norm="full", norm_gain_fp32=True,
                                         rope_fp32=True),
                             bias=("attention_bias", "attention_bias", False)),
}

SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
_ROPE_TYPES = ("default", "linear", "llama3")
# HF activation names -> the functions sluice implements. "gelu_new" (GPT-2) and
# "gelu_pytorch_tanh" (Gemma) are the same tanh approximation, but the first is written out op by op
# (each rounded to the dtype) and the second is torch's fused kernel: in bf16 they differ, so both.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_new",
                "gelu_pytorch_tanh": "gelu_tanh"}
# Architectures people try that are close to a supported one but need code sluice lacks.
_NEAR_MISSES = {"Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower is multimodal; sluice "
                "runs the text-only Gemma3ForCausalLM (a text checkpoint such as gemma-3-1b)"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    # ---- The valves (DESIGN.md rule 2); the defaults are Llama's.
    # norm_kind "rms" | "layer". RMSNorm gain = norm_offset + weight (Gemma stores w - 1: offset 1);
    # norm_gain_fp32: multiply the gain in fp32 then cast (Gemma, OLMo 2) instead of casting first
    # (Llama, Qwen). norm_bias: LayerNorm's additive bias (GPT-2, NeoX).
    norm_kind: str = "rms"
    norm_offset: float = 0.0
    norm_gain_fp32: bool = False
    norm_bias: bool = False
    # norm_placement: "pre" x + f(norm(x)); "sandwich" x + norm2(f(norm1(x))) (Gemma 2/3);
    # "post" x + norm(f(x)) (OLMo 2). parallel_residual: x + attn(n1(x)) + mlp(n2(x)) (NeoX).
    norm_placement: str = "pre"
    parallel_residual: bool = False
    qk_norm: str | None = None  # None, "head" (over each head, Qwen3/Gemma 3), "full" (OLMo 2)
    final_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    mlp_gated: bool = True  # down(act(gate(x)) * up(x)) or, ungated, down(act(up(x)))
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"  # "silu", "gelu" (erf), "gelu_tanh" (fused), "gelu_new" (op by op)
    pos_embedding: str = "rope"  # "rope" or "learned" (GPT-2's table of max_position_embeddings rows)
    embed_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden), rounded to dtype
    attn_scale: float | None = None  # scores * attn_scale; None = head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" in _ROPE_TYPES and that type's parameters.
    rope_scaling: dict | None = None
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of each head (NeoX); None = all
    rope_fp32: bool = False  # rotate q/k with fp32 cos/sin, then round (OLMo 2); else tables in dtype
    sliding_window: int | None = None
    # Per layer "full" or "sliding"; None = every layer sliding when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] | None = None
    rope_theta_local: float | None = None  # sliding layers' RoPE base when it differs (Gemma 3)
    architecture: str = "Qwen3ForCausalLM"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name, allowed in (("norm_kind", ("rms", "layer")),
                              ("norm_placement", ("pre", "sandwich", "post")),
                              ("qk_norm", (None, "head", "full")),
                              ("hidden_act", tuple(sorted(set(_ACTIVATIONS.values())))),
                              ("pos_embedding", ("rope", "learned"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not implemented "
                                  f"(implemented: {allowed})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.parallel_residual and self.norm_placement != "pre":
            raise ConfigError("parallel_residual is implemented for pre-norm blocks only")
        rd = self.rotary_dim
        if rd is not None and not (0 < rd <= self.head_dim and rd % 2 == 0):
            raise ConfigError(f"rotary dimension {rd} must be even and in (0, head_dim={self.head_dim}]")
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers or
                                             set(self.layer_types) - {"full", "sliding"}):
            raise ConfigError(f"layer_types must give 'full' or 'sliding' for each of the "
                              f"{self.num_layers} layers, got {self.layer_types}")
        for name in ("attn_softcap", "final_softcap", "attn_scale", "embed_scale"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")

    def is_sliding(self, layer: int) -> bool:
        """Does `layer` attend through the sliding window?"""
        if not self.sliding_window:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding"

    @property
    def num_params(self) -> int:
        h, i, v, L, D = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers, self.head_dim
        q, kv = self.num_heads * D, self.num_kv_heads * D
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mats = 3 if self.mlp_gated else 2
        mlp = mats * h * i + (((mats - 1) * i + h) if self.mlp_bias else 0)
        norm = h * (2 if self.norm_bias else 1)
        per_block = {"pre": 2, "sandwich": 4, "post": 2}[self.norm_placement]
        qk = {None: 0, "head": 2 * D, "full": q + kv}[self.qk_norm]
        head = 0 if self.tie_word_embeddings else v * h
        pos = self.max_position_embeddings * h if self.pos_embedding == "learned" else 0
        final = norm if self.final_norm else 0
        return v * h + pos + L * (attn + mlp + per_block * norm + qk) + final + head

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        return cls.from_json_file(path)

    @classmethod
    def from_json_file(cls, path: Path) -> "ModelConfig":
        """A config.json file by its own path (`sluice roofline --config FILE`); no weights needed."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_hf_dict(raw, source=str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in _NEAR_MISSES:
            raise ConfigError(f"{source}: architecture {arch!r}: {_NEAR_MISSES[arch]}")
        if arch not in _FAMILIES:
            raise ConfigError(f"{source}: architecture {arch!r} is not supported by sluice "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        fam = _FAMILIES[arch]
        keys = {**_LLAMA_KEYS, **fam.get("keys", {})}

        def need(key):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return raw[key]

        def flag(key) -> bool:
            if isinstance(key, bool):
                return key
            return bool(raw.get(key, fam.get("bias_default", False)))

        for key in fam.get("refuse", ()):
            if raw.get(key):
                raise ConfigError(f"{source}: {key}={raw[key]!r} is set; sluice does not implement "
                                  f"that for {arch}")
        act_name = raw.get(keys["hidden_act"]) or raw.get("hidden_act") or "silu"
        if act_name not in _ACTIVATIONS:
            raise ConfigError(f"{source}: {keys['hidden_act']} {act_name!r} is not supported "
                              f"(supported: {', '.join(_ACTIVATIONS)})")

        num_heads = int(need(keys["num_heads"]))
        hidden = int(need(keys["hidden_size"]))
        num_layers = int(need(keys["num_layers"]))
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        inter = raw.get(keys["intermediate_size"]) if arch == "GPT2LMHeadModel" else need(keys["intermediate_size"])
        sliding_window, layer_types = _read_window(raw, fam, arch, num_layers, source)
        rope_theta, rope_scaling, partial, theta_local = _read_rope(raw, source)
        rotary_dim = None if partial == 1.0 else int(head_dim * partial)
        valves = dict(fam.get("valves", {}))
        if valves.pop("embed_scaled", False):
            valves["embed_scale"] = hidden ** 0.5
        if arch.startswith("Gemma"):
            valves["attn_scale"] = float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5
            valves["attn_softcap"] = raw.get("attn_logit_softcapping")
            valves["final_softcap"] = raw.get("final_logit_softcapping")
        if arch == "GPT2LMHeadModel" and raw.get("scale_attn_weights") is False:
            valves["attn_scale"] = 1.0
        if "parallel" in fam:
            valves["parallel_residual"] = bool(raw.get(fam["parallel"], True))
        qkv_b, o_b, mlp_b = fam["bias"]
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(inter or 4 * hidden),
            num_layers=num_layers,
            num_heads=num_heads,
            # Families without grouped-query attention (GPT-2, NeoX) have no such key to read.
            num_kv_heads=int((keys["num_kv_heads"] and raw.get(keys["num_kv_heads"])) or num_heads),
            head_dim=head_dim,
            max_position_embeddings=int(raw.get(keys["max_position_embeddings"]) or 2048),
            norm_eps=float(raw.get(keys["norm_eps"], 1e-6)),
            qkv_bias=flag(qkv_b),
            o_bias=flag(o_b),
            mlp_bias=flag(mlp_b),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", fam.get("tie_default", False))),
            hidden_act=_ACTIVATIONS[act_name],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rotary_dim=rotary_dim,
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_theta_local=theta_local if layer_types and "sliding" in layer_types else None,
            architecture=arch,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            **valves,
        )

    def to_hf_dict(self) -> dict:
        """The config.json transformers reads back into the same model (used by `sluice train`)."""
        if self.architecture != "Qwen3ForCausalLM":
            raise ConfigError("to_hf_dict writes Qwen3ForCausalLM configs only")
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        return {
            "architectures": [self.architecture], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_eps, "hidden_act": self.hidden_act,
            "attention_bias": self.qkv_bias, "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": rope, "rope_theta": self.rope_theta, "rope_scaling": None,
            "use_sliding_window": False, "sliding_window": None,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "dtype": self.torch_dtype or "float32", "torch_dtype": self.torch_dtype or "float32",
        }

    def replace(self, **changes) -> "ModelConfig":
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        kwargs.update(changes)
        return ModelConfig(**kwargs)


def _read_window(raw: dict, fam: dict, arch: str, num_layers: int, source: str):
    """(sliding_window, layer_types) from the family's convention."""
    mode = fam.get("window")
    layer_types = raw.get("layer_types")
    if mode == "all":  # Mistral: one window for every layer
        return (int(raw["sliding_window"]) if raw.get("sliding_window") else None), None
    if mode == "layer_types":  # Gemma: a list, or a period (every n-th layer global)
        window = raw.get("sliding_window")
        if layer_types is None:
            period = int(raw.get("sliding_window_pattern") or fam["window_period"])
            layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                           for i in range(num_layers)]
        names = {"full_attention": "full", "sliding_attention": "sliding"}
        if not isinstance(layer_types, list) or len(layer_types) != num_layers or \
                any(t not in names for t in layer_types):
            raise ConfigError(f"{source}: layer_types must list 'full_attention' or "
                              f"'sliding_attention' for each of the {num_layers} layers")
        return (int(window) if window else None), tuple(names[t] for t in layer_types)
    if mode == "refuse" and raw.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=true (sliding-window attention on some layers "
                          f"of {arch}) is not supported by sluice")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{source}: layer_types {sorted(set(layer_types))} is not supported; "
                          "sluice implements full attention on every layer for this family")
    return None, None


def _read_rope(raw: dict, source: str) -> tuple[float, dict | None, float, float | None]:
    """(theta, scaling, partial rotary fraction, sliding layers' theta) from both spellings: old
    (rope_theta + rope_scaling, NeoX's rotary_pct/rotary_emb_base, Gemma 3's rope_local_base_freq)
    and new (rope_parameters, possibly one dict per layer type)."""
    params = raw.get("rope_parameters")
    local = None
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        local = params.get("sliding_attention")
        params = params["full_attention"]
    if isinstance(local, dict):
        if (local.get("rope_type") or "default") != "default":
            raise ConfigError(f"{source}: RoPE scaling on sliding-window layers "
                              f"({local.get('rope_type')!r}) is not supported")
        local = local.get("rope_theta")
    local = local or raw.get("rope_local_base_freq")
    scaling = raw.get("rope_scaling")
    merged: dict = {}
    if isinstance(scaling, dict):
        merged.update(scaling)
    if isinstance(params, dict):
        merged.update(params)
    theta = merged.pop("rope_theta", None) or raw.get("rope_theta") or raw.get("rotary_emb_base") or 10000.0
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"{source}: RoPE scaling type {rope_type!r} is not supported "
                          f"(supported: {', '.join(_ROPE_TYPES)})")
    partial = merged.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") \
        or raw.get("rotary_pct") or 1.0
    if not (isinstance(partial, (int, float)) and 0 < partial <= 1):
        raise ConfigError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    for name, value in (("rope_theta", theta), ("sliding-layer rope_theta", local)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{source}: {name} must be a positive number, got {value!r}")
    local = float(local) if local is not None else None
    if rope_type == "default":
        return float(theta), None, float(partial), local
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings")}[rope_type]
    missing = [k for k in required if merged.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: RoPE type {rope_type!r} needs {', '.join(missing)}")
    return float(theta), {"rope_type": rope_type, **{k: float(merged[k]) for k in required}}, \
        float(partial), local
