"""SamplingParams.prompt_logprobs (engine/prompt_logprobs.py) against transformers' log_softmax on a tiny
random checkpoint, on every path that ships: the native step and the torch path, chunked and whole
prefill, the prefix cache (skipped while a prompt's logprobs are missing), batches that mix requests with
and without them, speculative decoding, and preemption mid-prompt."""

from __future__ import annotations

import pytest
import torch

import sluice
from ckpt import build_with_tokenizer
from sluice.errors import RequestError

PROMPT_LEN = 70  # past one block (16) and one native chunk (64); a prefill of 7- or 16-token chunks
TOL = 1e-5  # fp32 through a different kernel order: ~2e-6 measured


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompt-lp")
    ref = build_with_tokenizer(d, "qwen3", max_position_embeddings=512)
    return d, ref


def prompts(n: int, length: int = PROMPT_LEN, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (length - 7 * i,), generator=g).tolist() for i in range(n)]


@torch.no_grad()
def reference(ref, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax (T, V) over the prompt, fp32."""
    return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check(ref, ids: list[int], got: list, top: int) -> None:
    lp = reference(ref, ids)
    assert len(got) == len(ids) and got[0] is None
    want = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    ours = torch.tensor([t.logprob for t in got[1:]])
    torch.testing.assert_close(ours, want, atol=TOL, rtol=0)
    assert [t.token_id for t in got[1:]] == ids[1:]
    for p, t in enumerate(got[1:]):
        assert len(t.top) == top
        if top:
            values = torch.tensor([a.logprob for a in t.top])
            torch.testing.assert_close(values, lp[p].topk(top).values, atol=TOL, rtol=0)
            assert lp[p][[a.token_id for a in t.top]].sub(values).abs().max() < TOL


GREEDY = dict(max_tokens=2, temperature=0)


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=7), dict(kernels=False),
                                dict(kernels=False, max_num_batched_tokens=16)],
                         ids=["native", "native-chunked", "torch", "torch-chunked"])
def test_prompt_logprobs_match_transformers(ckpt, kw):
    d, ref = ckpt
    llm = sluice.LLM(str(d), **kw)
    ids = prompts(2)
    outs = llm.generate(ids, sluice.SamplingParams(prompt_logprobs=3, **GREEDY))
    assert llm.batch_engine().scheduler.forward.use_fast == (kw.get("kernels") is not False)
    for prompt, out in zip(ids, outs, strict=True):
        check(ref, prompt, out.prompt_logprobs, 3)
        assert out.logprobs is None  # the generated tokens' are another option


def test_chunked_equals_whole_prefill(ckpt):
    d, _ = ckpt
    ids = prompts(1)
    got = []
    for budget in (512, 16, 5):
        out = sluice.LLM(str(d), max_num_batched_tokens=budget).generate(
            ids, sluice.SamplingParams(prompt_logprobs=0, **GREEDY))[0]
        got.append(torch.tensor([t.logprob for t in out.prompt_logprobs[1:]]))
    torch.testing.assert_close(got[1], got[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[2], got[0], atol=1e-6, rtol=0)


def test_mixed_batch_and_prefix_cache(ckpt):
    """A request asking for prompt logprobs after the same prompt was cached computes its prompt again (the
    cache holds no logits), while asking nothing of the others: their tokens are as they are alone, and
    its blocks are cached for the next."""
    d, ref = ckpt
    llm = sluice.LLM(str(d))
    ids = prompts(3)
    alone = [o.token_ids for o in llm.generate(ids, sluice.SamplingParams(**GREEDY))]
    pool = llm.batch_engine().pool
    hits = pool.hits
    with_lp = sluice.SamplingParams(prompt_logprobs=1, **GREEDY)
    outs = llm.generate(ids, [with_lp, sluice.SamplingParams(**GREEDY), with_lp])
    assert pool.hits - hits == (PROMPT_LEN - 7 - 1) // 16  # only the middle one took its cached blocks
    assert [o.token_ids for o in outs] == alone
    assert outs[1].prompt_logprobs is None
    check(ref, ids[0], outs[0].prompt_logprobs, 1)
    check(ref, ids[2], outs[2].prompt_logprobs, 1)
    hits = pool.hits
    llm.generate(ids[:1], sluice.SamplingParams(**GREEDY))
    assert pool.hits - hits == (PROMPT_LEN - 1) // 16  # what it computed is shared with the next


def test_speculative_and_one_token_prompts(ckpt):
    d, ref = ckpt
    llm = sluice.LLM(str(d), speculative="prompt-lookup")
    ids = [prompts(1)[0], [7]]
    outs = llm.generate(ids, sluice.SamplingParams(prompt_logprobs=2, max_tokens=6, temperature=0))
    check(ref, ids[0], outs[0].prompt_logprobs, 2)
    assert outs[1].prompt_logprobs == [None]


def test_preempted_mid_prompt_keeps_what_it_recorded(ckpt):
    """A pool too small for every prompt at once: the newest prefilling sequences are preempted and their
    prompts computed again; each prompt position is still recorded once, and right."""
    d, ref = ckpt
    llm = sluice.LLM(str(d), kv_cache_memory=16 * 2**10 * 14, max_num_batched_tokens=24, max_num_seqs=4)
    ids = prompts(4, length=60)
    outs = llm.generate(ids, sluice.SamplingParams(prompt_logprobs=0, max_tokens=8, temperature=0, ignore_eos=True))
    assert llm.snapshot().preemptions > 0
    for prompt, out in zip(ids, outs, strict=True):
        check(ref, prompt, out.prompt_logprobs, 0)


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5, "2"])
def test_bad_prompt_logprobs_is_named(bad):
    with pytest.raises(RequestError, match="prompt_logprobs must be an integer in \\[0, 20\\]"):
        sluice.SamplingParams(prompt_logprobs=bad)
