"""The scheduler's bookkeeping under random traffic (hypothesis): requests added, stepped, aborted,
preempted, finishing by max_tokens or a stop token, sharing prompt prefixes (prefix-cache hits), on a
pool of 4-token blocks small enough that sequences preempt each other. After every step: no block both
free and in use, each block's reference count equal to the sequences holding it, at most max_num_seqs
running, every ended sequence's blocks back in the pool. At the end: every request's greedy tokens equal
what it gets alone (LLM(batching=False)), an aborted one's a prefix of them."""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sluice
from pool_checks import check_pool
from sluice.engine.paged_cache import BlockPool
from sluice.engine.scheduler import Scheduler
from sluice.engine.sampling import SamplingParams

BLOCK, BLOCKS = 4, 14  # 56 slots: three sequences of up to 33 tokens cannot all fit
SHARED = list(range(10, 22))  # three full blocks that several prompts start with
# The last prompt's second block holds the same tokens as its first: only the key of what came before
# (paged_cache.BlockPool.key) tells the two apart.
PROMPTS = [SHARED + [30, 31], SHARED + [40], SHARED + [30, 31], list(range(50, 57)), SHARED + list(range(60, 69)),
           [70], SHARED[:8] + [80, 81, 82], SHARED[:4] * 2 + [94, 95]]
STOP = 366  # a stop token for some requests: tests/ckpt.py's tiny qwen3 generates it from most PROMPTS, 3rd to 8th
MAX_STEPS = 600  # a hang guard: the longest example needs ~150 steps

OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.just(0)),
), min_size=1, max_size=24)


@pytest.fixture(scope="module")
def alone_llm(tiny_dir):
    return sluice.LLM(str(tiny_dir), batching=False, fused_head=False)


class Harness:
    """One scheduler on a small pool, the requests it was given, and what each gets alone."""

    def __init__(self, llm, alone_llm, max_num_seqs: int, native: bool, budget: int = 16):
        self.llm, self.alone_llm, self.cache = llm, alone_llm, {}
        pool = BlockPool(llm.model.config, BLOCKS, BLOCK)
        self.sched = Scheduler(llm.model, pool, llm.tokenizer.decode, max_num_seqs, budget, native=native)
        self.seqs, self.aborted = [], set()

    def params(self, max_tokens: int, stop: bool) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop_token_ids=[STOP] if stop else None)

    def add(self, prompt: int, max_tokens: int, stop: bool) -> None:
        request = self.llm.requests([PROMPTS[prompt]], self.params(max_tokens, stop))[0]
        self.sched.check_fits(len(PROMPTS[prompt]), max_tokens)  # each fits the pool alone
        self.seqs.append((self.sched.add(request), prompt, max_tokens, stop))

    def abort(self, i: int) -> None:
        live = [s for s, *_ in self.seqs if not s.finished and s.id not in self.aborted]
        if live:
            seq = live[i % len(live)]
            self.aborted.add(seq.id)
            self.sched.abort(seq)

    def preempt(self) -> None:
        """What the scheduler does when a sequence needs a block and none is free, at any moment."""
        if self.sched.running:
            self.sched._preempt(self.sched.running[-1])
            self.check()

    def step(self) -> None:
        self.sched.step()
        self.check()

    def check(self) -> None:
        sched = self.sched
        assert len(sched.running) <= sched.max_num_seqs, f"{len(sched.running)} running, max_num_seqs {sched.max_num_seqs}"
        assert all(not s.blocks for s in sched.waiting), "a waiting sequence holds blocks"
        check_pool(sched.pool, collections.Counter(b for s in sched.running for b in s.blocks))
        for s, *_ in self.seqs:
            if s.finished:
                assert not s.blocks and s not in sched.running and s not in sched.waiting, f"ended {s.id} kept blocks"
            elif s in sched.running:
                assert len(s.blocks) >= sched.blocks_for(s.num_computed) and s.num_computed <= len(s.ids)

    def drain(self) -> None:
        for _ in range(MAX_STEPS):
            if not self.sched.has_work:
                break
            self.step()
        assert not self.sched.has_work, f"still working after {MAX_STEPS} steps"
        assert self.sched.pool.stats().used == 0

    def alone(self, prompt: int, max_tokens: int, stop: bool) -> list[int]:
        key = (prompt, max_tokens, stop)
        if key not in self.cache:
            self.cache[key] = self.alone_llm.generate([PROMPTS[prompt]], self.params(max_tokens, stop))[0].token_ids
        return self.cache[key]

    def check_outputs(self) -> None:
        for seq, prompt, max_tokens, stop in self.seqs:
            want = self.alone(prompt, max_tokens, stop)
            if seq.id in self.aborted:
                assert seq.token_ids == want[:len(seq.token_ids)], (prompt, max_tokens, stop)
            else:
                assert seq.token_ids == want, (prompt, max_tokens, stop)
                assert seq.finish_reason == ("stop" if want[-1:] == [STOP] and stop else "length")


def run(h: Harness, ops) -> None:
    for op, a, *rest in ops:
        if op == "add":
            h.add(a, *rest)
        elif op == "step":
            for _ in range(a):
                h.step()
        elif op == "abort":
            h.abort(a)
        else:
            h.preempt()
    h.drain()
    h.check_outputs()


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=12, **SETTINGS)
@given(ops=OPS, max_num_seqs=st.integers(1, 3))
def test_random_traffic_keeps_the_books_and_the_outputs(tiny_llm, alone_llm, ops, max_num_seqs):
    run(Harness(tiny_llm, alone_llm, max_num_seqs, native=True), ops)


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=150, **SETTINGS)
@given(ops=OPS, max_num_seqs=st.integers(1, 4), budget=st.integers(1, 40))
def test_random_traffic_sweep(tiny_llm, alone_llm, native, ops, max_num_seqs, budget):
    run(Harness(tiny_llm, alone_llm, max_num_seqs, native, budget), ops)


def test_the_traffic_reaches_preemption_prefix_hits_stops_and_aborts(tiny_llm, alone_llm):
    """A fixed sequence of the operations above that exercises every path they are meant to: so the
    random ones are known to be able to."""
    h = Harness(tiny_llm, alone_llm, max_num_seqs=3, native=True)
    ops = [("add", 0, 12, False), ("add", 4, 12, False), ("add", 2, 10, True), ("step", 2), ("add", 1, 12, False),
           ("step", 3), ("abort", 3), ("add", 3, 12, True), ("step", 4), ("preempt", 0), ("add", 6, 5, False),
           ("add", 7, 6, False)]
    run(h, ops)
    stats = h.sched.pool.stats()
    assert h.sched.preemptions >= 2 and stats.hits > 0 and h.aborted
    assert any(s.finish_reason == "stop" for s, *_ in h.seqs)


def test_admission_stops_at_max_num_seqs(tiny_llm, alone_llm):
    """Five short requests, room for two: the first step admits exactly two, and never more run."""
    h = Harness(tiny_llm, alone_llm, max_num_seqs=2, native=True, budget=64)
    for i in (1, 3, 5, 6, 0):
        h.add(i, 3, False)
    h.step()
    assert len(h.sched.running) == 2 and len(h.sched.waiting) == 3
    h.drain()
    h.check_outputs()
