"""The tensors of a GGUF export: which checkpoint tensor becomes which llama.cpp tensor, in what
order and layout, read a few rows at a time so that an export never holds the model.

Each chunk of whole rows is read from the memory-mapped safetensors file, which is opened for
that chunk only: a mapping kept open keeps every page it touched resident, so one held for the
whole export would grow the process to the checkpoint's size even though nothing is kept. The
chunk is converted to float32 (exact from bf16 and f16), its q/k rows reordered for llama.cpp's
RoPE when the architecture needs it, and handed on to be encoded and written. Every GGUF encoding
is row-local (F16 and BF16 per value, Q8_0 and Q4_0 per block of 32 inside a row), so the file is
byte for byte the one whole tensors would give.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError, ConfigError

# float32 values per chunk (16 MiB): large enough that numpy's per-call cost vanishes, small
# enough that a chunk and its encoded copy are noise beside any real checkpoint.
CHUNK_VALUES = 1 << 22
# sluice parameter (inside a block, or at the top) -> llama.cpp's name for it (a gguf.MODEL_TENSOR
# member name; the package's table gives the spelling, e.g. ATTN_Q -> "blk.{bid}.attn_q").
_BLOCK_TENSORS = {
    "attn_norm": "ATTN_NORM", "attn.q": "ATTN_Q", "attn.k": "ATTN_K", "attn.v": "ATTN_V",
    "attn.o": "ATTN_OUT", "attn.q_norm": "ATTN_Q_NORM", "attn.k_norm": "ATTN_K_NORM",
    "mlp_norm": "FFN_NORM", "mlp.gate": "FFN_GATE", "mlp.up": "FFN_UP", "mlp.down": "FFN_DOWN",
}
_TOP_TENSORS = {"embed": "TOKEN_EMBD", "final_norm": "OUTPUT_NORM", "lm_head": "OUTPUT"}


def rope_interleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight or bias) from HF's rotate-half layout to llama.cpp's
    interleaved one: within each head, rows [0..D/2) and [D/2..D) become the even and odd rows."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_deinterleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of rope_interleave (to read a llama-architecture GGUF back into HF layout)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class Source:
    """One tensor of the GGUF file and where its values come from: a checkpoint tensor (hf_name in
    file), or `value`, computed here (rope_freqs)."""
    name: str  # llama.cpp's
    shape: tuple[int, ...]
    hf_name: str | None = None
    file: Path | None = None
    head_dim: int = 0  # > 0: q/k rows reordered per head of this size
    value: torch.Tensor | None = None

    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def chunks(self) -> Iterator[torch.Tensor]:
        """The tensor in llama.cpp's layout, float32, as consecutive chunks of whole rows."""
        if self.value is not None:
            yield self.value.to(torch.float32)
            return
        rows = self.shape[0]
        step = rows if len(self.shape) == 1 else max(1, CHUNK_VALUES // self.shape[1])
        if self.head_dim:  # the reordering stays inside a head: chunks of whole heads
            step = max(1, step // self.head_dim) * self.head_dim
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            try:
                f = safe_open(str(self.file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise CheckpointError(f"cannot read {self.file.name}: {e}") from None
            with f:  # closed at once: its mapping goes, and with it the pages this chunk read
                t = f.get_slice(self.hf_name)[start:stop].to(torch.float32)
            if self.head_dim:
                t = rope_interleave(t, (stop - start) // self.head_dim)
            yield t


def _rope_freq_factors(cfg) -> torch.Tensor:
    """llama.cpp's rope_freqs tensor for Llama 3 RoPE scaling: by how much each pair's frequency is
    divided. sluice's own scaled frequencies give it directly, so both engines rotate alike."""
    from .layers import rope_inv_freq
    return rope_inv_freq(cfg.replace(rope_scaling=None)) / rope_inv_freq(cfg)


def _block_index(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def plan_tensors(cfg, model_dir: Path, arch: str, interleave: bool) -> list[Source]:
    """Every tensor of the file, reading no tensor data: the token embedding (and rope_freqs)
    first, then block by block in the order of sluice's parameters, the final norm and output last.
    The checkpoint's headers are checked against the config first (weights.plan_checkpoint)."""
    import gguf

    from .layers import Transformer
    from .weights import plan_checkpoint

    by_sluice = {}
    for hf_name, p in plan_checkpoint(cfg, model_dir).items():
        if p.split is not None:  # fused q|k|v: no exported family stores one
            raise ConfigError(f"export-gguf cannot split the fused checkpoint tensor {hf_name!r}")
        by_sluice[p.names[0]] = (hf_name, p.file, p.shapes[0])
    kinds = gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]
    names = {}  # sluice name -> gguf name
    for prefix, table in [("", _TOP_TENSORS)] + [(f"layers.{i}.", _BLOCK_TENSORS) for i in range(cfg.num_layers)]:
        bid = int(prefix.split(".")[1]) if prefix else None
        for ours, theirs in table.items():
            kind = gguf.MODEL_TENSOR[theirs]
            for suffix in ("weight", "bias"):
                names[f"{prefix}{ours}.{suffix}"] = (kind, gguf.TENSOR_NAMES[kind].format(bid=bid) + "." + suffix)
    with torch.device("meta"):  # the parameters' order, allocating nothing
        order = list(Transformer(cfg).state_dict())
    out = []
    for name in order:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp reuses token_embd when there is no output tensor
        if name not in names:
            raise ConfigError(f"export-gguf has no llama.cpp name for sluice parameter {name!r}")
        kind, gguf_name = names[name]
        if kind not in kinds:
            raise ConfigError(f"llama.cpp's {arch} architecture has no {gguf_name} tensor (sluice: {name})")
        hf_name, file, shape = by_sluice[name]
        head_dim = cfg.head_dim if interleave and name.endswith((".attn.q.weight", ".attn.q.bias",
                                                                 ".attn.k.weight", ".attn.k.bias")) else 0
        out.append(Source(gguf_name, tuple(shape), hf_name, file, head_dim))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "llama3":
        if arch != "llama":
            raise ConfigError(f"Llama 3 RoPE scaling on {cfg.architecture} has no llama.cpp equivalent")
        factors = _rope_freq_factors(cfg)
        out.insert(0, Source(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", tuple(factors.shape),
                             value=factors))
    rank = {"token_embd": 0, "rope_freqs": 0, "output_norm": 2, "output": 2}
    out.sort(key=lambda s: (rank.get(s.name.split(".")[0], 1), _block_index(s.name)))
    return out
