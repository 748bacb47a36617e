"""Safetensors shards -> model tensors. The only place that knows Hugging Face tensor names.

Loading is lazy and one tensor at a time: the model is built on the meta device (no memory),
each tensor is read from the memory-mapped file, cast to the target dtype and assigned, so peak
memory is one copy of the weights plus one tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError

# HF name (with {i} for the layer) -> sluice name. One literal table, in both directions.
HF_TO_SLUICE = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
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
}
SLUICE_TO_HF = {v: k for k, v in HF_TO_SLUICE.items()}
# Tensors some old checkpoints carry that are derived, not learned: safe to skip.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LOADABLE_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
_LAYER = re.compile(r"\.(\d+)\.")


def _rename(name: str, table: dict[str, str]) -> str | None:
    m = _LAYER.search(name)
    key = name[: m.start()] + ".{i}." + name[m.end():] if m else name
    out = table.get(key)
    return out.replace("{i}", m.group(1)) if (out and m) else out


def hf_to_sluice(name: str) -> str | None:
    return _rename(name, HF_TO_SLUICE)


def sluice_to_hf(name: str) -> str:
    out = _rename(name, SLUICE_TO_HF)
    if out is None:
        raise KeyError(name)
    return out


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or shards listed in the index)."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed ({e}); expected a JSON object with a "
                                  "'weight_map' of tensor name -> shard file") from None
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    if single.is_file():
        return [single]
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    if pickles:
        raise CheckpointError(
            f"{model_dir} holds only pickle weights ({', '.join(pickles)}). sluice refuses them: "
            "unpickling runs arbitrary code from the file. Convert them once, on a machine where you "
            "trust the file, to safetensors, e.g. python -c \"from transformers import "
            "AutoModelForCausalLM as M; M.from_pretrained('DIR').save_pretrained('OUT')\" "
            "(save_pretrained writes model.safetensors), then load OUT.")
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def load_weights(model: torch.nn.Module, model_dir: Path, dtype: torch.dtype) -> None:
    """Fill `model` (built on the meta device) from the checkpoint in `model_dir`, cast to `dtype`.

    Every expected tensor must be present with the expected shape; anything unexpected is an
    error too, because a silently ignored tensor means silently wrong numbers."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    loaded: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        try:
            f = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {path.name}: {e}") from None
        with f:
            for hf_name in f.keys():
                if _IGNORED.fullmatch(hf_name):
                    continue
                name = hf_to_sluice(hf_name)
                if name == "lm_head.weight" and "lm_head.weight" not in expected:
                    continue  # tied model whose file also stores the (identical) head
                if name is None or name not in expected:
                    raise CheckpointError(f"unexpected tensor {hf_name!r} in {path.name}: this "
                                          f"{model.config.architecture} config has no such parameter")
                shape = tuple(f.get_slice(hf_name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(f"tensor {hf_name!r} in {path.name} has shape {shape}, "
                                          f"but the config implies {expected[name]}")
                t = f.get_tensor(hf_name)
                if t.dtype not in _LOADABLE_DTYPES:
                    raise CheckpointError(f"tensor {hf_name!r} has dtype {t.dtype}; sluice loads "
                                          "float32, float16 and bfloat16 checkpoints only")
                loaded[name] = t.to(dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        shown = ", ".join(f"{sluice_to_hf(n)!r} {expected[n]}" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint in {model_dir} is missing tensors: {shown}{more}")
    model.load_state_dict(loaded, strict=False, assign=True)
