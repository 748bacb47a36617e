"""ModelConfig: everything the model code needs, read from a Hugging Face config.json.

`ModelConfig.from_hf` is the only reader of config.json. Each supported architecture is one row of
`FAMILIES` (model/hf_families.py): the architecture name maps to the values of the numerical
"valves" (norm kind and placement, qk-norm, biases). The model code branches on those fields, never
on family names, so a new family is a new row in that table, not a new model class.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..errors import ConfigError
from .hf_attention import read_rope, read_window
from .hf_families import ACTIVATIONS, DEFAULTS, FAMILIES, LLAMA_KEYS, NEAR_MISSES, SUPPORTED_ARCHITECTURES
from .hf_fields import ABSENT, MAX_LAYERS, Fields, shown

MAX_CONFIG_BYTES = 16 << 20


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
    # ---- The valves (ARCHITECTURE.md, house rule "families differ by config fields"); Llama's defaults.
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
                              ("hidden_act", tuple(sorted(set(ACTIVATIONS.values())))),
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
        try:
            found = path.is_file()
        except OSError as e:  # an unreadable directory, a name too long
            raise ConfigError(f"cannot look for config.json in {model_dir}: {e.strerror or e}") from None
        if not found:
            raise ConfigError(f"no config.json in {model_dir}")
        return cls.from_json_file(path)

    @classmethod
    def from_json_file(cls, path: Path) -> "ModelConfig":
        """A config.json file by its own path (`sluice roofline --config FILE`); no weights needed."""
        try:
            if path.stat().st_size > MAX_CONFIG_BYTES:  # real ones are a few KiB
                raise ConfigError(f"{path} is {path.stat().st_size:,} bytes; a config.json over "
                                  f"{MAX_CONFIG_BYTES:,} bytes is not a model config")
            raw = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8; nesting deeper than Python's stack
            raise ConfigError(f"{path} is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_hf_dict(raw, source=str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        f = Fields(raw, source)
        archs = raw.get("architectures")
        if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
            raise f.fail("architectures", "a non-empty list of architecture names", archs)
        arch = archs[0]
        if arch in NEAR_MISSES:
            raise ConfigError(f"{source}: architecture {arch!r}: {NEAR_MISSES[arch]}")
        if arch not in FAMILIES:
            raise ConfigError(f"{source}: architecture {shown(arch)} is not supported by sluice "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        fam = FAMILIES[arch]
        keys = {**LLAMA_KEYS, **fam.get("keys", {})}
        d = {**DEFAULTS, **fam.get("defaults", {})}
        for key in fam.get("refuse", ()):
            if raw.get(key):
                raise ConfigError(f"{source}: {key}={shown(raw[key])} is set; sluice does not implement "
                                  f"that for {arch}")
        # Gemma spells it hidden_activation; older Gemma files have only hidden_act.
        act_key = keys["hidden_act"] if f.has(keys["hidden_act"]) or not f.has("hidden_act") else "hidden_act"
        act_name = f.text(act_key, d["hidden_act"])
        if act_name not in ACTIVATIONS:
            raise ConfigError(f"{source}: {act_key} {shown(act_name)} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")

        num_heads = f.int(keys["num_heads"])
        hidden = f.int(keys["hidden_size"])
        num_layers = f.int(keys["num_layers"], hi=MAX_LAYERS)
        if not f.has("head_dim") and "head_dim" not in d and hidden < num_heads:
            raise ConfigError(f"{source}: {keys['hidden_size']} ({hidden}) is smaller than {keys['num_heads']} "
                              f"({num_heads}), so head_dim = hidden // heads would be 0")
        head_dim = f.int("head_dim", d.get("head_dim", hidden // num_heads))
        # Families without grouped-query attention (GPT-2, NeoX) have no such key to read.
        kv_key = keys["num_kv_heads"]
        num_kv_heads = f.int(kv_key, d.get("num_kv_heads", num_heads)) if kv_key else num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(f"{source}: {keys['num_heads']} ({num_heads}) must be a multiple of "
                              f"{kv_key} ({num_kv_heads})")
        inner = fam.get("inner_default")
        inter = f.int(keys["intermediate_size"], inner * hidden if inner else ABSENT)
        sliding_window, layer_types = read_window(f, fam, d, arch, num_layers)
        rope_theta, rope_scaling, partial, theta_local = read_rope(f, d)
        valves = dict(fam.get("valves", {}))
        if valves.pop("embed_scaled", False):
            valves["embed_scale"] = hidden ** 0.5
        if arch.startswith("Gemma"):
            valves["attn_scale"] = f.number("query_pre_attn_scalar", d["query_pre_attn_scalar"]) ** -0.5
            # Absent: the family's cap (Gemma 2 caps by default); null: no cap.
            valves["attn_softcap"] = f.number("attn_logit_softcapping", d.get("attn_softcap"), null=None)
            valves["final_softcap"] = f.number("final_logit_softcapping", d.get("final_softcap"), null=None)
        if arch == "GPT2LMHeadModel" and not f.flag("scale_attn_weights", True):
            valves["attn_scale"] = 1.0
        if "parallel" in fam:
            valves["parallel_residual"] = f.flag(fam["parallel"], True)

        def bias(key) -> bool:
            return key if isinstance(key, bool) else f.flag(key, fam.get("bias_default", False))

        qkv_b, o_b, mlp_b = fam["bias"]
        return cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=f.int(keys["max_position_embeddings"], d["max_position_embeddings"]),
            norm_eps=f.number(keys["norm_eps"], d["norm_eps"]),
            qkv_bias=bias(qkv_b),
            o_bias=bias(o_b),
            mlp_bias=bias(mlp_b),
            tie_word_embeddings=f.flag("tie_word_embeddings", fam.get("tie_default", False)),
            hidden_act=ACTIVATIONS[act_name],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_theta_local=theta_local if layer_types and "sliding" in layer_types else None,
            architecture=arch,
            torch_dtype=f.text("dtype", None) or f.text("torch_dtype", None),
            bos_token_id=f.token_ids("bos_token_id"),
            eos_token_id=f.token_ids("eos_token_id"),
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

