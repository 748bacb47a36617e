"""Safetensors shards -> model tensors. The only place that knows Hugging Face tensor names.

Loading is lazy and one tensor at a time: the model is built on the meta device (no memory),
each tensor is read from the memory-mapped file, cast to the target dtype and assigned, so peak
memory is one copy of the weights plus one tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .hf_fields import shown
from .safetensors_files import checkpoint_files, read_headers

__all__ = ["checkpoint_files", "hf_to_sluice", "load_weights", "plan_checkpoint", "sluice_to_hf"]

# HF name (with {i} for the layer) -> sluice name, one literal table per naming scheme. A value
# that is a tuple is a fused HF tensor: (how it is split, the sluice names it becomes).
_LLAMA_LAYER = {
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attn.q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attn.k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attn.v.bias",
    "model.layers.{i}.self_attn.o_proj.bias": "layers.{i}.attn.o.bias",
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down.weight",
    "model.layers.{i}.mlp.gate_proj.bias": "layers.{i}.mlp.gate.bias",
    "model.layers.{i}.mlp.up_proj.bias": "layers.{i}.mlp.up.bias",
    "model.layers.{i}.mlp.down_proj.bias": "layers.{i}.mlp.down.bias",
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_QKV = ("layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight")
_QKV_BIAS = ("layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias")
NAME_TABLES: dict[str, dict[str, str | tuple]] = {
    "llama": {**_LLAMA_LAYER,
              "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
              "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight"},
    # Gemma's "post_attention_layernorm" normalises the attention output (the sandwich), while
    # Llama's of the same name is the MLP's input norm: same HF name, a different valve.
    "gemma": {**_LLAMA_LAYER,
              "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
              "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.attn_post_norm.weight",
              "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.mlp_norm.weight",
              "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.mlp_post_norm.weight"},
    "olmo2": {**_LLAMA_LAYER,
              "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.attn_post_norm.weight",
              "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.mlp_post_norm.weight"},
    # GPT-2 stores Conv1D weights as (in, out), the transpose of nn.Linear's, and q|k|v fused.
    "gpt2": {
        "transformer.wte.weight": "embed.weight",
        "transformer.wpe.weight": "pos_embed.weight",
        "transformer.ln_f.weight": "final_norm.weight",
        "transformer.ln_f.bias": "final_norm.bias",
        "lm_head.weight": "lm_head.weight",
        "transformer.h.{i}.ln_1.weight": "layers.{i}.attn_norm.weight",
        "transformer.h.{i}.ln_1.bias": "layers.{i}.attn_norm.bias",
        "transformer.h.{i}.ln_2.weight": "layers.{i}.mlp_norm.weight",
        "transformer.h.{i}.ln_2.bias": "layers.{i}.mlp_norm.bias",
        "transformer.h.{i}.attn.c_attn.weight": ("conv1d_fused", _QKV),
        "transformer.h.{i}.attn.c_attn.bias": ("fused", _QKV_BIAS),
        "transformer.h.{i}.attn.c_proj.weight": ("conv1d", ("layers.{i}.attn.o.weight",)),
        "transformer.h.{i}.attn.c_proj.bias": "layers.{i}.attn.o.bias",
        "transformer.h.{i}.mlp.c_fc.weight": ("conv1d", ("layers.{i}.mlp.up.weight",)),
        "transformer.h.{i}.mlp.c_fc.bias": "layers.{i}.mlp.up.bias",
        "transformer.h.{i}.mlp.c_proj.weight": ("conv1d", ("layers.{i}.mlp.down.weight",)),
        "transformer.h.{i}.mlp.c_proj.bias": "layers.{i}.mlp.down.bias",
    },
    # NeoX fuses q, k, v per head: rows are [q_0 k_0 v_0 q_1 k_1 v_1 ...], each D rows.
    "neox": {
        "gpt_neox.embed_in.weight": "embed.weight",
        "gpt_neox.final_layer_norm.weight": "final_norm.weight",
        "gpt_neox.final_layer_norm.bias": "final_norm.bias",
        "embed_out.weight": "lm_head.weight",
        "gpt_neox.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
        "gpt_neox.layers.{i}.input_layernorm.bias": "layers.{i}.attn_norm.bias",
        "gpt_neox.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
        "gpt_neox.layers.{i}.post_attention_layernorm.bias": "layers.{i}.mlp_norm.bias",
        "gpt_neox.layers.{i}.attention.query_key_value.weight": ("per_head_fused", _QKV),
        "gpt_neox.layers.{i}.attention.query_key_value.bias": ("per_head_fused", _QKV_BIAS),
        "gpt_neox.layers.{i}.attention.dense.weight": "layers.{i}.attn.o.weight",
        "gpt_neox.layers.{i}.attention.dense.bias": "layers.{i}.attn.o.bias",
        "gpt_neox.layers.{i}.mlp.dense_h_to_4h.weight": "layers.{i}.mlp.up.weight",
        "gpt_neox.layers.{i}.mlp.dense_h_to_4h.bias": "layers.{i}.mlp.up.bias",
        "gpt_neox.layers.{i}.mlp.dense_4h_to_h.weight": "layers.{i}.mlp.down.weight",
        "gpt_neox.layers.{i}.mlp.dense_4h_to_h.bias": "layers.{i}.mlp.down.bias",
    },
}
_SCHEMES = {"GPT2LMHeadModel": "gpt2", "GPTNeoXForCausalLM": "neox", "Gemma2ForCausalLM": "gemma",
            "Gemma3ForCausalLM": "gemma", "Olmo2ForCausalLM": "olmo2"}
# Tensors some checkpoints carry that are derived, not learned (rotary tables, GPT-2's causal-mask
# buffers): safe to skip.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"
                      r"|transformer\.h\.\d+\.attn\.(masked_)?bias"
                      r"|gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)")
_LOADABLE_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
_LAYER = re.compile(r"\.(\d+)\.")


def scheme_of(architecture: str) -> str:
    return _SCHEMES.get(architecture, "llama")


def _key(name: str):
    m = _LAYER.search(name)
    return (name[: m.start()] + ".{i}." + name[m.end():], m.group(1)) if m else (name, None)


def hf_to_sluice(name: str, scheme: str = "llama") -> tuple[str | None, tuple[str, ...]]:
    """HF tensor name -> (how to split it or None, the sluice names it fills); ((None, ())) if unknown."""
    key, layer = _key(name)
    out = NAME_TABLES[scheme].get(key)
    if out is None:
        return None, ()
    split, names = (None, (out,)) if isinstance(out, str) else out
    return split, tuple(n.replace("{i}", layer) if layer else n for n in names)


def sluice_to_hf(name: str, scheme: str = "llama") -> str:
    key, layer = _key(name)
    for hf, out in NAME_TABLES[scheme].items():
        if key == out or (isinstance(out, tuple) and key in out[1]):
            return hf.replace("{i}", layer) if layer else hf
    raise KeyError(name)


def _source_shape(split: str | None, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape the HF tensor must have to become tensors of `shapes` (checked before reading it)."""
    if split is None:
        return shapes[0]
    joined = (sum(s[0] for s in shapes), *shapes[0][1:])  # pieces stacked along the output rows
    return joined[::-1] if split.startswith("conv1d") else joined


def _split(t: torch.Tensor, split: str | None, shapes: list[tuple[int, ...]], head_dim: int) -> list:
    if split is None:
        return [t]
    if split.startswith("conv1d"):
        t = t.t()  # Conv1D (in, out) -> Linear (out, in)
    if split == "per_head_fused":
        rows = t.shape[0] // 3
        t = t.reshape(rows // head_dim, 3, head_dim, *t.shape[1:])  # (H, q|k|v, D, ...)
        return [t[:, j].reshape(rows, *t.shape[3:]) for j in range(3)]
    return list(t.split([s[0] for s in shapes], dim=0))


def _read(f, hf_name: str, p, slices, head_dim: int) -> list[torch.Tensor]:
    """The tensors (or this process's parts of them, `slices` as in load_weights) that HF tensor
    `hf_name` becomes, in the order of p.names.

    A plain or Conv1D tensor is read as a slice (Conv1D's file layout is (in, out), so the Linear
    index is reversed before reading and the transpose comes after). A fused q|k|v tensor (GPT-2's
    c_attn, NeoX's query_key_value) cannot be sliced in the file: a rank's q rows are one contiguous
    block of q but not of the fused rows (NeoX even interleaves them per head), so it is read whole,
    split as for one process, and each piece cut to this rank's rows. That holds one layer's q, k and
    v at once (3 C^2 values for GPT-2, bounded by the layer, not the model) and frees it at once."""
    indices = [slices(n) if slices is not None else None for n in p.names]
    if len(p.names) > 1 or indices[0] is None:  # fused, or kept whole
        pieces = _split(f.get_tensor(hf_name), p.split, list(p.shapes), head_dim)
        return [t if i is None else t[i] for t, i in zip(pieces, indices, strict=True)]
    index = indices[0]
    if p.split == "conv1d":
        rows, cols = (*index, slice(None))[:2]
        return [f.get_slice(hf_name)[cols, rows].t()]
    return [f.get_slice(hf_name)[index]]


_DTYPE_NAMES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


@dataclass(frozen=True)
class Planned:
    """One HF tensor to read: which file, how to split it, the sluice tensors it becomes."""
    file: Path
    split: str | None
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def _expected_shapes(cfg) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(shapes outside the layers, shapes of layer {i}) of the model `cfg` describes, from a one-layer
    model on the meta device: the shapes come from layers.py itself, and nothing is allocated."""
    from .layers import Transformer  # imported here: layers imports config, not weights
    one = cfg.replace(num_layers=1, layer_types=cfg.layer_types[:1] if cfg.layer_types else None)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(one).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    layer = {k.replace("layers.0.", "layers.{i}.", 1): v for k, v in shapes.items() if k.startswith("layers.0.")}
    return {k: v for k, v in shapes.items() if not k.startswith("layers.")}, layer


def _layers_in(names, scheme: str) -> int:
    """How many layers the checkpoint's tensors describe (1 + the largest layer index)."""
    top = -1
    for name in names:
        _, out = hf_to_sluice(name, scheme)
        if out and out[0].startswith("layers."):
            top = max(top, int(out[0].split(".")[1]))
    return top + 1


def plan_checkpoint(cfg, model_dir: Path) -> dict[str, Planned]:
    """Check the config against the checkpoint's headers, reading no tensor data and building no
    model: every tensor the config implies must exist with the implied shape and a loadable dtype,
    and every tensor the files hold must be one the config implies. So a config.json claiming 10^9
    layers, or a hidden size the files do not have, fails here, in milliseconds. Returns
    {HF name: what to read} for load_weights."""
    scheme = scheme_of(cfg.architecture)
    found = {}
    for hf_name, info in read_headers(checkpoint_files(model_dir)).items():
        name = hf_name
        if scheme == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # the original GPT-2 files lack the prefix
        if not _IGNORED.fullmatch(name):
            found[name] = (hf_name, info)
    layers = _layers_in(found, scheme)
    if layers != cfg.num_layers:
        raise CheckpointError(f"{Path(model_dir) / 'config.json'}: the number of layers (num_hidden_layers; "
                              f"n_layer for GPT-2) is {cfg.num_layers:,}, but the checkpoint holds tensors "
                              f"for {layers}")
    top, layer = _expected_shapes(cfg)
    expected = dict(top)
    for i in range(cfg.num_layers):
        expected.update({k.replace("{i}", str(i)): v for k, v in layer.items()})
    plan: dict[str, Planned] = {}
    provided: set[str] = set()
    for name, (hf_name, info) in found.items():
        split, names = hf_to_sluice(name, scheme)
        if names == ("lm_head.weight",) and "lm_head.weight" not in expected:
            continue  # tied model whose file also stores the (identical) head
        where = f"{shown(hf_name)} in {info.file.name}"
        if not names or any(n not in expected for n in names):
            raise CheckpointError(f"unexpected tensor {where}: this {cfg.architecture} config has no such "
                                  "parameter")
        shapes = tuple(expected[n] for n in names)
        want = _source_shape(split, list(shapes))
        if info.shape != want:
            raise CheckpointError(f"tensor {where} has shape {info.shape}, but the config implies {want}")
        if _DTYPE_NAMES.get(info.dtype) not in _LOADABLE_DTYPES:
            raise CheckpointError(f"tensor {where} has dtype {_DTYPE_NAMES.get(info.dtype, info.dtype)}; "
                                  "sluice loads float32, float16 and bfloat16 checkpoints only")
        plan[hf_name] = Planned(info.file, split, names, shapes)
        provided.update(names)
    missing = sorted(set(expected) - provided)
    if missing:
        shown_ = ", ".join(f"{sluice_to_hf(n, scheme)!r} {expected[n]}" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint in {model_dir} is missing tensors: {shown_}{more}")
    return plan


def load_weights(model: torch.nn.Module, model_dir: Path, dtype: torch.dtype,
                 device: torch.device | str = "cpu", plan: dict[str, Planned] | None = None,
                 slices=None) -> None:
    """Fill `model` (built on the meta device) from the checkpoint in `model_dir`, cast to `dtype`.

    `plan` is plan_checkpoint's answer (made here when not given): every expected tensor is present
    with the expected shape, and anything unexpected was an error, because a silently ignored
    tensor means silently wrong numbers. Fused HF tensors (GPT-2's c_attn, NeoX's query_key_value)
    are split into q, k, v and Conv1D weights transposed, so inside sluice every family has the
    same named parameters.

    `slices` (tensor parallelism, parallel/sharding.py): a function of a sluice tensor name giving
    the index (a tuple of slices) of the part this process keeps, or None for the whole tensor. Only
    that part is read from the file, so no process materialises a full matrix it shards; the one
    exception is a fused q|k|v tensor (see _read), read whole one layer at a time."""
    plan = plan_checkpoint(model.config, Path(model_dir)) if plan is None else plan
    by_file: dict[Path, list[tuple[str, Planned]]] = {}
    for hf_name, p in plan.items():
        by_file.setdefault(p.file, []).append((hf_name, p))
    loaded: dict[str, torch.Tensor] = {}
    for path, tensors in by_file.items():
        try:
            f = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"cannot read {path.name}: {e}") from None
        with f:
            for hf_name, p in tensors:
                for n, piece in zip(p.names, _read(f, hf_name, p, slices, model.config.head_dim), strict=True):
                    loaded[n] = piece.to(device=device, dtype=dtype).contiguous()
    model.load_state_dict(loaded, strict=False, assign=True)
