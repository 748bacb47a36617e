"""Invariants of the KV block pool (engine/paged_cache.BlockPool), shared by the pool's own tests
(tests/engine/test_block_pool.py) and the scheduler's (tests/engine/test_scheduler_properties.py).
Reads the pool's private lists on purpose: the point is to see its bookkeeping from inside."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.engine.paged_cache import BlockPool


def check_pool(pool: BlockPool, holders: collections.Counter) -> None:
    """The pool's invariants, given how many holders each block has (a sequence's block table, or a
    caller of take() / lookup() that has not released it yet)."""
    free, idle = list(pool._free) + list(pool._fresh), list(pool._idle)
    assert len(set(free)) == len(free), f"a block twice on the free lists: {free}"
    assert list(pool._fresh) == sorted(pool._fresh), "the never-used blocks out of id order"
    assert not set(free) & set(idle), f"blocks both never-keyed free and idle: {set(free) & set(idle)}"
    in_use = {b for b in range(pool.num_blocks) if pool.refs[b] > 0}
    assert not in_use & (set(free) | set(idle)), f"blocks both free and in use: {in_use & (set(free) | set(idle))}"
    assert set(range(pool.num_blocks)) == in_use | set(free) | set(idle), "a block neither free nor in use (leaked)"
    assert [pool.refs[b] for b in range(pool.num_blocks)] == [holders[b] for b in range(pool.num_blocks)]
    assert all(pool._key_of[b] is not None for b in idle), "an unkeyed block on the idle list"
    assert all(pool._key_of[b] is None for b in free), "a keyed block on the never-keyed list"
    assert {b: k for k, b in pool._block_of.items()} == {b: k for b, k in enumerate(pool._key_of) if k is not None}
    assert pool.num_free == len(free) + len(idle) == pool.num_blocks - pool.stats().used
