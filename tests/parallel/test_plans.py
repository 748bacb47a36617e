"""Under tensor parallelism rank 0 alone schedules and the others follow its plans (parallel/plans.py).

In one process, without a process group: a leader and a follower scheduler, each over its own LLM on
the same checkpoint, the plans passed between them encoded as they are broadcast. The follower must
give exactly the leader's outputs through preemption, chunked prefill and prefix-cache hits, while
its own pool is never touched (no second copy of the scheduling state); a plan that does not match
the follower's sequences is refused before any forward. The spawned-ranks tests
(test_parallel_llm.py and the others, slow) run the same code over gloo."""

from __future__ import annotations

import collections

import pytest
import torch

import sluice
from sluice.engine.paged_cache import BlockPool
from sluice.engine.sampling import SamplingParams
from sluice.parallel.group import ParallelError
from sluice.parallel.plans import decode, encode


class _End:
    """One end of an in-process plan channel (plans.PlanChannel's share())."""

    def __init__(self, queue: collections.deque, leads: bool):
        self.queue, self.leads = queue, leads

    def share(self, plan, seqs):
        if self.leads:
            self.queue.append(encode(plan))
            return plan
        return decode(self.queue.popleft(), seqs, 1)


def _follow_plans(llm, end):
    sched = llm.batch_engine().scheduler
    sched.plans, sched.follower = end, not end.leads
    return sched


def _requests():
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 500, (40,), generator=g).tolist()  # two prompts share 2.5 blocks: a prefix hit
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 33, 70, 12)]
    prompts += [shared + [7, 8], shared + [9]]
    params = [SamplingParams(max_tokens=n, temperature=t, seed=s, ignore_eos=True, repetition_penalty=rp)
              for n, t, s, rp in ((24, 0.0, None, 1.0), (30, 0.9, 1, 1.3), (12, 1.1, 2, 1.0), (36, 0.0, None, 1.2),
                                  (20, 0.8, 3, 1.0), (20, 0.0, None, 1.0))]
    return prompts, params


def _budget(llm, blocks: int, seqs: int) -> int:  # as tests/engine/test_scheduler.py
    return seqs * llm.model.config.vocab_size * 48 + blocks * BlockPool.block_bytes(llm.model.config, 16, torch.float32)


def test_a_follower_gives_the_leaders_outputs_and_never_schedules(tiny_dir, tiny_llm):
    prompts, params = _requests()
    kw = dict(max_num_seqs=3, max_num_batched_tokens=16, kv_cache_memory=_budget(tiny_llm, 10, 3))
    alone = sluice.LLM(str(tiny_dir), **kw).generate(prompts, params)
    lead, follow = sluice.LLM(str(tiny_dir), **kw), sluice.LLM(str(tiny_dir), **kw)
    queue = collections.deque()
    leader, follower = _follow_plans(lead, _End(queue, True)), _follow_plans(follow, _End(queue, False))
    seqs = [[llm.add_request(r) for r in llm.requests(prompts, params)] for llm in (lead, follow)]
    steps = 0
    while lead.has_work:
        lead.step()
        follow.step()  # reads the plan the leader's step just sent
        steps += 1
        assert follower.pool.num_free == follower.pool.num_blocks  # its pool's books stay untouched
    assert not follow.has_work and not queue
    assert leader.preemptions > 0 and follower.preemptions == 0  # the leader alone preempted
    assert leader.pool.hits > 0 and follower.pool.queries == 0  # ... and looked up the prefix cache
    for a, l, f in zip(alone, *seqs, strict=True):
        assert (l.token_ids, l.text, l.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert (f.token_ids, f.text, f.finish_reason) == (l.token_ids, l.text, l.finish_reason)
    assert steps == leader.steps == follower.steps


def test_a_plan_that_does_not_match_the_followers_sequences_is_refused(tiny_dir):
    lead, follow = sluice.LLM(str(tiny_dir)), sluice.LLM(str(tiny_dir))
    queue = collections.deque()
    _follow_plans(lead, _End(queue, True))
    follower = _follow_plans(follow, _End(queue, False))
    p = SamplingParams(max_tokens=4, temperature=0.0)
    lead.add_request(lead.requests([[5, 6, 7]], p)[0])
    follow.add_request(follow.requests([[5, 6, 7, 8]], p)[0])  # another prompt: out of step
    lead.step()
    with pytest.raises(ParallelError, match="out of step with rank 0: sequence 0 has 3 tokens on rank 0, 4"):
        follow.step()
    assert follower.steps == 0 or not any(s.token_ids for s in follower.running)
    queue.append(encode(lead.batch_engine().scheduler.schedule()))  # a sequence this rank never added
    follower.live.clear()
    with pytest.raises(ParallelError, match="sequence 0 has .* unknown here"):
        follow.step()
