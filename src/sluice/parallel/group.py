"""The process group tensor parallelism runs on, and every collective it uses.

torch.distributed does the transport (gloo on CPU, NCCL on GPUs); this file only starts it with a
timeout and funnels each collective through one place, so a rank that died or hangs becomes a
ParallelError with a message instead of an endless wait or a C++ traceback. The process group's
timeout bounds every collective: a peer that stopped answering is noticed within it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import CheckpointError, ConfigError, SluiceError
from ..model.safetensors_files import checkpoint_files, read_headers

DEFAULT_TIMEOUT_S = 300.0
JOINED = False  # set once this process has joined a group (cli.exit_process reads it)  # long enough for the slowest rank to finish loading a large checkpoint


class ParallelError(SluiceError):
    """A collective failed: another rank died, hung past the timeout, or the group cannot start."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the group: rank r of `world` processes, and the collectives' timeout."""
    rank: int
    world: int
    timeout_s: float


def init(rank: int | None = None, world: int | None = None, init_method: str | None = None,
         timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None, device=None) -> Ranks:
    """Join (or start) the default process group; returns this process's Ranks.

    Without arguments the values come from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT); tests pass rank, world and a file:// or tcp:// init_method instead. gloo for a
    model on the CPU, NCCL for one on CUDA (`device`), unless `backend` says otherwise."""
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ConfigError(f"the collective timeout must be a positive number of seconds, got {timeout_s!r}")
    if dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), float(timeout_s))
    if rank is None or world is None:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ConfigError(f"tensor parallelism needs torchrun's environment ({', '.join(missing)} not set): "
                              "launch with `torchrun --nproc-per-node N ...`")
        bad = [f"{k}={os.environ[k]!r}" for k in ("RANK", "WORLD_SIZE") if not os.environ[k].strip().isdecimal()]
        if bad:
            raise ConfigError(f"{' and '.join(bad)}: torchrun sets these to integers; launch with "
                              "`torchrun --nproc-per-node N ...`")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_method = init_method or "env://"
    if not (0 <= rank < world):
        raise ConfigError(f"rank {rank} is outside a group of {world} processes")
    on_cuda = device is not None and torch.device(device).type == "cuda"
    backend = backend or ("nccl" if on_cuda else "gloo")
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:  # the store timed out, or a rendezvous address is bad
        raise ParallelError(f"rank {rank} of {world}: cannot start the process group ({backend}, "
                            f"{init_method}): {_first_line(e)}") from None
    global JOINED
    JOINED = True
    return Ranks(rank, world, float(timeout_s))


def rank_device(device, ranks: Ranks):
    """The device this rank's part lives on: "cuda" without an index means this process's own GPU,
    torchrun's LOCAL_RANK (rank modulo the visible GPUs without torchrun), which NCCL also needs as
    the current device. Anything else is taken as given."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        local = os.environ.get("LOCAL_RANK")
        index = int(local) if local is not None else ranks.rank % max(1, torch.cuda.device_count())
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
    return dev


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def collective_failed(what: str, e: BaseException) -> ParallelError:
    rank = dist.get_rank() if dist.is_initialized() else "?"
    return ParallelError(f"rank {rank}: {what} failed: another rank exited or did not answer within the "
                         f"collective timeout ({_first_line(e)})")


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place over all ranks; returns t."""
    try:
        dist.all_reduce(t, op=op)
    except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ..."
        raise collective_failed("all_reduce", e) from None
    return t


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """(...) on each rank -> (world, ...) stacked in rank order, the same on every rank."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(out, t.contiguous())
    except RuntimeError as e:
        raise collective_failed("all_gather", e) from None
    return torch.stack(out)


def all_gather_object(obj) -> list:
    out = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as e:
        raise collective_failed("all_gather_object", e) from None
    return out


def fingerprint(model_dir: Path) -> str:
    """A short hash of what makes two checkpoints the same model: config.json's bytes and every
    tensor's name, shape and dtype (from the headers; no tensor data is read)."""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    headers = read_headers(checkpoint_files(Path(model_dir)))
    h.update(json.dumps(sorted((k, list(v.shape), v.dtype) for k, v in headers.items())).encode())
    return h.hexdigest()[:16]


def check_same_checkpoint(model_dir: Path) -> None:
    """Raise CheckpointError on every rank unless all ranks read the same checkpoint: sharding two
    different models together would run and give wrong numbers."""
    mine = (fingerprint(model_dir), str(model_dir))
    everyone = all_gather_object(mine)
    if len({fp for fp, _ in everyone}) > 1:
        shown = "; ".join(f"rank {r}: {fp} ({d})" for r, (fp, d) in enumerate(everyone))
        raise CheckpointError(f"the ranks disagree on the checkpoint (hash of config.json and tensor shapes): "
                              f"{shown}")
