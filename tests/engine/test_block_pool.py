"""The KV block pool's bookkeeping alone (engine/paged_cache.BlockPool): reference counts, the never-keyed
free list, the idle (keyed, unreferenced) list and the prefix keys, checked after every operation of
random sequences (hypothesis), with no model. test_scheduler_properties.py checks the same pool under
the scheduler."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pool_checks import check_pool
from sluice.engine.paged_cache import BlockPool

# What BlockPool reads of a model's config: the shape of one block.
CFG = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=2)


def test_a_prefix_hit_takes_its_block_off_the_idle_list():
    """A lookup that finds an idle block makes it used again: take() must never hand it out while
    it is held (the bug this guards: the block left on the idle list, so take() reused it)."""
    pool = BlockPool(CFG, 2, block_size=2)
    a = pool.take()
    key = pool.key(0, [1, 2])
    pool.register(a, key)
    pool.release(a)
    assert pool.num_free == 2 and pool.stats().cached == 1
    assert pool.lookup(key) == a
    assert pool.num_free == 1 and pool.stats().cached == 0
    b = pool.take()
    assert b != a
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.take()
    assert pool.refs[a] == 1 and pool.lookup(key) == a  # still keyed: nobody took it over
    check_pool(pool, collections.Counter([a, a, b]))


def test_drop_cached_forgets_the_idle_prefixes_only():
    """drop_cached (bench/serve_ceiling.py's cold rounds): an idle keyed block becomes a plain free one, found by no
    lookup; a block in use keeps its key; nothing is taken or freed by it."""
    pool = BlockPool(CFG, 4, block_size=2)
    idle, held = pool.take(), pool.take()
    k_idle, k_held = pool.key(0, [1, 2]), pool.key(0, [3, 4])
    pool.register(idle, k_idle)
    pool.register(held, k_held)
    pool.release(idle)
    assert pool.num_free == 3 and pool.stats().cached == 1
    assert pool.drop_cached() == 1
    assert pool.num_free == 3 and pool.stats().cached == 0
    assert pool.lookup(k_idle) is None
    assert pool.lookup(k_held) == held  # in use: still shared
    check_pool(pool, collections.Counter([held, held]))
    assert pool.drop_cached() == 0


def test_take_reuses_written_blocks_before_never_used_ones():
    """A block freed unkeyed, or whose prefix was dropped, is handed out again (the last freed first) before any
    block the pool has never handed out, whose lazily committed memory costs page faults when first written; an
    idle keyed block (a cached prefix) only once the never-used ones are gone."""
    pool = BlockPool(CFG, 5, block_size=2)
    a, b = pool.take(), pool.take()
    assert (a, b) == (0, 1)
    pool.release(a)
    pool.release(b)
    assert pool.take() == b and pool.take() == a  # not 2: written memory first, the last freed first
    pool.register(a, pool.key(0, [1, 2]))
    pool.release_all([b, a])  # a idle (keyed), b free
    assert pool.take() == b
    assert pool.take() == 2 and pool.take() == 3 and pool.take() == 4  # the cached prefix kept while fresh ones last
    assert pool.stats().cached == 1 and pool.take() == a and pool.stats().cached == 0
    for blk in range(5):
        pool.release(blk)
    c = pool.take()
    pool.register(c, pool.key(0, [3, 4]))
    pool.release(c)
    assert pool.drop_cached() == 1 and pool.take() == c  # a dropped prefix's block is a written free one


def test_a_reused_block_holds_zeros_again_in_the_pool_and_its_mirrors():
    """A block handed out again (freed unkeyed, or a cached prefix's evicted) holds zeros, as a never-used one does,
    in the pool and in a draft's pool that goes by its ids: the torch forward weighs a row's slots past its
    position by 0, and a stale NaN there would still make the row NaN."""
    pool, draft = BlockPool(CFG, 2, block_size=2), BlockPool(CFG, 2, block_size=2)
    pool.also_clear(draft)
    a, b = pool.take(), pool.take()
    for p in (pool, draft):
        p.k[:, a] = float("nan")
        p.v[:, b] = float("inf")
    pool.register(b, pool.key(0, [1, 2]))
    pool.release(a)
    pool.release(b)
    assert pool.take() == a  # freed unkeyed
    assert pool.take() == b  # an evicted prefix (no other block left)
    for p in (pool, draft):
        assert p.k.count_nonzero() == 0 and p.v.count_nonzero() == 0


class PoolMachine(RuleBasedStateMachine):
    """Random take / release / register / lookup against a small pool, with the holders kept aside."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(CFG, 5, block_size=2)
        self.held: list[int] = []  # one entry per reference the test holds
        self.keys: list[tuple] = [self.pool.key(0, [1, 2])]  # keys registered so far (some since evicted)
        self.handed_out: set[int] = set()  # every block take() has returned

    @precondition(lambda self: self.pool.num_free > 0)
    @rule()
    def take(self):
        written_free, fresh = list(self.pool._free), list(self.pool._fresh)
        b = self.pool.take()
        if written_free:
            assert b == written_free[-1], "take() passed over a freed block it had written (the last freed first)"
        elif fresh:
            assert b == fresh[0], "take() reused a cached prefix while never-used blocks were left"
        self.handed_out.add(b)
        assert b not in self.held, f"take() handed out block {b}, which is in use"
        assert self.pool._key_of[b] is None, f"take() handed out block {b} still keyed: a lookup would find new contents"
        self.held.append(b)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        self.pool.release(self.held.pop(i % len(self.held)))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), tokens=st.lists(st.integers(0, 2), min_size=2, max_size=2), after=st.booleans())
    def register(self, i, tokens, after):
        """Key a held block, after the first registered prefix or at the start."""
        b = self.held[i % len(self.held)]
        if self.pool._key_of[b] is not None:
            return  # the scheduler keys a block once, when it fills
        prev = self.pool.serial(self.pool._block_of[self.keys[0]]) if after and self.keys[0] in self.pool._block_of else 0
        key = self.pool.key(prev, tokens)
        self.pool.register(b, key)
        self.keys.append(key)

    @rule(i=st.integers(0, 100))
    def lookup(self, i):
        key = self.keys[i % len(self.keys)]
        want = self.pool._block_of.get(key)
        got = self.pool.lookup(key)
        assert got == want
        if got is not None:
            self.held.append(got)

    @rule()
    def drop_cached(self):
        self.pool.drop_cached()
        assert not any(self.pool._key_of[b] is not None and self.pool.refs[b] == 0 for b in range(self.pool.num_blocks))

    @invariant()
    def consistent(self):
        check_pool(self.pool, collections.Counter(self.held))
        assert not set(self.pool._fresh) & self.handed_out, "a block handed out is back on the never-used list"


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_pool_under_random_operations = PoolMachine.TestCase
