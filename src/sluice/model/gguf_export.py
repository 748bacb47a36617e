"""`sluice export-gguf`: a checkpoint sluice loads, written as a GGUF file that llama.cpp runs.

The weights are read with sluice's own name tables and checks (so Hugging Face names stay in
weights.py) and renamed to llama.cpp's tensor names for the architectures whose llama.cpp graph matches sluice's
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

Memory. No model is built: each tensor streams from the memory-mapped checkpoint into the file a
chunk of rows at a time (gguf_tensors.py), converted, encoded, written and dropped, so a 16 GB
checkpoint exports in the memory of a few 16 MiB chunks plus the tokenizer. gguf's GGUFWriter
writes the header, the metadata and the tensor index from shapes alone; the data section after it
is appended here, chunk by chunk, with the writer's alignment, where its write_tensor_data would
want each tensor whole.

The file is written to a temporary file next to the target and renamed at the end, so an
interrupted export (or a NaN found in the last tensor) leaves nothing half-written under the
target name.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, SluiceError
from .gguf_tensors import Source, plan_tensors, rope_deinterleave, rope_interleave
from .gguf_vocab import add_generation_defaults, add_tokenizer

__all__ = ["ARCHITECTURES", "ExportError", "OUTTYPES", "export_gguf", "rope_deinterleave", "rope_interleave"]

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
# HF architecture -> (llama.cpp architecture, whether q/k rows are reordered for its RoPE).
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
}
# (llama file type, matrix tensor type) per outtype; file types are gguf.LlamaFileType's values.
_FILE_TYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"),
               "bf16": ("MOSTLY_BF16", "BF16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0"), "q4_0": ("MOSTLY_Q4_0", "Q4_0")}


class ExportError(SluiceError):
    """The GGUF file cannot be written (no room on the disk, an unwritable target)."""


def _family(cfg) -> tuple[str, bool]:
    if cfg.architecture not in ARCHITECTURES:
        raise ConfigError(f"export-gguf does not support {cfg.architecture} (its llama.cpp graph differs "
                          f"from sluice's); supported: {', '.join(ARCHITECTURES)}")
    if cfg.architecture == "Qwen3ForCausalLM" and (cfg.o_bias or cfg.mlp_bias):
        # llama.cpp's qwen3 graph has no output-projection or MLP biases (released Qwen3 has none).
        raise ConfigError("export-gguf: Qwen3 with attention_bias=true has an output-projection bias "
                          "that llama.cpp's qwen3 architecture does not read")
    return ARCHITECTURES[cfg.architecture]


def _tensor_type(shape: tuple[int, ...], matrix_type: str):
    """The GGML type a tensor is stored as: 1-D always F32; Q8_0 and Q4_0 need rows that are whole
    blocks of 32 and fall back to F16 otherwise, as llama.cpp's converter and llama-quantize do."""
    import gguf

    q = gguf.GGMLQuantizationType
    if len(shape) < 2:
        return q.F32
    qtype = q[matrix_type]
    if qtype in (q.Q8_0, q.Q4_0) and shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return q.F16
    return qtype


def _nbytes(shape: tuple[int, ...], qtype) -> int:
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * block_bytes


def _encode(t: torch.Tensor, qtype) -> np.ndarray:
    """A float32 chunk of whole rows as the bytes of GGML type qtype."""
    import gguf

    data = t.numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data)
    return gguf.quants.quantize(data, qtype)  # F16, BF16 (round to nearest even), Q8_0, Q4_0, in numpy


def _refuse_nonfinite(s: Source) -> None:
    """A weight holding NaN or inf makes every output of llama.cpp garbage, far from the cause: say
    which checkpoint tensor it is (and how many values) instead of finishing a file that only looks fine."""
    bad = sum(int((~torch.isfinite(c)).sum()) for c in s.chunks())
    raise ExportError(f"the checkpoint's tensor {s.hf_name or s.name} holds {bad} NaN or infinite value(s) "
                      f"of {s.numel()}; a GGUF file of it would compute garbage, so none is written")


def _write_data(path: Path, tensors: list[Source], types: list, alignment: int, progress) -> None:
    """Append the data section after the writer's tensor index: each tensor chunk by chunk, each
    starting at a multiple of `alignment` and the last padded to one (what write_tensor_data does)."""
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        for i, (s, qtype) in enumerate(zip(tensors, types, strict=True)):
            f.write(bytes(-f.tell() % alignment))
            for chunk in s.chunks():
                if not bool(torch.isfinite(chunk).all()):
                    _refuse_nonfinite(s)
                _encode(chunk, qtype).tofile(f)
            if progress is not None:
                progress(i + 1, len(tensors))
        f.write(bytes(-f.tell() % alignment))


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


def export_gguf(model_dir: str | Path | None, out_path: str | Path, outtype: str = "bf16",
                progress=None) -> dict:
    """Write the checkpoint in `model_dir` (None = the bundled model; a cached repo id works too)
    to `out_path` as GGUF. outtype: f32, f16, bf16, q8_0 or q4_0 for the 2-D weights.
    Returns a summary: arch, tensors, bytes, outtype, path, seconds, and the tokenizer's details.
    `progress(done, total)` is called after each tensor, if given."""
    import gguf

    from .config import ModelConfig
    from .hub import resolve_model_dir
    from .loading import bundled_model_dir

    if outtype not in OUTTYPES:
        raise ConfigError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    start = time.perf_counter()
    src = bundled_model_dir() if model_dir is None else resolve_model_dir(model_dir)
    cfg = ModelConfig.from_hf(src)
    arch, interleave = _family(cfg)  # refuse before reading the checkpoint
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

    tensors = plan_tensors(cfg, src, arch, interleave)
    file_type_name, matrix_type = _FILE_TYPES[outtype]
    writer = gguf.GGUFWriter(None, arch)
    n_params = sum(s.numel() for s in tensors)
    _add_hparams(writer, cfg, arch, int(gguf.LlamaFileType[file_type_name]), src.name, n_params)
    vocab = add_tokenizer(writer, src, cfg.vocab_size)
    add_generation_defaults(writer, src)
    types = [_tensor_type(s.shape, matrix_type) for s in tensors]
    for s, qtype in zip(tensors, types, strict=True):
        writer.add_tensor_info(s.name, s.shape, np.dtype(np.float32), _nbytes(s.shape, qtype), raw_dtype=qtype)
    data_bytes = sum(_nbytes(s.shape, q) for s, q in zip(tensors, types, strict=True))
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
        writer.close()
        _write_data(tmp, tensors, types, writer.data_alignment, progress)
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
