"""The door (LLM.requests: one checked Request per prompt) and the step API under generate() and the
server (add_request, step, abort)."""

from __future__ import annotations

import pytest

import sluice
from sluice import SamplingParams
from sluice.engine.requests import Request
from sluice.errors import ContextExceeded, RequestError

GREEDY = dict(temperature=0, ignore_eos=True)


def test_requests_are_resolved_once_at_the_door(tiny_llm):
    params = SamplingParams(max_tokens=5, stop_token_ids=[7])
    r = tiny_llm.requests([[5, 6, 7], "def"], params)
    assert [x.label for x in r] == ["prompt 0", "prompt 1"]
    assert r[0].prompt_token_ids == [5, 6, 7] and r[1].prompt == "def" and r[1].prompt_token_ids
    p = r[0].params
    assert p.temperature is not None and p.top_k is not None and p.stop == []  # filled, not left for later
    assert r[0].stop_ids == frozenset({7} | tiny_llm.eos_token_ids)
    assert 7 in tiny_llm.requests([[5]], SamplingParams(stop_token_ids=[7], ignore_eos=True))[0].stop_ids
    assert tiny_llm.requests([[5]], SamplingParams(ignore_eos=True))[0].stop_ids == frozenset()


def test_the_step_api_gives_what_generate_gives(tiny_llm):
    params = SamplingParams(max_tokens=6, **GREEDY)
    want = [o.token_ids for o in tiny_llm.generate([[5, 6, 7], [8, 9]], params)]
    seqs = [tiny_llm.add_request(r) for r in tiny_llm.requests([[5, 6, 7], [8, 9]], params)]
    seen = {s.id: [] for s in seqs}
    while not all(s.finished for s in seqs):
        for u in tiny_llm.step():
            seen[u.seq.id] += u.token_ids
    assert [s.token_ids for s in seqs] == want == [seen[s.id] for s in seqs]
    assert not tiny_llm.has_work


def test_abort_ends_a_sequence_and_frees_its_blocks(tiny_llm):
    seq = tiny_llm.add_request(tiny_llm.requests([[5] * 40], SamplingParams(max_tokens=50, **GREEDY))[0])
    tiny_llm.step()
    assert tiny_llm.snapshot().kv.used > 0 and seq.id in tiny_llm.snapshot().running
    updates = tiny_llm.abort([seq])  # no step is running: it ends now
    assert seq.finish_reason == "abort" and [u.finished for u in updates] == [True]
    assert tiny_llm.snapshot().kv.used == 0 and not tiny_llm.has_work


def test_add_request_takes_only_checked_requests(tiny_dir, tiny_llm):
    with pytest.raises(RequestError, match="add_request takes a Request"):
        tiny_llm.add_request([5, 6, 7])
    request = tiny_llm.requests([[5]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert isinstance(request, Request)
    # every configuration takes the step API now: a speculating LLM too
    spec = sluice.LLM(str(tiny_dir), speculative="prompt-lookup")
    seq = spec.add_request(spec.requests([[5]], SamplingParams(max_tokens=2, temperature=0))[0])
    while not seq.finished:
        spec.step()
    assert seq.token_ids == tiny_llm.generate([[5]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_fit_max_tokens_cuts_the_default_to_the_context(tiny_llm):
    """The server's rule for a request that left max_tokens unset (as OpenAI and vLLM do)."""
    r = tiny_llm.requests([[5] * 500], SamplingParams(), fit_max_tokens=True)[0]
    assert r.params.max_tokens == 12  # 512 - 500
    with pytest.raises(ContextExceeded, match="prompt 0 has 500 tokens") as e:
        tiny_llm.requests([[5] * 500], SamplingParams(max_tokens=100))
    assert (e.value.prompt_tokens, e.value.max_tokens, e.value.limit) == (500, 100, 512)
