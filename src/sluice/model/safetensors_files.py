"""Which safetensors files make a checkpoint, and what their headers say, read without the data.

Everything here treats the files as untrusted: an index may name shards outside the model
directory, a header may claim to be gigabytes long or describe tensors larger than the file. The
header is parsed here, bounded, before safetensors maps anything, so the config can be checked
against the real tensor names and shapes (weights.py) before a model is built.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError
from .hf_fields import is_int, shown
from .hub import is_inside

# Far above real checkpoints (a 405B model: 191 shards, ~1,100 tensors, headers of ~100 KiB).
MAX_HEADER_BYTES = 16 << 20  # safetensors itself allows 100 MB, parsed in full before any check
MAX_INDEX_BYTES = 64 << 20
MAX_SHARDS = 4096
MAX_TENSORS = 200_000
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # as safetensors spells it: "F32", "BF16", ...
    file: Path


def _weight_file(model_dir: Path, name: str, listed_in: Path) -> Path:
    """model_dir / name, refused unless it is a regular file inside the model directory."""
    pure = PurePosixPath(name)
    if not name or "\0" in name or "\\" in name or pure.is_absolute() or ".." in pure.parts:
        raise CheckpointError(f"{listed_in.name}: shard name {shown(name)} must be a file name inside "
                              f"{model_dir}")
    path = model_dir / name
    try:
        real = path.resolve()
        st = path.stat()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop on older Pythons
        raise CheckpointError(f"{listed_in.name} lists shard files that do not exist: {name} "
                              f"({getattr(e, 'strerror', None) or e})") from None
    if not is_inside(model_dir, real):
        raise CheckpointError(f"{name} in {model_dir} is a link to {real}, outside the model directory; "
                              "sluice reads weights only from inside it (copy the file in instead)")
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
        raise CheckpointError(f"{path} is not a regular file")
    return path


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or shards listed in the index)."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [_weight_file(model_dir, name, index) for name in _index_shards(index)]
    if single.exists():
        return [_weight_file(model_dir, single.name, single)]
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    if pickles:
        raise CheckpointError(
            f"{model_dir} holds only pickle weights ({', '.join(pickles)}). sluice refuses them: "
            "unpickling runs arbitrary code from the file. Convert them once, on a machine where you "
            "trust the file, to safetensors, e.g. python -c \"from transformers import "
            "AutoModelForCausalLM as M; M.from_pretrained('DIR').save_pretrained('OUT')\" "
            "(save_pretrained writes model.safetensors), then load OUT.")
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _index_shards(index: Path) -> list[str]:
    """The distinct shard names of model.safetensors.index.json, in order of first mention."""
    size = index.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index} is {size:,} bytes, more than the {MAX_INDEX_BYTES:,} an index may be")
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{index} is malformed ({str(e)[:200]}); expected a JSON object with a "
                              "'weight_map' of tensor name -> shard file") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: weight_map must be a JSON object of tensor name -> shard file "
                              f"name (strings), got {shown(weight_map)}")
    shards = list(dict.fromkeys(weight_map.values()))
    if not shards:
        raise CheckpointError(f"{index}: weight_map lists no shard files")
    if len(shards) > MAX_SHARDS:
        raise CheckpointError(f"{index} lists {len(shards):,} shard files; sluice reads at most {MAX_SHARDS:,}")
    return shards


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype)} from a safetensors header, every entry checked against the
    file's real size (so no shape can claim more bytes than the file holds)."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"cannot read {path.name}: {why}")

    try:
        with open(path, "rb") as fh:
            file_size = os.fstat(fh.fileno()).st_size
            if file_size < 8:
                raise bad(f"{file_size} bytes is too short for a safetensors file")
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > MAX_HEADER_BYTES:
                raise bad(f"its header claims {n:,} bytes, more than the {MAX_HEADER_BYTES:,} sluice reads")
            if 8 + n > file_size:
                raise bad(f"its header claims {n:,} bytes but the file has {file_size:,}")
            text = fh.read(n)
    except OSError as e:
        raise bad(e.strerror or str(e)) from None
    try:
        header = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise bad(f"the header is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data_size = file_size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape, dtype = _check_entry(entry, data_size)
        if shape is None:
            raise bad(f"the header entry for tensor {shown(name)} is malformed or points past the "
                      f"file's {data_size:,} data bytes: {shown(entry, 200)}")
        out[name] = (shape, dtype)
    return out


def _check_entry(entry, data_size: int):
    """(shape, dtype) of a well-formed header entry whose bytes lie inside the data; (None, None) if not."""
    if not isinstance(entry, dict):
        return None, None
    shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(is_int(s) and s >= 0 for s in shape) and isinstance(dtype, str)
            and isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        return None, None
    start, end = offsets
    if not 0 <= start <= end <= data_size:
        return None, None
    item = _ITEM_BYTES.get(dtype)
    if item is not None and math.prod(shape) * item != end - start:
        return None, None
    return tuple(shape), dtype


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor of every file, by name; a name in two files, or too many tensors, is refused."""
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        for name, (shape, dtype) in read_header(path).items():
            if name in tensors:
                raise CheckpointError(f"tensor {shown(name)} is in both {tensors[name].file.name} and {path.name}")
            tensors[name] = TensorInfo(shape, dtype, path)
        if len(tensors) > MAX_TENSORS:
            raise CheckpointError(f"the checkpoint in {path.parent} has more than {MAX_TENSORS:,} tensors")
    return tensors
