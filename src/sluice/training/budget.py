"""Will a run fit in memory? Estimated from the recipe before anything is allocated.

A recipe is trusted text: `micro_batch = 100000000` used to grow the process to 15 GB before
Python's MemoryError, and a model of 10^9-wide layers would take the machine down first. Each
estimate counts the big buffers only (weights, their gradients and AdamW moments, the activations
kept for the backward pass, the logits) and is compared with what this process may still take:
the smallest of free RAM, its cgroup's limit and its address-space limit."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from ..errors import SluiceError

FP32 = 4
# The estimate may take this share of the memory available; the rest is for torch's allocator
# slack, torch.compile, the tokenizer and Python itself.
SHARE = 0.8
# Bytes a training run holds per byte of corpus while preparing data: the BPE trainer's word counts
# (~11x measured on the stdlib) and the token stream; and per character of one encode_batch chunk
# (ids, offsets, masks and token strings: ~40x measured).
TRAINER_PER_BYTE = 16
ENCODE_PER_CHAR = 48


class BudgetError(SluiceError, MemoryError):
    """A recipe or corpus needs more memory than this process can have; the message has the numbers."""


def available_bytes() -> tuple[int | None, str]:
    """What this process may still allocate, and the limit that decides it (None: unknown)."""
    limits: list[tuple[int, str]] = []
    status = _kib_fields("/proc/self/status")
    meminfo = _kib_fields("/proc/meminfo")
    if "MemAvailable" in meminfo:
        limits.append((meminfo["MemAvailable"], "available RAM (/proc/meminfo MemAvailable)"))
    cg = Path("/sys/fs/cgroup")
    try:
        cap = (cg / "memory.max").read_text().strip()
        if cap != "max":
            used = int((cg / "memory.current").read_text())
            limits.append((int(cap) - used, "the cgroup memory limit (memory.max)"))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and "VmSize" in status:
        limits.append((soft - status["VmSize"], "the address-space limit (ulimit -v)"))
    if not limits:
        try:
            limits.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical RAM"))
        except (OSError, ValueError, AttributeError):
            return None, "unknown"
    return min(limits)


def _kib_fields(path: str) -> dict[str, int]:
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def training_bytes(recipe, num_params: int) -> dict[str, int]:
    """The big buffers of one training step (or of an evaluation, whichever is larger), in bytes."""
    t, m, vocab = recipe.train, recipe.model, recipe.tokenizer.vocab_size
    tokens = t.micro_batch * t.seq_len
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    # Weights, gradients and AdamW's two moments, all fp32; bf16 autocast adds a cast copy.
    state = num_params * FP32 * 4 + (num_params * 2 if t.autocast_bf16 is not False else 0)  # "auto": the larger
    # Saved for backward, per token and layer: norms, projections and their normed/rotated copies,
    # the gated MLP's four intermediate-wide tensors and residual adds (counted from layers.py).
    per_token_layer = 10 * m.hidden_size + 8 * (q + 2 * kv) + 6 * m.intermediate_size
    activations = tokens * m.num_layers * per_token_layer * FP32
    # One layer's attention scores, should SDPA fall back to its plain kernel.
    scores = t.micro_batch * m.num_heads * t.seq_len * t.seq_len * FP32
    # Logits, cross-entropy's log-softmax and its gradient, each (tokens, vocab) fp32.
    logits = 3 * tokens * vocab * FP32
    evaluation = 2 * 8 * t.seq_len * vocab * FP32  # evaluate(): batches of 8 windows, no grad
    return {"weights, gradients, AdamW moments": state,
            "activations kept for backward": activations + scores,
            "logits and their gradient": max(logits, evaluation)}


def data_bytes(total_bytes: int, largest_file: int, chunk_chars: int) -> dict[str, int]:
    return {"tokenizer training and token stream": TRAINER_PER_BYTE * total_bytes,
            "encoding one chunk of files": ENCODE_PER_CHAR * max(chunk_chars, largest_file)}


def check(parts: dict[str, int], what: str, hint: str, available=None) -> int:
    """Refuse `what` if its parts add up to more than SHARE of the memory available; the total."""
    need = sum(parts.values())
    avail, limit = available if available is not None else available_bytes()
    if avail is None or need <= SHARE * avail:
        return need
    detail = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())
    raise BudgetError(f"{what} needs about {_gib(need)} ({detail}), more than {SHARE:.0%} of the "
                      f"{_gib(max(avail, 0))} this process may use ({limit}); {hint}")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n < 2**60 else f"{n:.3g} bytes"
