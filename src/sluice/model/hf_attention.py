"""The two config.json readings with several spellings: attention windows and RoPE.

Both are called by ModelConfig.from_hf_dict only; every value goes through hf_fields.Fields, so a
present value is checked and kept (never replaced by a default because it is falsy).
"""

from __future__ import annotations

import math

from .hf_fields import MAX_LAYERS, Fields
from ..errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3")
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


# Every RoPE number sluice reads, with its upper bound; each must be a positive finite number wherever it appears.
_ROPE_NUMBERS = {"rope_theta": math.inf, "rotary_emb_base": math.inf, "factor": math.inf, "low_freq_factor": math.inf,
                 "high_freq_factor": math.inf, "original_max_position_embeddings": math.inf,
                 "partial_rotary_factor": 1.0, "rotary_pct": 1.0}


def _rope_type(fields: Fields) -> str:
    key = "rope_type" if fields.has("rope_type") else "type"
    return fields.text(key, "default")


def read_window(f: Fields, fam: dict, defaults: dict, arch: str, num_layers: int):
    """(sliding_window, layer_types) from the family's convention."""
    mode = fam.get("window")
    if mode == "all":  # Mistral: one window for every layer; explicit null = no window
        return f.int("sliding_window", defaults.get("sliding_window"), null=None), None
    if mode == "layer_types":  # Gemma: a list, or a period (every n-th layer global)
        window = f.int("sliding_window", defaults.get("sliding_window"), null=None)
        types = f.strings("layer_types", tuple(_LAYER_TYPES), num_layers)
        if types is None:
            period = f.int("sliding_window_pattern", fam["window_period"], hi=MAX_LAYERS)
            types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]
        return window, tuple(_LAYER_TYPES[t] for t in types)
    if mode == "refuse" and f.flag("use_sliding_window", False):
        raise ConfigError(f"{f.source}: use_sliding_window=true (sliding-window attention on some layers "
                          f"of {arch}) is not supported by sluice")
    types = f.strings("layer_types")
    if types and any(t != "full_attention" for t in types):
        raise ConfigError(f"{f.source}: layer_types {sorted(set(types))} is not supported; "
                          "sluice implements full attention on every layer for this family")
    return None, None


def read_rope(f: Fields, defaults: dict) -> tuple[float, dict | None, float, float | None]:
    """(theta, scaling, partial rotary fraction, sliding layers' theta) from both spellings: old
    (rope_theta + rope_scaling, NeoX's rotary_pct/rotary_emb_base, Gemma 3's rope_local_base_freq)
    and new (rope_parameters, possibly one dict per layer type). The new spelling wins."""
    params = f.sub("rope_parameters")
    local_theta = None
    if params is not None and "full_attention" in params.raw:  # per-layer-type form
        per_type = params
        params = per_type.sub("full_attention")
        local = per_type.sub("sliding_attention")
        if local is not None:
            if local.text("rope_type", "default") != "default":
                raise ConfigError(f"{f.source}: RoPE scaling on sliding-window layers "
                                  f"({local.raw['rope_type']!r}) is not supported")
            local_theta = local.number("rope_theta", None)
    if local_theta is None:
        local_theta = f.number("rope_local_base_freq", defaults.get("rope_theta_local"))
    spellings = [s for s in (params, f.sub("rope_scaling")) if s is not None]

    def where(key: str) -> Fields | None:
        return next((s for s in spellings if s.has(key)), None)

    def first(candidates, default, **limits):
        for fields, key in candidates:
            if fields is not None and fields.has(key):
                return fields.number(key, **limits)
        return default

    # Only the first spelling that has a value is used, but every value present is checked: a top-level
    # rope_theta of Infinity or a rope_scaling with factor -4 beside rope_parameters is a broken file.
    for fields in (f, *spellings):
        for key, hi in _ROPE_NUMBERS.items():
            fields.number(key, None, hi=hi)
    theta = first([(where("rope_theta"), "rope_theta"), (f, "rope_theta"), (f, "rotary_emb_base")],
                  defaults.get("rope_theta", 10000.0))
    types = [_rope_type(s) for s in spellings]
    if len(set(types)) > 1:  # a stale rope_scaling of another kind: which one the model was trained with is unknown
        raise ConfigError(f"{f.source}: rope_parameters says rope_type {types[0]!r} but rope_scaling says "
                          f"{types[1]!r}; the two spellings of RoPE scaling must agree (remove the stale one)")
    rope_type = types[0] if types else "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{f.source}: RoPE scaling type {rope_type!r} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    partial = first([(where("partial_rotary_factor"), "partial_rotary_factor"), (f, "partial_rotary_factor"),
                     (f, "rotary_pct")], defaults.get("partial_rotary_factor", 1.0), hi=1.0)
    if rope_type == "default":
        return theta, None, partial, local_theta
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in required[rope_type] if where(k) is None]
    if missing:
        raise ConfigError(f"{f.source}: RoPE type {rope_type!r} needs {', '.join(missing)}")
    scaling = {"rope_type": rope_type, **{k: where(k).number(k) for k in required[rope_type]}}
    if rope_type == "llama3":
        # original_max_position_embeddings is a length: an integer. The blend divides by high - low.
        where("original_max_position_embeddings").int("original_max_position_embeddings")
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ConfigError(f"{f.source}: RoPE llama3 needs high_freq_factor > low_freq_factor, got "
                              f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}")
    return theta, scaling, partial, local_theta
