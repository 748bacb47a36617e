"""A paged KV cache: one pool of fixed-size blocks shared by every running sequence.

The static cache (kv_cache.py) gives each row of a batch max-length slots up front. Here a sequence
owns a *block table*, a list of block ids: its slot s (the keys and values of its token at position
s) lives in block table[s // block_size] at offset s % block_size. Blocks are taken as a sequence
grows and given back when it ends, so the pool holds what is in use, not what might be.

Prefix caching: a block whose block_size tokens are all computed gets a key, (key of the block before
it, its token ids), so equal keys mean equal token prefixes and therefore equal keys and values (the
key holds the token ids themselves, so a hash collision cannot alias two prefixes). A new sequence
whose prompt starts with cached blocks shares them instead of computing them again; a shared block
is never written (only full blocks are shared, and a sequence writes past its shared prefix). A
block nobody uses keeps its contents and key until the pool needs it back (least recently used
first), so a system prompt sent again later is still there.

Which block take() hands out: a used block holding nothing (unkeyed, or its prefix dropped), the most
recently freed first; then one the pool has never handed out; an idle keyed block last. A reused block is
zeroed first, so every block handed out holds zeros, as a never-used one does. The pool's
memory is committed lazily (_lazy_zeros), so a never-used block costs page faults when first written,
and on a VM whose host backs guest memory on first use (the 2-core microVMs of docs/benchmarks.md)
~10-40 us a 4 KiB page, ~56 pages a decoded token for the Qwen3-0.6B shape: reusing written blocks
keeps that off decode where nothing is lost by it.

Pool layout (L, NB, K, bs, D): one block of one KV head is bs contiguous rows of D, the unit the
native step (step.cpp) and the gather below read.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import RequestError
from ..model.config import ModelConfig

DEFAULT_BLOCK_SIZE = 16


@dataclass
class PoolStats:
    total: int
    used: int  # referenced by a live sequence
    cached: int  # unreferenced, holding a prefix that a later prompt may reuse (counted as free)
    queries: int  # full prompt blocks that could have come from the prefix cache, over admissions
    hits: int  # of those, found there

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _lazy_zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros whose memory is only committed when written, on the CPU: numpy's zeros come from calloc,
    which maps fresh zero pages for a large array, where torch.zeros writes every byte at once. A pool
    sized for the worst case then costs what the running sequences fill. Zeros and not garbage:
    attention multiplies unwritten slots by a zero weight, and 0 * NaN would still be NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros((*shape[:-1], shape[-1] * dtype.itemsize), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype)


class BlockPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        if num_blocks < 1 or block_size < 1:
            raise RequestError(f"a KV pool needs at least one block of one slot, got {num_blocks} x {block_size}")
        shape = (cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.k = _lazy_zeros(shape, dtype, device)  # (L, NB, K, bs, D)
        self.v = _lazy_zeros(shape, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self._fresh = collections.deque(range(num_blocks))  # never handed out (memory not yet written)
        self._free: list[int] = []  # handed out before, now unkeyed and unreferenced; the last freed taken first
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # keyed, unused; LRU first
        self._key_of: list[tuple | None] = [None] * num_blocks
        self._block_of: dict[tuple, int] = {}  # prefix key -> block
        self._serial = itertools.count(1)  # names a keyed block's prefix in its successor's key
        self._serial_of: dict[int, int] = {}  # block -> serial
        self.queries = self.hits = 0
        self._mirrors: list[BlockPool] = []  # pools whose blocks go by this one's ids (also_clear)

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * dtype.itemsize

    # ------------------------------------------------------------------ taking and giving back
    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: unkeyed (used or never used), or idle (keyed but unreferenced)."""
        return len(self._free) + len(self._fresh) + len(self._idle)

    def take(self) -> int:
        """A block for new contents: a used unkeyed one (the last freed), else a never-used one; an idle
        keyed block is reused (its key dropped) only when neither is left. Raises when the pool is
        exhausted (the scheduler checks first)."""
        if self._free:
            b = self._free.pop()
            self._clear(b)
        elif self._fresh:
            b = self._fresh.popleft()  # (zeros already)
        elif self._idle:
            b, _ = self._idle.popitem(last=False)
            self._forget(b)
            self._clear(b)
        else:
            raise RuntimeError("the KV pool is exhausted (the scheduler should have preempted)")
        self.refs[b] = 1
        return b

    def also_clear(self, other: "BlockPool") -> None:
        """Clear `other`'s block too whenever one of this pool's is reused: a draft model's pool, whose blocks go by
        this pool's ids (proposers.DraftProposer)."""
        self._mirrors.append(other)

    def _clear(self, block: int) -> None:
        """Zeros over a reused block's keys and values, in this pool and its mirrors, as a never-used block has: the
        torch forward reads a row's last block whole and weighs the slots past the row's position by 0, and a stale
        NaN there (a sequence that overflowed, a surgery experiment) would still give 0 * NaN = NaN. ~3.6 MB for
        the Qwen3-0.6B shape in fp32, once per block_size tokens."""
        for pool in (self, *self._mirrors):
            pool.k[:, block].zero_()
            pool.v[:, block].zero_()

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        assert self.refs[block] >= 0, f"block {block} released more often than taken"
        if self.refs[block] == 0:
            if self._key_of[block] is not None:
                self._idle[block] = None  # most recently used last
            else:
                self._free.append(block)

    def release_all(self, blocks: list[int]) -> None:
        # Last block first: a sequence's tail is the least likely part to be shared, so it goes first.
        for b in reversed(blocks):
            self.release(b)

    # ------------------------------------------------------------------ the prefix cache
    def key(self, prev: int, tokens) -> tuple:
        """The key of a full block holding `tokens` after the prefix named by serial `prev` (0: none)."""
        return prev, tuple(tokens)

    def lookup(self, key: tuple) -> int | None:
        """The block cached under `key`, now referenced by the caller, or None. (The caller counts
        queries and hits: the scheduler counts an admission, not each attempt.)"""
        b = self._block_of.get(key)
        if b is None:
            return None
        if self.refs[b] == 0:
            del self._idle[b]
        self.refs[b] += 1
        return b

    def register(self, block: int, key: tuple) -> int:
        """Key a block its owner has just filled; returns the serial that names this prefix, for the
        next block's key. If another sequence cached the same prefix first, this block stays unkeyed
        (it is freed normally) and that block's serial is returned: equal prefixes, one name."""
        other = self._block_of.get(key)
        if other is not None:
            return self._serial_of[other]
        self._block_of[key] = block
        self._key_of[block] = key
        s = self._serial_of[block] = next(self._serial)
        return s

    def serial(self, block: int) -> int:
        return self._serial_of[block]

    def drop_cached(self) -> int:
        """Forget every idle block's prefix (they become plain free blocks), so the next prompts are computed,
        not found: a benchmark's rounds over the same prompts then each cost a cold prefill. Blocks in use
        keep their keys. Returns how many were dropped."""
        idle = list(self._idle)
        for b in idle:
            self._forget(b)
            self._free.append(b)
        self._idle.clear()
        return len(idle)

    def _forget(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            del self._block_of[key]
            del self._serial_of[block]
            self._key_of[block] = None

    def stats(self) -> PoolStats:
        used = sum(1 for r in self.refs if r > 0)
        return PoolStats(self.num_blocks, used, len(self._idle), self.queries, self.hits)


class PagedView:
    """The pool as one forward sees it: rows' block tables (B, nb), so num_slots = nb * block_size.
    A row whose table is shorter than nb is padded with any block; the attention mask (slots <= the
    query's position) keeps a row from ever reading past its own blocks."""

    def __init__(self, pool: BlockPool, tables: list[list[int]], device=None):
        nb = max(len(t) for t in tables)
        pad = [t + [t[0]] * (nb - len(t)) for t in tables]
        self.k, self.v = pool.k, pool.v
        self.table = torch.tensor(pad, dtype=torch.int64, device=device or pool.k.device)  # (B, nb)
        self.num_slots = nb * pool.block_size
        self.batch_size = len(tables)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> "PagedView":
        """A view from the pool's tensors and a built table: what a compiled forward takes as arguments."""
        self = cls.__new__(cls)
        self.k, self.v, self.table = k, v, table
        self.num_slots = table.shape[1] * k.shape[3]
        self.batch_size = table.shape[0]
        return self

    def layer(self, i: int) -> "PagedLayer":
        return PagedLayer(self.k[i], self.v[i], self.table)


class PagedLayer:
    """One layer's pool, k and v (NB, K, bs, D), behind the CacheLayer interface of kv_cache.py."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor):
        self.k, self.v, self.table = k, v, table

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, T, K, D) at positions (B, T) -> each row's slots gathered, (B, K, nb * bs, D).

        The gather copies a row's blocks into one tensor per layer: the plain-torch way to attend
        over a paged cache (the native step reads blocks in place instead)."""
        bs = self.k.shape[2]
        blocks = self.table.gather(1, positions // bs)  # (B, T)
        offsets = positions % bs
        self.k.transpose(1, 2)[blocks, offsets] = k.to(self.k.dtype)  # through a (NB, bs, K, D) view
        self.v.transpose(1, 2)[blocks, offsets] = v.to(self.v.dtype)
        B, nb = self.table.shape
        K, D = self.k.shape[1], self.k.shape[3]

        def rows(pool: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # in the activations' dtype (widened)
            return pool[self.table].transpose(1, 2).reshape(B, K, nb * bs, D).to(like.dtype)  # (B, nb, K, bs, D) -> (B, K, S, D)
        return rows(self.k, k), rows(self.v, v)
