"""A kernel that lands while the engine serves (a background build, engine/native/extension.py) is taken
at the next safe point and never inside one: the native step at the next busy period, so a request in
flight (and one that joins it) finishes on the torch path it started on; the decode linears between
requests, never under one in flight."""

import pytest

import sluice
from sluice.engine import fast_step, gemv
from sluice.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class Landing:
    """Stands in for a NativeExtension whose background build lands when the test says so."""

    def __init__(self, real):
        self.real, self.landed, self.failure = real, False, None

    def module(self, wait=None):
        return self.real.module() if self.landed else None

    def why_unavailable(self, wait=None):
        return self.real.why_unavailable() if self.landed else "being built in the background (pid 1)"


@pytest.fixture
def step_lands(monkeypatch):
    if fast_step.why_unavailable() is not None:
        pytest.skip(f"no native step here: {fast_step.why_unavailable()}")
    ext = Landing(fast_step._EXT)
    monkeypatch.setattr(fast_step, "_EXT", ext)
    return ext


def test_the_native_step_is_taken_at_the_next_busy_period(tiny_dir, step_lands):
    llm = sluice.LLM(str(tiny_dir))
    want = [o.token_ids for o in sluice.LLM(str(tiny_dir), kernels=False).generate(["def f():", "x ="], GREEDY)]
    scheduler = llm.batch_engine().scheduler
    paths = []  # whether each step's forward ran natively
    scheduler.before_forward = lambda: paths.append(scheduler.forward.use_fast)
    first = llm.stream("def f():", GREEDY)
    next(first)  # a busy period starts while the kernel is still building: torch
    assert "being built" in scheduler.forward.native_reason
    step_lands.landed = True
    second = llm.stream("x =", GREEDY)
    texts = [next(second)]  # joins the busy period in flight (a stream starts at its first next())
    texts += [list(first), list(second)]
    assert paths and not any(paths), "a request in flight switched paths"
    assert [o.token_ids for o in llm.generate(["def f():", "x ="], GREEDY)] == want
    assert scheduler.forward.native_reason is None and scheduler.forward.use_fast and paths[-1]
    assert all(texts)


def test_the_decode_linears_are_swapped_in_between_requests_once_built(tiny_dir, monkeypatch):
    if gemv.why_unavailable() is not None:
        pytest.skip(f"no decode kernel here: {gemv.why_unavailable()}")
    ext = Landing(gemv._EXT)
    monkeypatch.setattr(gemv, "_EXT", ext)
    llm = sluice.LLM(str(tiny_dir))
    llm.generate(["def f():", "x ="], GREEDY)  # 2 rows: the kernel is wanted, but still building
    assert llm.kernels_in_use == 0 and gemv.building()
    stream = llm.stream("def f():", GREEDY)
    next(stream)
    ext.landed = True
    llm.generate(["a", "b"], SamplingParams(max_tokens=1))  # arrives while `stream` is in flight
    assert llm.kernels_in_use == 0, "the linears were swapped under a request in flight"
    list(stream)
    llm.generate(["def f():", "x ="], GREEDY)  # the engine is idle again: now
    assert llm.kernels_in_use > 0 and not gemv.building()
