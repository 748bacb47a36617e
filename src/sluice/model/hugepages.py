"""The loaded weights moved into memory backed by 2 MiB pages (transparent huge pages), where the kernel offers them.

A decode step streams every weight once per token, so the speed it reads memory at is the speed it decodes at.
safetensors hands the weights over as views of the file's page-cache pages, mapped 4 KiB at a time; a bf16 matrix
of a few MB then spans hundreds of pages, and each first touch of a page costs a TLB miss, which under a
hypervisor walks two page tables. The same bytes in 2 MiB pages cost one miss per 512 of those. Measured on the
2-core AMD EPYC VM (docs/changelog-benchmarks.md, 2026-12-03): a plain read of 1 GiB ran at 35 GB/s on huge pages
against 31 on 4 KiB ones when the machine was slow, 58-62 against 46-48 when it was fast; Qwen3-0.6B-shaped
bf16 decode, the two layouts alternating in one process, 1.04-1.21x (median ~1.07x) tokens/s.

Only the memory layout changes: every tensor keeps its dtype, shape, values and sharing (tied weights stay one
tensor), so the numbers of every path are the same bits. The move is skipped, and the model keeps the file's pages,
when the kernel's THP mode is `never`, when SLUICE_HUGE_PAGES=off, or when the weights would not fit comfortably in
the memory available now (file pages can be dropped and read again; anonymous memory cannot, and there is no swap
to fall back on), so a model near the size of RAM loads as before.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

HUGE = 2 << 20          # one transparent huge page on x86-64 (and arm64 with 4 KiB base pages)
MIN_BYTES = HUGE        # tensors smaller than a page gain nothing
FIT_FRACTION = 0.8      # move only when the tensors to move are at most this share of MemAvailable
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "absent" where the kernel has none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "absent"


def _kib_field(path: str, key: str) -> int | None:
    """The bytes of a "Key:   N kB" line of a /proc file, or None where the file or the line is missing."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mem_available() -> int | None:
    """Bytes the kernel could hand out now without swapping (/proc/meminfo's MemAvailable), or None."""
    return _kib_field("/proc/meminfo", "MemAvailable")


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory in huge pages now (/proc/self/smaps_rollup), or None."""
    return _kib_field("/proc/self/smaps_rollup", "AnonHugePages")


def _references(model: torch.nn.Module) -> dict[int, list[tuple[dict, str]]]:
    """The CPU tensors worth moving, by storage address: every (module's _parameters or _buffers, name) that holds
    one (tied weights: one address, two holders). An address some holder sees with another shape, dtype or
    offset is left out: it is not one plain tensor. A contiguous tensor that is part of a larger storage moves
    too (a tensor-parallel rank's rows, read from the file as a view of the whole tensor's mapped bytes; a piece
    of a fused q|k|v): the copy holds its own bytes only, and the rest of the storage goes when nothing else
    holds it."""
    refs: dict[int, list[tuple[dict, str]]] = {}
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is not None and t.device.type == "cpu":
                    refs.setdefault(t.data_ptr(), []).append((store, name))
    out = {}
    for ptr, holders in refs.items():
        ts = [store[name] for store, name in holders]
        t = ts[0]
        if (t.nbytes >= MIN_BYTES and all(u.is_contiguous() and u.storage_offset() == t.storage_offset()
                                          and u.shape == t.shape and u.dtype == t.dtype for u in ts)):
            out[ptr] = holders
    return out


def movable_bytes(model: torch.nn.Module) -> int:
    """Bytes move_to_huge_pages would copy (each storage address once)."""
    return sum(store[name].nbytes for (store, name), *_ in _references(model).values())


def why_not(model: torch.nn.Module, also_moving: int = 0) -> str | None:
    """Why the model's weights stay where they are, or None when they move. also_moving: bytes other processes on
    this machine are moving at the same time (the other tensor-parallel ranks), which must fit beside these."""
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    if device.type != "cpu":
        return f"device {device.type}"
    if os.environ.get("SLUICE_HUGE_PAGES", "").lower() in ("0", "off", "false", "no"):
        return "SLUICE_HUGE_PAGES=off"
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return f"the kernel's transparent huge pages are {mode}"
    need = movable_bytes(model)
    avail = mem_available()
    if avail is None:
        return "MemAvailable is unknown"
    if need + also_moving > FIT_FRACTION * avail:
        also = f" with {also_moving / 1e9:.1f} GB the other ranks here move" if also_moving else ""
        return (f"the weights ({need / 1e9:.1f} GB{also}) are more than {FIT_FRACTION:.0%} of the memory available "
                f"({avail / 1e9:.1f} GB): they stay in the file's pages, which the kernel can drop and read again")
    return None


def _huge_empty(nbytes: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """An uninitialised tensor in its own anonymous mapping, 2 MiB-aligned and advised MADV_HUGEPAGE before
    any page is touched, so the first writes fault in whole huge pages. The mapping lives as long as the tensor
    (torch.frombuffer keeps the mmap object alive)."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # (the mapping is untouched: no page is faulted in yet)
    off = (-raw.data_ptr()) % HUGE
    m.madvise(mmap.MADV_HUGEPAGE, off, (nbytes + HUGE - off) // mmap.PAGESIZE * mmap.PAGESIZE)
    return raw[off:off + nbytes].view(dtype).view(shape)


def move_to_huge_pages(model: torch.nn.Module, also_moving: int = 0) -> dict:
    """Move the model's large CPU weights into huge-page-backed memory (see the module's text), one tensor at a
    time, so at most one tensor exists twice. Returns {"moved_bytes", "tensors", "reason"}: reason is None when
    they moved, else why not (why_not; also_moving as there)."""
    reason = why_not(model, also_moving)
    if reason is not None:
        return {"moved_bytes": 0, "tensors": 0, "reason": reason}
    moved = tensors = 0
    for holders in _references(model).values():
        store, name = holders[0]
        t = store[name]
        h = _huge_empty(t.nbytes, t.dtype, t.shape)
        h.copy_(t)
        # one new object for each old one (a tied weight stays one Parameter: parameters() lists it once, and
        # `head.weight is embed.weight` still says tied), every holder at once: the old memory goes as soon as
        # the last one lets go
        news: dict[int, torch.Tensor] = {}
        for store, name in holders:
            old = store[name]
            if id(old) not in news:
                news[id(old)] = torch.nn.Parameter(h, requires_grad=old.requires_grad) if isinstance(
                    old, torch.nn.Parameter) else h
            store[name] = news[id(old)]
        moved, tensors = moved + t.nbytes, tensors + 1
        del t, old, news
    return {"moved_bytes": moved, "tensors": tensors, "reason": None}
