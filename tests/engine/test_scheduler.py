"""Continuous batching (engine/scheduler.py) over the paged KV pool (engine/paged_cache.py).

The reference is the static one-request path (LLM(batching=False), engine/runner.py) with the plain
sampler: every request the scheduler runs, whatever shares its batch, whether it was chunked,
preempted or served from the prefix cache, gives the tokens that path gives it alone."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import sluice
from sluice.engine.kv_cache import KVCache
from sluice.engine.paged_cache import BlockPool, PagedView
from sluice.engine.sampling import SamplingParams
from sluice.errors import NumericsError, RequestError

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def static_llm(tiny_dir):
    return sluice.LLM(str(tiny_dir), batching=False, fused_head=False)


def _block_bytes(llm, bs=16):
    return BlockPool.block_bytes(llm.model.config, bs, torch.float32)


def _budget(llm, blocks: int, seqs: int) -> int:
    """A kv_cache_memory that gives the pool exactly `blocks` blocks next to `seqs` sampling rows."""
    return seqs * llm.model.config.vocab_size * 48 + blocks * _block_bytes(llm)


def _requests():
    """Prompts of 1..90 ids with mixed params: greedy and seeded, filters and penalties, stops."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 5, 17, 33, 90, 12, 48, 7)]
    params = [
        SamplingParams(max_tokens=20, **GREEDY, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, seed=1),
        SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.7, top_p=0.8, repetition_penalty=1.3, seed=3),
        SamplingParams(max_tokens=25, **GREEDY, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=1.2, min_p=0.05, seed=4),
        SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=18, **GREEDY, repetition_penalty=1.5, ignore_eos=True),
    ]
    return prompts, params


def test_paged_forward_equals_the_static_cache(static_llm):
    model, cfg = static_llm.model, static_llm.model.config
    ids = torch.randint(3, 500, (1, 41), generator=torch.Generator().manual_seed(1))
    cache = KVCache(cfg, 1, 64)
    want = [model(ids[:, :30], cache=cache)[:, -1]]
    for t in range(30, 41):
        want.append(model(ids[:, t:t + 1], torch.tensor([[t]]), cache)[:, -1])
    pool = BlockPool(cfg, 20, block_size=5)
    table = [13, 2, 19, 7, 0, 11, 4, 16, 9]  # scrambled, 45 slots
    view = PagedView(pool, [table])
    got = [model(ids[:, :30], cache=view)[:, -1]]  # one chunk spanning six blocks
    for t in range(30, 41):
        got.append(model(ids[:, t:t + 1], torch.tensor([[t]]), view)[:, -1])
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=2e-5)
    for s in range(41):  # each position's keys sit in its block, at its offset
        torch.testing.assert_close(pool.k[:, table[s // 5], :, s % 5], cache.k[:, 0, :, s], rtol=0, atol=0)


@pytest.mark.parametrize("kernels", [pytest.param("auto", marks=pytest.mark.slow), False])
def test_every_request_equals_itself_alone(tiny_dir, static_llm, kernels):
    """8 requests, 3 at a time, 16-token steps (chunked prefill), a pool of 14 blocks (preemption):
    each one's tokens equal the static path's for it alone, greedy and seeded alike."""
    prompts, params = _requests()
    alone = [static_llm.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    llm = sluice.LLM(str(tiny_dir), kernels=kernels, max_num_seqs=3, max_num_batched_tokens=16,
                     kv_cache_memory=_budget(static_llm, 14, 3))
    out = llm.generate(prompts, params)
    engine = llm.batch_engine()
    assert engine.pool.num_blocks == 14
    assert engine.scheduler.preemptions > 0  # the pool was too small for three at once
    for a, o in zip(alone, out, strict=True):
        assert (o.token_ids, o.text, o.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert engine.pool.stats().used == 0
    native = engine.scheduler.forward.native_reason is None and engine.scheduler.forward.use_fast
    assert native == (kernels == "auto" and engine.scheduler.forward.fast is not None)


def test_a_long_prompt_gives_the_same_numbers_however_it_is_chunked(tiny_dir):
    """A 150-token prompt prefilled in one 256-token step, in 16-token steps or in 40-token ones (the
    native step takes them all, in pieces of MAX_CHUNK): every logprob of the answer is bit for bit the
    same, so what a request gets never depends on the budget the others left it."""
    prompt = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    got = {}
    for budget in (256, 16, 40):
        llm = sluice.LLM(str(tiny_dir), max_num_batched_tokens=budget)
        out = llm.generate([prompt], p)[0]
        assert llm.batch_engine().scheduler.forward.use_fast  # the native step ran every chunk
        got[budget] = [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in out.logprobs]
    assert got[16] == got[256] and got[40] == got[256]


def test_prefix_cache_computes_a_shared_prefix_once(tiny_dir, static_llm):
    system = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [system + [5, 6, 7], system + [9], system + [11, 12, 13, 14, 15, 16]]
    p = SamplingParams(max_tokens=12, **GREEDY, ignore_eos=True)
    llm = sluice.LLM(str(tiny_dir), max_num_seqs=4)
    first = llm.generate(prompts[0], p)[0]
    stats = llm.batch_engine().pool.stats()
    assert stats.hits == 0 and stats.cached >= 4  # 70 + 3 + 11 computed tokens: 5 full blocks kept
    rest = llm.generate(prompts[1:], p)
    stats = llm.batch_engine().pool.stats()
    assert (stats.hits, stats.queries) == (8, 12)  # 4 blocks each of the system prompt, shared
    for prompt, o in zip(prompts, [first, *rest], strict=True):
        assert o.token_ids == static_llm.generate([prompt], p)[0].token_ids


def test_interleaved_streams_and_threads_share_one_llm(tiny_dir, static_llm):
    prompts, params = _requests()
    alone = [static_llm.generate([p], q)[0].text for p, q in zip(prompts, params, strict=True)]
    llm = sluice.LLM(str(tiny_dir), max_num_seqs=4)
    streams = [llm.stream(prompts[i], params[i]) for i in range(3)]
    texts, live = ["", "", ""], set(range(3))
    while live:  # round robin: each next() steps the shared batch
        for i in sorted(live):
            try:
                texts[i] += next(streams[i])
            except StopIteration:
                live.discard(i)
    assert texts == alone[:3]
    results = {}

    def run(i):
        results[i] = llm.generate([prompts[i]], params[i])[0].text
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # a hang-stopper: 10x+ the few seconds these take here; a hung one fails below
    assert [results[i] for i in range(3, 8)] == alone[3:]
    assert llm.batch_engine().pool.stats().used == 0


@pytest.mark.parametrize("how", ["close", "break", "gc"])
def test_a_stream_closed_early_gives_its_blocks_back(tiny_dir, how):
    llm = sluice.LLM(str(tiny_dir))
    p = SamplingParams(max_tokens=50, **GREEDY, ignore_eos=True)
    prompt = list(range(3, 60))
    if how == "break":
        for _ in llm.stream(prompt, p):
            break
    else:
        s = llm.stream(prompt, p)
        next(s)
        assert llm.batch_engine().pool.stats().used == 4  # 57 prompt + 1 token, blocks of 16
        if how == "close":
            s.close()
        else:
            holder = [s]
            holder.append(holder)
            del s, holder
            gc.collect()
    assert llm.batch_engine().pool.stats().used == 0
    assert not llm.batch_engine().scheduler.has_work


def test_a_request_larger_than_the_pool_is_refused_with_numbers(tiny_dir, static_llm):
    llm = sluice.LLM(str(tiny_dir), max_num_seqs=2, kv_cache_memory=_budget(static_llm, 4, 2))
    with pytest.raises(RequestError, match=r"prompt 0: a prompt of 60 tokens with max_tokens=10 needs 5 KV blocks "
                                           r"of 16 tokens, and the whole pool has 4 \(64 tokens\)"):
        llm.generate([list(range(3, 63))], SamplingParams(max_tokens=10))
    assert llm.generate([list(range(3, 40))], SamplingParams(max_tokens=10))[0].token_ids
    with pytest.raises(RequestError, match="one KV block of 16 tokens .* is over the budget of 1000 bytes"):
        sluice.LLM(str(tiny_dir), kv_cache_memory=1000).generate("hi")


def test_nan_in_one_sequence_ends_it_and_not_the_others(tiny_dir, monkeypatch):
    llm = sluice.LLM(str(tiny_dir), max_num_seqs=4)
    engine = llm.batch_engine()
    sched = engine.scheduler
    real = sched.forward._rows  # every forward of a step: (rows, tokens fed, what to return)
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
    a, b = (llm.add_request(r) for r in llm.requests([[5, 6, 7], [8, 9]], p))

    def forward(rows, fed, want):
        out = real(rows, fed, want)
        seqs = [r.seq for r in rows]
        if out is not None and a in seqs and len(a.token_ids) >= 3:
            out = out.clone()
            out[seqs.index(a)] = float("nan")
        return out
    monkeypatch.setattr(sched.forward, "_rows", forward)
    while not (a.finished and b.finished):
        llm.step()
    assert a.finish_reason == "error" and "non-finite logits (NaN or inf) at step 3" in a.error
    assert b.finish_reason == "length" and len(b.token_ids) == 8
    assert engine.pool.stats().used == 0
    monkeypatch.setattr(sched.forward, "_rows", lambda *args: _poison_late(real, *args))
    with pytest.raises(NumericsError, match="at step 3 of prompt 0"):
        llm.generate([[5, 6, 7]], p)
    assert engine.pool.stats().used == 0 and not sched.has_work


def _poison_late(real, rows, fed, want):
    """NaN logits for every row once all of them have 3 tokens."""
    out = real(rows, fed, want)
    if out is not None and min(len(r.seq.token_ids) for r in rows) >= 3:
        out = torch.full_like(out, float("nan"))
    return out


def test_block_pool_reference_counts_and_lru(tiny_dir, static_llm):
    pool = BlockPool(static_llm.model.config, 3, block_size=2)
    a, b = pool.take(), pool.take()
    sa = pool.register(a, pool.key(0, [1, 2]))
    pool.register(b, pool.key(sa, [3, 4]))
    assert pool.register(pool.take(), pool.key(0, [1, 2])) == sa  # same prefix, one name: not keyed twice
    pool.release_all([a, b])
    assert pool.num_free == 2 and pool.stats().cached == 2
    assert pool.lookup(pool.key(0, [1, 2])) == a
    assert pool.lookup(pool.key(0, [9, 9])) is None
    pool.release(a)
    # the least recently used idle block (b) goes first, and its key with it
    assert pool.take() == b and pool.lookup(pool.key(sa, [3, 4])) is None


def test_a_forward_hook_sends_the_scheduler_to_the_torch_modules(tiny_dir):
    """The native step calls no module, so the observatory's hooks would not fire: with a hook on the
    model, the next busy period runs the torch modules (native_reason names why), same tokens."""
    from sluice.engine import fast_step
    if fast_step.kernel() is None:
        pytest.skip(f"no native step here: {fast_step.why_unavailable()}")
    llm = sluice.LLM(str(tiny_dir))
    p = SamplingParams(max_tokens=6, **GREEDY, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(["def add(a, b):", "x"], p)]
    sched = llm.batch_engine().scheduler
    assert sched.forward.native_reason is None and sched.forward.use_fast
    calls = []
    handle = llm.model.final_norm.register_forward_hook(lambda *a: calls.append(1))
    try:
        assert [o.token_ids for o in llm.generate(["def add(a, b):", "x"], p)] == want
    finally:
        handle.remove()
    assert "hook" in sched.forward.native_reason and len(calls) == 2 + 5  # two prefills, five decode steps
    assert [o.token_ids for o in llm.generate(["def add(a, b):", "x"], p)] == want and sched.forward.native_reason is None


def test_penalised_and_sampled_rows_drawn_together_equal_each_alone(tiny_dir):
    """A step draws all of its sampled rows through one joined Sampler (one sort); each row's
    generator, seen mask and generated-token counts must come out as if it had sampled alone
    (max_num_seqs=1: its own Sampler), also with presence/frequency penalties (scheduler only)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 9, 2, 30)]
    params = [SamplingParams(max_tokens=24, temperature=0.9, presence_penalty=1.5, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, frequency_penalty=0.8, top_k=30, seed=12, ignore_eos=True),
              SamplingParams(max_tokens=16, **GREEDY, frequency_penalty=1.2, repetition_penalty=1.1, ignore_eos=True),
              SamplingParams(max_tokens=22, temperature=0.7, top_p=0.8, seed=13, ignore_eos=True)]
    one = sluice.LLM(str(tiny_dir), max_num_seqs=1)
    alone = [one.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    together = sluice.LLM(str(tiny_dir), max_num_seqs=4).generate(prompts, params)
    assert [o.token_ids for o in together] == alone
    plain = sluice.LLM(str(tiny_dir), max_num_seqs=1).generate(
        [prompts[0]], SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True))[0].token_ids
    assert plain != alone[0]  # the penalty took part


def test_a_kept_joined_sampler_draws_as_each_row_alone_while_the_batch_changes():
    """The scheduler keeps its joined Sampler while the batch's rows stay the same (BatchDraw). A row that
    drew alone in between (its own Sampler's penalty state moved on) must not get the kept copy's
    stale state when the old batch comes back: every draw equals the row's own Sampler's."""
    from types import SimpleNamespace

    from sluice.engine.sampling import Sampler
    from sluice.engine.batch_sampling import BatchDraw, FullHead

    V = 40

    def params(seed):  # a strong repetition penalty: a stale seen mask changes the draw
        return SamplingParams(temperature=1.0, repetition_penalty=4.0, top_k=12, seed=seed)

    a, b, c = (SimpleNamespace(id=i, sampler=Sampler([params(i)], V)) for i in range(3))
    alone = {i: Sampler([params(i)], V) for i in range(3)}
    draw = BatchDraw(FullHead(V, torch.device("cpu")))
    g = torch.Generator().manual_seed(0)
    pattern = [(a, b), (a, b), (a,), (a, b), (a, b, c), (b,), (a, b, c), (a, b), (c,), (a, b)] * 6
    for rows in pattern:
        logits = torch.randn(len(rows), V, generator=g) * 2
        got = draw(list(rows), logits).tolist()
        assert got == [alone[s.id](logits[i:i + 1]).item() for i, s in enumerate(rows)], rows
