"""`sluice export-gguf`: a checkpoint sluice loads, written as a GGUF file that llama.cpp runs.

The weights come from sluice's own loader (so Hugging Face names stay in weights.py) and are
renamed to llama.cpp's tensor names for the architectures whose llama.cpp graph matches sluice's
model with the same tensors: Llama and Mistral (llama.cpp's "llama"), Qwen2 and Qwen3. Metadata
follows llama.cpp's own converter (convert_hf_to_gguf.py), so llama.cpp reads the file as if it
had converted the checkpoint itself.

Two details decide whether llama.cpp computes the same function:
- RoPE layout. Hugging Face checkpoints rotate the pair (x[i], x[i + D/2]) of each head ("rotate
  half", sluice's apply_rope). llama.cpp's "llama" architecture rotates adjacent pairs
  (x[2i], x[2i+1]), so the converter reorders the rows of q and k inside every head; "qwen2" and
  "qwen3" use llama.cpp's NEOX rope type, which rotates halves like HF, so their rows stay as they are.
- Precision. Norm gains and other 1-D tensors stay float32, as llama.cpp keeps them; only the
  2-D matrices take the requested type. q4_0 is `llama-quantize --pure`'s: every matrix Q4_0
  (its default mix makes the output Q6_K), the bytes per weight of sluice's int4.

The file is written tensor by tensor to a temporary file next to the target and renamed at the
end, so an interrupted export leaves nothing half-written under the target name.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, SluiceError
from .gguf_vocab import add_generation_defaults, add_tokenizer
from .weights import scheme_of, sluice_to_hf

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
# HF architecture -> (llama.cpp architecture, whether q/k rows are reordered for its RoPE).
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
}
# sluice parameter (inside a block, or at the top) -> llama.cpp's name for it (a gguf.MODEL_TENSOR
# member name; the package's table gives the spelling, e.g. ATTN_Q -> "blk.{bid}.attn_q").
_BLOCK_TENSORS = {
    "attn_norm": "ATTN_NORM", "attn.q": "ATTN_Q", "attn.k": "ATTN_K", "attn.v": "ATTN_V",
    "attn.o": "ATTN_OUT", "attn.q_norm": "ATTN_Q_NORM", "attn.k_norm": "ATTN_K_NORM",
    "mlp_norm": "FFN_NORM", "mlp.gate": "FFN_GATE", "mlp.up": "FFN_UP", "mlp.down": "FFN_DOWN",
}
_TOP_TENSORS = {"embed": "TOKEN_EMBD", "final_norm": "OUTPUT_NORM", "lm_head": "OUTPUT"}
# (llama file type, matrix tensor type) per outtype; file types are gguf.LlamaFileType's values.
_FILE_TYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"),
               "bf16": ("MOSTLY_BF16", "BF16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0"), "q4_0": ("MOSTLY_Q4_0", "Q4_0")}


class ExportError(SluiceError):
    """The GGUF file cannot be written (no room on the disk, an unwritable target)."""


def rope_interleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight or bias) from HF's rotate-half layout to llama.cpp's
    interleaved one: within each head, rows [0..D/2) and [D/2..D) become the even and odd rows."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_deinterleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of rope_interleave (to read a llama-architecture GGUF back into HF layout)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _family(cfg) -> tuple[str, bool]:
    if cfg.architecture not in ARCHITECTURES:
        raise ConfigError(f"export-gguf does not support {cfg.architecture} (its llama.cpp graph differs "
                          f"from sluice's); supported: {', '.join(ARCHITECTURES)}")
    if cfg.architecture == "Qwen3ForCausalLM" and (cfg.o_bias or cfg.mlp_bias):
        # llama.cpp's qwen3 graph has no output-projection or MLP biases (released Qwen3 has none).
        raise ConfigError("export-gguf: Qwen3 with attention_bias=true has an output-projection bias "
                          "that llama.cpp's qwen3 architecture does not read")
    return ARCHITECTURES[cfg.architecture]


def _rope_freq_factors(cfg) -> torch.Tensor:
    """llama.cpp's rope_freqs tensor for Llama 3 RoPE scaling: by how much each pair's frequency is
    divided. sluice's own scaled frequencies give it directly, so both engines rotate alike."""
    from .layers import rope_inv_freq
    return rope_inv_freq(cfg.replace(rope_scaling=None)) / rope_inv_freq(cfg)


def plan_tensors(model, arch: str, interleave: bool) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor in llama.cpp's layout) for every weight: the token embedding (and
    rope_freqs) first, then block by block, the final norm and output last."""
    import gguf

    cfg = model.config
    kinds = gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]
    names = {}  # sluice name -> gguf name
    for prefix, table in [("", _TOP_TENSORS)] + [(f"layers.{i}.", _BLOCK_TENSORS) for i in range(cfg.num_layers)]:
        bid = int(prefix.split(".")[1]) if prefix else None
        for ours, theirs in table.items():
            kind = gguf.MODEL_TENSOR[theirs]
            for suffix in ("weight", "bias"):
                names[f"{prefix}{ours}.{suffix}"] = (kind, gguf.TENSOR_NAMES[kind].format(bid=bid) + "." + suffix)
    out = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp reuses token_embd when there is no output tensor
        if name not in names:
            raise ConfigError(f"export-gguf has no llama.cpp name for sluice parameter {name!r}")
        kind, gguf_name = names[name]
        if kind not in kinds:
            raise ConfigError(f"llama.cpp's {arch} architecture has no {gguf_name} tensor (sluice: {name})")
        if interleave and name.endswith(("attn.q.weight", "attn.q.bias")):
            t = rope_interleave(t, cfg.num_heads)
        elif interleave and name.endswith(("attn.k.weight", "attn.k.bias")):
            t = rope_interleave(t, cfg.num_kv_heads)
        out.append((gguf_name, t))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "llama3":
        if arch != "llama":
            raise ConfigError(f"Llama 3 RoPE scaling on {cfg.architecture} has no llama.cpp equivalent")
        out.insert(0, (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", _rope_freq_factors(cfg)))
    order = {"token_embd": 0, "rope_freqs": 0, "output_norm": 2, "output": 2}
    out.sort(key=lambda nt: (order.get(nt[0].split(".")[0], 1), _block_index(nt[0])))
    return out


def _refuse_nonfinite(model, architecture: str) -> None:
    """A weight holding NaN or inf makes every output of llama.cpp garbage, far from the cause: say
    which checkpoint tensor it is here instead of writing a file that only looks fine."""
    for name, t in model.state_dict().items():
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            try:
                name = sluice_to_hf(name, scheme_of(architecture))
            except KeyError:
                pass  # no checkpoint name (a derived tensor): sluice's own name still says where
            raise ExportError(f"the checkpoint's tensor {name} holds {bad} NaN or infinite value(s) of "
                              f"{t.numel()}; a GGUF file of it would compute garbage, so none is written")


def _block_index(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _tensor_type(t: torch.Tensor, matrix_type: str):
    """The GGML type a tensor is stored as: 1-D always F32; Q8_0 and Q4_0 need rows that are whole
    blocks of 32 and fall back to F16 otherwise, as llama.cpp's converter and llama-quantize do."""
    import gguf

    q = gguf.GGMLQuantizationType
    if t.dim() < 2:
        return q.F32
    qtype = q[matrix_type]
    if qtype in (q.Q8_0, q.Q4_0) and t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return q.F16
    return qtype


def _nbytes(shape: tuple[int, ...], qtype) -> int:
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * block_bytes


def _encode(t: torch.Tensor, qtype) -> np.ndarray:
    import gguf

    data = t.detach().to(torch.float32).cpu().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data)
    return gguf.quants.quantize(data, qtype)  # F16, BF16 (round to nearest even), Q8_0, Q4_0, in numpy


def _add_hparams(writer, cfg, arch: str, file_type: int, name: str, n_params: int) -> None:
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_size_label(gguf.size_label(n_params, n_params, 0, 0))
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_file_type(file_type)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.head_dim)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _load_dtype(model_dir: Path, outtype: str) -> torch.dtype:
    """bfloat16 when every stored tensor is bf16 and the output is not f32 (exact, half the memory),
    else float32."""
    from safetensors import safe_open

    from .weights import checkpoint_files
    if outtype == "f32":
        return torch.float32
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            if any(f.get_slice(k).get_dtype() != "BF16" for k in f.keys()):
                return torch.float32
    return torch.bfloat16


def export_gguf(model_dir: str | Path | None, out_path: str | Path, outtype: str = "bf16",
                progress=None) -> dict:
    """Write the checkpoint in `model_dir` (None = the bundled model; a cached repo id works too)
    to `out_path` as GGUF. outtype: f32, f16, bf16, q8_0 or q4_0 for the 2-D weights.
    Returns a summary: arch, tensors, bytes, outtype, path, seconds, and the tokenizer's details.
    `progress(done, total)` is called after each tensor, if given."""
    import gguf

    from .config import ModelConfig
    from .hub import resolve_model_dir
    from .loading import bundled_model_dir, load

    if outtype not in OUTTYPES:
        raise ConfigError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    start = time.perf_counter()
    src = bundled_model_dir() if model_dir is None else resolve_model_dir(model_dir)
    cfg = ModelConfig.from_hf(src)
    arch, interleave = _family(cfg)  # refuse before the (slow) load
    out = Path(out_path).expanduser().resolve()
    if out.is_dir():
        raise ExportError(f"{out} is a directory; --out takes the path of the .gguf file to write")
    if out.exists() and not out.is_file():
        # The file is renamed over the target at the end: over /dev/null (as root) that would swap
        # the system's device for a regular file.
        raise ExportError(f"{out} exists and is not a regular file (a device, FIFO or socket); --out "
                          "takes the path of a .gguf file to write or replace")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create the directory {out.parent}: {e}") from None

    model = load(src, _load_dtype(src, outtype))
    _refuse_nonfinite(model, cfg.architecture)
    tensors = plan_tensors(model, arch, interleave)
    file_type_name, matrix_type = _FILE_TYPES[outtype]
    writer = gguf.GGUFWriter(None, arch)
    n_params = sum(t.numel() for _, t in tensors)
    _add_hparams(writer, cfg, arch, int(gguf.LlamaFileType[file_type_name]), src.name, n_params)
    vocab = add_tokenizer(writer, src, cfg.vocab_size)
    add_generation_defaults(writer, src)
    types = []
    for name, t in tensors:
        qtype = _tensor_type(t, matrix_type)
        shape = tuple(t.shape)
        writer.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, qtype), raw_dtype=qtype)
        types.append(qtype)
    data_bytes = sum(_nbytes(tuple(t.shape), q) for (_, t), q in zip(tensors, types, strict=True))
    # Room for the tensors plus the header (token strings and merges), with a margin.
    need = data_bytes + 64 * 1024 * 1024
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise ExportError(f"not enough free disk space in {out.parent}: the file needs about "
                          f"{need / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free")

    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, ((_, t), qtype) in enumerate(zip(tensors, types, strict=True)):
            writer.write_tensor_data(_encode(t, qtype))
            if progress is not None:
                progress(i + 1, len(tensors))
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    notes = []
    if vocab["skipped"]:
        notes.append(f"no tokenizer written ({vocab['skipped']}): llama.cpp can run this file on token "
                     "ids only")
    elif vocab["pre"] is None:
        notes.append("the tokenizer's pre-tokenizer split has no llama.cpp name; llama.cpp will use its "
                     "default split, so its tokenization of some text may differ from sluice's")
    if cfg.sliding_window and cfg.sliding_window < cfg.max_position_embeddings:
        notes.append(f"sliding-window attention ({cfg.sliding_window} tokens) is not written: llama.cpp's "
                     "llama architecture attends over the whole context, so outputs differ past the window")
    return {"path": str(out), "arch": arch, "architecture": cfg.architecture, "outtype": outtype,
            "tensors": len(tensors), "bytes": out.stat().st_size,
            "types": {q.name: types.count(q) for q in dict.fromkeys(types)},
            "tokenizer_pre": vocab["pre"], "tokens": vocab["tokens"], "merges": vocab["merges"],
            "chat_template": vocab["chat_template"], "seconds": round(time.perf_counter() - start, 2),
            "notes": notes}
