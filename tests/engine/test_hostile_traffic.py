"""Hostile traffic on both forwards, the native step (kernels="auto") and the torch one (kernels=False):
a batch far larger than max_num_seqs on a pool that forces preemption, and aborts that land in the middle
of a step (from inside its model work, as another thread's abort can). Every request that is not aborted
gets its tokens alone; an aborted one a prefix of them; no block stays in use."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice import SamplingParams
from sluice.engine.paged_cache import BlockPool

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone_llm(tiny_dir):
    return sluice.LLM(str(tiny_dir), batching=False, fused_head=False)


@pytest.fixture(params=["auto", False], ids=["native", "torch"])
def kernels(request):
    from sluice.engine import fast_step
    if request.param == "auto" and fast_step.kernel() is None:
        pytest.skip(f"no native step here: {fast_step.why_unavailable()}")
    return request.param


def _budget(llm, blocks: int, seqs: int) -> int:
    """A kv_cache_memory giving the pool `blocks` blocks of 16 next to `seqs` sampling rows."""
    return seqs * llm.model.config.vocab_size * 48 + blocks * BlockPool.block_bytes(llm.model.config, 16, torch.float32)


def test_a_huge_batch_with_aborts_mid_step(tiny_dir, alone_llm, kernels):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (48,), generator=g)]
    params = [SamplingParams(max_tokens=int(m), **GREEDY) for m in torch.randint(1, 12, (48,), generator=g)]
    llm = sluice.LLM(str(tiny_dir), kernels=kernels, max_num_seqs=8, max_num_batched_tokens=32,
                     kv_cache_memory=_budget(alone_llm, 12, 8))
    seqs = [llm.add_request(r) for r in llm.requests(prompts, params)]
    sched = llm.batch_engine().scheduler
    doomed = set(range(3, 48, 7))  # aborted from inside a step, once each has a token
    aborted = set()

    def abort_mid_step():
        for i in sorted(doomed - aborted):
            if seqs[i].token_ids and not seqs[i].finished:
                llm.abort([seqs[i]])  # a step is running: it ends at the next one
                aborted.add(i)
    sched.before_forward = abort_mid_step
    for _ in range(2000):  # a hang guard: this takes a few hundred steps
        if not llm.has_work:
            break
        llm.step()
    assert not llm.has_work and llm.snapshot().kv.used == 0
    assert sched.preemptions > 0 and any(seqs[i].finish_reason == "abort" for i in aborted)
    assert sched.forward.use_fast == (kernels == "auto"), sched.forward.native_reason
    for i, (p, q, s) in enumerate(zip(prompts, params, seqs, strict=True)):
        want = alone_llm.generate([p], q)[0].token_ids
        if i in aborted and s.finish_reason == "abort":
            assert s.token_ids == want[:len(s.token_ids)], i
        else:  # not aborted, or it reached max_tokens in the step the abort landed in: a normal end
            assert s.token_ids == want and s.finish_reason == "length", i
