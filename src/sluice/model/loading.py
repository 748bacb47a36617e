"""sluice.load(): path or repo id -> a ready model in eval mode, built on meta, filled from mmap."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError
from .hf_fields import shown
from .config import ModelConfig
from .hub import resolve_model_dir
from .hugepages import move_to_huge_pages
from .layers import Transformer
from .quant import check_quantize, quantize_
from .weights import load_weights, plan_checkpoint

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16}


BUNDLED_MODEL = "sluice-stdlib"
BUNDLED_DRAFT = "sluice-stdlib-draft"


def bundled_model_dir() -> Path:
    """The model sluice trained itself (training/recipes/stdlib.toml), shipped inside the package."""
    path = Path(__file__).parents[1] / "assets" / BUNDLED_MODEL
    if not (path / "config.json").is_file():
        raise ConfigError(f"the bundled model is missing from {path}; reinstall sluice-llm or pass "
                          "--model with a local checkpoint directory")
    return path


def bundled_draft_dir() -> Path:
    """The bundled model's draft for speculative decoding (training/recipes/stdlib-draft.toml): its
    tokenizer, 10x fewer parameters."""
    path = Path(__file__).parents[1] / "assets" / BUNDLED_DRAFT
    if not (path / "config.json").is_file():
        raise ConfigError(f"the bundled draft model is missing from {path}; reinstall sluice-llm or pass "
                          "a local draft checkpoint directory")
    return path


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {shown(dtype)}")


def parse_device(device: str | torch.device) -> torch.device:
    """"cpu", "cuda", "cuda:N" or "mps", checked against what this machine and this torch build have."""
    bad = ConfigError(f"device must be cpu, cuda, cuda:N or mps, got {shown(device)}")
    if isinstance(device, bool):  # torch.device(True) would be cuda:1
        raise bad
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError, OverflowError):
        raise bad from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"device {str(dev)!r} is not available: {why} (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {str(dev)!r} is not available: {torch.cuda.device_count()} CUDA "
                              "device(s) visible")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError("device 'mps' is not available: it needs Apple silicon and a torch build with MPS")
    elif dev.type != "cpu" or dev.index not in (None, 0):
        raise bad
    return dev


def load(path_or_repo_id: str | Path | None = None, dtype: str | torch.dtype = "float32",
         device: str | torch.device = "cpu", quantize: str | None = None) -> Transformer:
    """Load a Hugging Face checkpoint (local directory or cached repo id; None = the bundled model).

    `model(input_ids)` with a LongTensor (B, T) returns fp32 logits (B, T, vocab). Weights go
    straight from the mmap'd file to `device`, one tensor at a time. quantize="int8" | "int4"
    stores the linears' weights quantized, on the CPU (model/quant.py, docs/quantization.md)."""
    torch_dtype = parse_dtype(dtype)
    dev = parse_device(device)
    if quantize is not None:
        check_quantize(quantize, dev)
    model_dir = bundled_model_dir() if path_or_repo_id is None else resolve_model_dir(path_or_repo_id)
    cfg = ModelConfig.from_hf(model_dir)
    # The config against the files' headers before anything is built: a config.json whose sizes the
    # weights do not have fails here, not after building a model of 10^9 layers.
    plan = plan_checkpoint(cfg, model_dir)
    with torch.device("meta"):
        model = Transformer(cfg)
    load_weights(model, model_dir, torch_dtype, dev, plan)
    model.tie_weights()
    model.reset_rope(dev)
    model.model_dir = model_dir
    model.eval().requires_grad_(False)
    if quantize is not None:
        model = quantize_(model, quantize)
    # The weights from the file's 4 KiB pages into huge pages where the kernel allows (model/hugepages.py):
    # the same tensors, read faster by every decode step. model.huge_pages says what moved, or why nothing did.
    model.huge_pages = move_to_huge_pages(model)
    return model
