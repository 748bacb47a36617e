"""`system_fingerprint`: one short string that changes when what decides a response's tokens changes.

OpenAI's meaning: two responses with the same fingerprint came from the same backend configuration, so
a seeded request is comparable between them. Here the fingerprint is a hash of
    sluice's and torch's versions;
    the checkpoint: config.json, generation_config.json and the tokenizer's files, byte for byte, and
    each safetensors file's name, size and header (its tensors' names, dtypes, shapes and offsets);
    the options that change the numbers: dtype, quantization, compute, device type, speculative
    decoding and its draft (the same checkpoint identity), tensor-parallel size;
    the step's path: sluice's native step or the torch forward (they agree to rounding, not bit for bit).
The weights' values are not read (hashing gigabytes at every start would cost more than the load); the
safetensors headers tell a different checkpoint of the same files' names apart by their offsets and
sizes, and a fine-tune of the same shape by neither: its config or file sizes seldom match exactly.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from .. import __version__
from ..engine.speculative import draft_dir

# The checkpoint's small files that decide tokens: the model's shape, the defaults, the tokenizer, the template.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "tokenizer.model")
MAX_FILE_BYTES = 64 * 2**20  # a bigger file of those names is identified by its size alone
MAX_HEADER_BYTES = 16 * 2**20  # safetensors' own cap on its JSON header is 100 MB; real ones are under 1 MB


def checkpoint_identity(model_dir: Path) -> str:
    """A hex digest of the checkpoint files that decide its output (see the module's docstring)."""
    h = hashlib.sha256()
    for name in MODEL_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            size = path.stat().st_size
            h.update(f"{name}\0{size}\0".encode())
            if size <= MAX_FILE_BYTES:
                h.update(path.read_bytes())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        h.update(_safetensors_header(path))
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return b""
        (length,) = struct.unpack("<Q", head)
        return f.read(length) if length <= MAX_HEADER_BYTES else b""


class Fingerprint:
    """An LLM's fingerprint: the fixed part hashed once, at construction; the step's path read per call
    (it can change between busy periods, when a background kernel build lands)."""

    def __init__(self, llm):
        self.llm = llm
        cfg = llm.engine_config
        draft = None if cfg.draft_model is None else checkpoint_identity(draft_dir(cfg.draft_model))
        self.parts = {"sluice": __version__, "torch": torch.__version__, "model": checkpoint_identity(llm.model_dir),
                      "dtype": cfg.dtype, "quantize": cfg.quantize, "compute": cfg.compute, "device": llm.device.type,
                      "speculative": llm.speculative, "num_speculative_tokens": cfg.num_speculative_tokens,
                      "draft": draft, "tp": cfg.tensor_parallel}
        self._base = json.dumps(self.parts, sort_keys=True, default=str)
        self._by_path: dict[str, str] = {}

    def path(self) -> str:
        """"native" when the current busy period runs sluice's native step, else "torch"."""
        forward = self.llm.batch_engine().scheduler.forward
        return "native" if forward.use_fast else "torch"

    def __call__(self) -> str:
        path = self.path()
        if path not in self._by_path:
            digest = hashlib.sha256(f"{self._base}\0{path}".encode()).hexdigest()
            self._by_path[path] = "fp_" + digest[:10]
        return self._by_path[path]
