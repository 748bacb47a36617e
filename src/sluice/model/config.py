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

# Family -> valve settings that config.json does not spell out because they are fixed by the code
# of that family in transformers. Per-checkpoint switches (attention_bias, mlp_bias, tie) are read
# from config.json below.
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(qk_norm=None, qkv_bias_key="attention_bias", o_bias_key="attention_bias",
                             mlp_bias_key="mlp_bias", sliding_window_key=None),
    "MistralForCausalLM": dict(qk_norm=None, qkv_bias_key=None, o_bias_key=None,
                               mlp_bias_key=None, sliding_window_key="sliding_window"),
    # Qwen2 always has q/k/v biases and never an o_proj bias.
    "Qwen2ForCausalLM": dict(qk_norm=None, qkv_bias_key=True, o_bias_key=None,
                             mlp_bias_key=None, sliding_window_key="use_sliding_window"),
    # Qwen3: RMSNorm over each head's q and k before RoPE; head_dim is its own field.
    "Qwen3ForCausalLM": dict(qk_norm="head", qkv_bias_key="attention_bias", o_bias_key="attention_bias",
                             mlp_bias_key=None, sliding_window_key="use_sliding_window"),
}

SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = ("silu",)


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
    # The valves. norm_kind: "rms" (x / rms * w, cast to the input dtype before the weight multiply,
    # as Llama/Qwen do). norm_placement: "pre" (x + f(norm(x))). qk_norm: None or "head".
    norm_kind: str = "rms"
    norm_placement: str = "pre"
    qk_norm: str | None = None
    final_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" in _ROPE_TYPES and that type's parameters.
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    architecture: str = "Qwen3ForCausalLM"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        # Fields the model does not implement yet are refused, not ignored (they are here so that
        # the next family is a new _FAMILIES row plus a branch in layers.py, not a new model).
        for name, allowed in (("norm_kind", ("rms",)), ("norm_placement", ("pre",)),
                              ("qk_norm", (None, "head")), ("hidden_act", _ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not implemented "
                                  f"(implemented: {allowed})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")

    @property
    def num_params(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm == "head" else 0)
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + L * (attn + mlp + norms) + h + head

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
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
        if arch not in _FAMILIES:
            raise ConfigError(f"{source}: architecture {arch!r} is not supported by sluice "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        fam = _FAMILIES[arch]

        def need(key):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return raw[key]

        def flag(key) -> bool:
            if key is True or key is None:
                return bool(key)
            return bool(raw.get(key, False))

        act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if act not in _ACTIVATIONS:
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (supported: {_ACTIVATIONS})")

        sliding_window = None
        sw_key = fam["sliding_window_key"]
        if sw_key == "sliding_window":
            sliding_window = raw.get("sliding_window")
        elif sw_key and raw.get(sw_key):
            raise ConfigError(f"{source}: {sw_key}=true (sliding-window attention on some layers of "
                              f"{arch}) is not supported by sluice")
        layer_types = raw.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types) and sw_key != "sliding_window":
            raise ConfigError(f"{source}: layer_types {sorted(set(layer_types))} is not supported; "
                              "sluice implements full attention on every layer for this family")

        rope_theta, rope_scaling = _read_rope(raw, source)
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = raw.get("head_dim") or hidden // num_heads
        eps = raw.get("rms_norm_eps", 1e-6)
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            norm_eps=float(eps),
            qk_norm=fam["qk_norm"],
            qkv_bias=flag(fam["qkv_bias_key"]),
            o_bias=flag(fam["o_bias_key"]),
            mlp_bias=flag(fam["mlp_bias_key"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=act,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=int(sliding_window) if sliding_window else None,
            architecture=arch,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
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


def _read_rope(raw: dict, source: str) -> tuple[float, dict | None]:
    """Accept both spellings: old (rope_theta + rope_scaling) and new (rope_parameters)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = raw.get("rope_scaling")
    merged: dict = {}
    if isinstance(scaling, dict):
        merged.update(scaling)
    if isinstance(params, dict):
        merged.update(params)
    theta = merged.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"{source}: RoPE scaling type {rope_type!r} is not supported "
                          f"(supported: {', '.join(_ROPE_TYPES)})")
    partial = merged.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{source}: partial_rotary_factor={partial} is not supported")
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
        raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    if rope_type == "default":
        return float(theta), None
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings")}[rope_type]
    missing = [k for k in required if merged.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: RoPE type {rope_type!r} needs {', '.join(missing)}")
    return float(theta), {"rope_type": rope_type, **{k: float(merged[k]) for k in required}}
