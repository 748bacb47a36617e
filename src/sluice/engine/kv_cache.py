"""Preallocated, static-shaped key/value cache.

One (B, K, S, D) tensor for keys and one for values per layer, allocated once per batch, so each
KV head's slots are contiguous (a decode step reads them in place). Slot s of row b holds the keys
of row b's token at position s, so writing is an index_put at the token's
position and nothing ever grows: the decode step keeps fixed shapes (compile-friendly) and the
attention mask is a pure function of positions (see Transformer.attention_mask).
"""

from __future__ import annotations

import os
import re

import torch

from ..errors import ConfigError, RequestError
from ..model.config import ModelConfig

# A request's batch state may take this fraction of the memory free when it starts: the rest is
# left for prefill activations (runner.PREFILL_BYTES), the tokenizer and everything else running.
DEFAULT_BUDGET_FRACTION = 0.5
# Per (row, vocabulary entry), what one sampling step holds at most besides the KV cache: the fp32
# logits, the sampler's noise and penalty mask, and _filter's sort (values, int64 order, probs,
# cumsum, masks). Counted with the cache because it scales with the batch too.
STEP_BYTES_PER_LOGIT = 48
# What the continuous-batching engine's KV pool stores (LLM(kv_cache_dtype=)): "auto" the activations' dtype
# (fp32 wherever the native step runs), or "float32" / "bfloat16" whatever they are. A bf16 pool holds each key
# and value rounded to bf16 (to nearest even) as it is written and widened as it is read: half the memory and
# half the bytes attention reads per token, for the rounding of what it reads (docs/kv-cache.md).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def kv_cache_dtype(option: str, activations: torch.dtype) -> torch.dtype:
    """The pool's dtype for LLM(kv_cache_dtype=option) over a model whose activations are `activations`."""
    if option not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {option!r}")
    return activations if option == "auto" else getattr(torch, option)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(value, name: str = "kv_cache_memory") -> int:
    """A memory size in bytes, from an int or a string such as "4GiB", "512MiB", "2GB" or "1.5GB".

    Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units, case-insensitive; no unit = bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name} must be a number of bytes or a size such as '4GiB', got {value!r}")
    n = value
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        unit = m and _UNITS.get(m.group(2).lower())
        if not unit:
            raise ConfigError(f"{name} must be a size such as '4GiB', '512MiB' or '2GB' "
                              f"(units: {', '.join(u for u in _UNITS if u)}), got {value!r}")
        n = float(m.group(1)) * unit
        n = int(n) if n < 2**63 else 2**63  # "9" * 400 parses as inf: a limit nothing reaches
    if n <= 0:
        raise ConfigError(f"{name} must be a positive size, got {value!r}")
    return n


# A container's memory limit and use (cgroup v2, then v1): the machine's free memory is not ours to take.
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # absent, or "max" (no limit)
        return None


def _system_available() -> int | None:
    try:  # Linux says what it could give without swapping
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` now, or None where the platform does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = _system_available()  # CPU, and MPS, whose memory is the system's
    for limit_file, usage_file in _CGROUP_FILES:
        limit, used = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and used is not None and limit < 2**60:  # v1 writes "no limit" as ~2^63
            free = max(limit - used, 0) if free is None else min(free, max(limit - used, 0))
            break
    return free


def default_budget(device: torch.device) -> int | None:
    free = available_memory(device)
    return None if free is None else int(free * DEFAULT_BUDGET_FRACTION)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} bytes"


def check_budget(cfg: ModelConfig, batch_size: int, num_slots: int, dtype: torch.dtype,
                 budget: int | None, given: bool) -> int:
    """Refuse (RequestError, with the numbers) a batch whose KV cache and sampling buffers exceed
    `budget` bytes; return the bytes it needs. `given`: the budget came from kv_cache_memory=."""
    kv = KVCache.nbytes_for(cfg, batch_size, num_slots, dtype)
    step = batch_size * cfg.vocab_size * STEP_BYTES_PER_LOGIT
    if budget is None or kv + step <= budget:
        return kv + step
    where = ("kv_cache_memory" if given else
             f"the default, {DEFAULT_BUDGET_FRACTION:g} of the memory available now")
    fits = budget // (KVCache.nbytes_for(cfg, 1, num_slots, dtype) + cfg.vocab_size * STEP_BYTES_PER_LOGIT)
    raise RequestError(
        f"this request needs {fmt_bytes(kv + step)} ({kv:,} bytes of KV cache for {batch_size:,} prompts x "
        f"{num_slots:,} slots, plus {step:,} bytes of sampling buffers), over the budget of {fmt_bytes(budget)} "
        f"({where}); send fewer prompts at once (about {fits:,} fit), lower max_tokens or shorten "
        f"the prompts, or raise LLM(kv_cache_memory=...) / --kv-cache-memory if the memory is there")


class CacheLayer:
    """One layer's static cache, k and v (B, K, S, D), as Attention sees it: write() stores a chunk's
    keys and values at their positions and returns the whole cache to attend over (engine/paged_cache.py
    has the paged counterpart, same interface)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, T, K, D) at positions (B, T) -> the cache's (B, K, S, D) keys and values, in k's dtype (a
        cache of another dtype, bf16 under fp32 activations, stores them rounded and gives them back widened)."""
        # Through a (B, S, K, D) view, so each KV head's slots stay contiguous in memory.
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k.transpose(1, 2)[rows, positions] = k.to(self.k.dtype)
        self.v.transpose(1, 2)[rows, positions] = v.to(self.v.dtype)
        return self.k.to(k.dtype), self.v.to(v.dtype)


class KVCache:
    def __init__(self, cfg: ModelConfig, batch_size: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, num_slots, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, K, S, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.batch_size = batch_size

    @classmethod
    def wrap(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """A cache over existing (L, B, K, S, D) tensors: lets a compiled step take them as inputs."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache.batch_size, cache.num_slots = k.shape[1], k.shape[3]
        return cache

    def layer(self, i: int) -> "CacheLayer":
        return CacheLayer(self.k[i], self.v[i])

    @staticmethod
    def nbytes_for(cfg: ModelConfig, batch_size: int, num_slots: int, dtype: torch.dtype) -> int:
        per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        return per_slot * batch_size * num_slots

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
