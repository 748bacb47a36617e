"""LLM(kv_cache_dtype="bfloat16"): a bf16 KV pool under fp32 activations (engine/kv_cache.py).

The native step (step.cpp: store_slot, load_slot16 / load_slot8) rounds each key and value to bf16 as it writes
it, to nearest even as torch's .to(bfloat16) does, and widens it exactly as attention reads it; the torch path
(paged_cache.PagedLayer, kv_cache.CacheLayer) stores through torch's rounding and widens what it gathers. Checked:
the pool holds bit for bit torch's rounding of the keys and values the fp32 step computes (layer 0, whose inputs
do not depend on the cache), nothing outside the row's blocks is written, the native step agrees with the torch
forward over a bf16 cache as closely as over an fp32 one, a token's numbers do not depend on its batch or chunk,
and the engine end to end: greedy tokens equal the torch path's and plain decoding's under speculation, the pool
is bf16 (and so is a draft's) and a budget holds twice the blocks. head_dim 20 puts a partial vector at the end
of every slot (the masked loads of both builds)."""

import pytest
import torch

import sluice
from avx2_build import run_avx2_build
from chunking import assert_same_numbers_in_any_chunk_and_batch
from ckpt import build_with_tokenizer
from sluice import SamplingParams
from sluice.engine import fast_step
from sluice.engine.batching import pool_blocks
from sluice.engine.config import EngineConfig
from sluice.engine.fast_step import FastStep
from sluice.engine.kv_cache import KVCache
from sluice.errors import ConfigError
from spying import record
from test_fast_step import random_model
from test_fast_step_paged import B, LAST, run, scrambled_pool

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")

BF16 = torch.bfloat16


def models():
    # (full-width qk-norm: step.cpp writes those keys in a loop of their own)
    return {"gqa": random_model(), "d20-window": random_model(seed=1, head_dim=20, sliding_window=7),
            "qk-full": random_model(seed=2, qk_norm="full")}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bf16 bit patterns: NaN compares equal to itself


@pytest.mark.parametrize("name", ["gqa", "d20-window", "qk-full"])
def test_the_pool_holds_torchs_rounding_of_the_fp32_keys_and_nothing_else(name):
    """Layer 0's keys and values come from the embeddings alone, so the fp32 and bf16 runs compute the same fp32
    values there: the bf16 pool must hold exactly their .to(bfloat16) (round to nearest even, not truncation), in
    the row's blocks only (the rest stays NaN). Later layers read the rounded cache, so they differ."""
    model = models()[name]
    step, bs = FastStep(model), 5
    k32, v32, table = scrambled_pool(model, bs)
    k16, v16 = k32.to(BF16), v32.to(BF16)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (B, 17), generator=g)
    pos = torch.arange(17).expand(B, 17)
    with torch.inference_mode():
        step(tokens, pos, k32, v32, block_table=table)
        step(tokens, pos, k16, v16, block_table=table)
    for got, fp32 in ((k16, k32), (v16, v32)):
        assert torch.equal(bits(got[0]), bits(fp32[0].to(BF16)))
        written = ~fp32[1].isnan()
        assert torch.equal(got[1].isnan(), ~written)  # the same slots written, nothing else
        assert not torch.equal(got[1][written], fp32[1][written].to(BF16))  # layer 1 read rounded keys


@pytest.mark.parametrize("name", ["gqa", "d20-window", "qk-full"])
def test_native_step_matches_the_torch_forward_over_a_bf16_cache(name):
    """Prompt chunks and greedy decode steps (test_fast_step_paged.run), native over a scrambled bf16 pool against
    the torch forward over a static bf16 cache. The two paths' fp32 keys differ in their last bits (their products
    sum in different orders), so now and then one rounds to the neighbouring bf16 value, and what reads it in the
    next layers moves a little (at most 0.85% of the elements differ, by up to 0.016, in these runs): the caches must
    agree bit for bit in 95% of their elements, and all within 2^-5 of their largest. The flips move these models'
    logits by up to 8.3e-4 of their scale (measured over four seeds, AVX-512 and AVX2 builds), no rounding at all
    (an fp32 cache) by 5e-3 to 8.5e-3: the logits must agree within 3e-3 of their scale, and differ from the
    fp32 cache's by more than 1e-3 (the rounding is there to see)."""
    model = models()[name]
    step, vocab, bs = FastStep(model), model.config.vocab_size, 5
    k16, v16, table = scrambled_pool(model, bs)
    k16, v16 = k16.to(BF16), v16.to(BF16)
    slots = int(table.shape[1]) * bs
    cache16, cache32 = KVCache(model.config, B, slots, BF16), KVCache(model.config, B, slots)
    with torch.inference_mode():
        want = run(lambda t, p: model(t, p, cache16), vocab)
        fp32 = run(lambda t, p: model(t, p, cache32), vocab, tokens_from=want)
        got = run(lambda t, p: step(t, p, k16, v16, block_table=table), vocab, tokens_from=want)
    for pool, cache in ((k16, cache16.k), (v16, cache16.v)):
        native = torch.stack([pool[:, table[b, s // bs], :, s % bs] for b in range(B) for s in range(LAST[b] + 1)])
        ref = torch.stack([cache[:, b, :, s] for b in range(B) for s in range(LAST[b] + 1)])
        same = bits(native) == bits(ref)
        assert same.float().mean() > 0.95, f"{(~same).sum()} of {same.numel()} cache elements differ"
        diff = (native.float() - ref.float()).abs()  # a flip in one layer moves the next layers' keys a little
        assert diff.max() <= 2 ** -5 * ref.float().abs().max(), f"{diff.max()}"
    worst_fp32 = 0.0
    for i, (g, w, f) in enumerate(zip(got, want, fp32, strict=True)):
        scale = w.abs().max()
        assert (g - w).abs().max() <= 3e-3 * scale, f"call {i}: {(g - w).abs().max() / scale:.2e} of the scale"
        worst_fp32 = max(worst_fp32, float((f - w).abs().max() / scale))
    assert worst_fp32 > 1e-3


@pytest.mark.parametrize("name", ["gqa", "d20-window", "qk-full"])
def test_same_numbers_in_any_chunk_and_batch_over_a_bf16_cache(name):
    model = models()[name]
    assert_same_numbers_in_any_chunk_and_batch(model, FastStep(model), BF16)


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv16")
    build_with_tokenizer(d, "qwen3", head_dim=20, max_position_embeddings=256)
    return d


PROMPTS = ["def add(a, b):\n    return a + b\n\nprint(add(2, 3))", "Hello world! How are you", "The"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


TIE = 1e-2  # logprob gap under which the torch path may pick the other token (a rounding flip moves logits ~1e-3)


def assert_same_greedy_but_near_ties(native, other) -> None:
    """other's greedy tokens are the native run's (which asked for logprobs=2), except that from a position where
    the native run's top two were within TIE of each other they may part: there the torch path's keys, which
    differ from the native step's in their last fp32 bits and so now and then round to the other bf16 neighbour,
    may tip the argmax. (The tiny checkpoint here parts nowhere; another CPU's torch sums in other orders.)"""
    for n, o in zip(native, other, strict=True):
        i = next((i for i, (a, b) in enumerate(zip(n.token_ids, o.token_ids, strict=True)) if a != b), None)
        if i is not None:
            top = n.logprobs[i].top
            assert top[0].logprob - top[1].logprob < TIE, f"token {i}: {n.token_ids[i]} against {o.token_ids[i]}"


def test_engine_greedy_equals_the_torch_path_and_speculation_keeps_it(ckpt):
    llm = sluice.LLM(str(ckpt), kv_cache_dtype="bfloat16")
    native = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2))
    got = [o.token_ids for o in native]
    engine = llm.batch_engine()
    assert engine.pool.k.dtype == BF16 and engine.scheduler.forward.use_fast
    torch_path = sluice.LLM(str(ckpt), kv_cache_dtype="bfloat16", kernels=False)
    assert_same_greedy_but_near_ties(native, torch_path.generate(PROMPTS, GREEDY))
    assert not torch_path.batch_engine().scheduler.forward.use_fast
    for kw in (dict(speculative="prompt-lookup"), dict(draft_model=str(ckpt))):  # the native step's own: exact
        spec = sluice.LLM(str(ckpt), kv_cache_dtype="bfloat16", **kw)
        assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == got, kw
        assert spec.last_stats.proposed > 0
    assert spec.batch_engine().scheduler.speculation.proposer.pool.k.dtype == BF16  # the draft's pool too


def test_a_budget_holds_twice_the_blocks(ckpt):
    model = sluice.LLM(str(ckpt)).model
    n32 = pool_blocks(model, 4096, 64, 16, 2 << 20, True)
    n16 = pool_blocks(model, 4096, 64, 16, 2 << 20, True, kv_dtype="bfloat16")
    assert pool_blocks(model, 4096, 64, 16, 2 << 20, True, kv_dtype="float32") == n32
    assert n16 >= 2 * n32 - 1 and n32 > 0  # (the sampling buffers come off the budget first)
    llm = sluice.LLM(str(ckpt), kv_cache_dtype="bfloat16", kv_cache_memory="2MiB")
    llm.generate(["x"], SamplingParams(max_tokens=2))
    pool = llm.batch_engine().pool
    assert pool.k.element_size() == 2 and pool.num_blocks == pool_blocks(
        model, llm.max_model_len, llm.max_num_seqs, pool.block_size, 2 << 20, True, kv_dtype="bfloat16")


def test_a_bad_kv_cache_dtype_is_named():
    with pytest.raises(ConfigError, match=r"kv_cache_dtype must be one of auto, float32, bfloat16, got 'fp8'"):
        sluice.LLM(kv_cache_dtype="fp8")
    from sluice.cli.common import flag_naming
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype must be one of"):
        EngineConfig(kv_cache_dtype="float16", naming=flag_naming())


def test_avx2_build():
    run_avx2_build("fast_step", __file__, "pool_holds or matches_the_torch or same_numbers")


def test_the_cli_flag_reaches_the_pool(ckpt, monkeypatch, capsys):
    import sluice.llm as llm_module
    from sluice.cli import main
    made = record(monkeypatch, llm_module, "BatchEngine")
    assert main(["generate", "--model", str(ckpt), "--kv-cache-dtype", "bfloat16", "--max-tokens", "3", "hi"]) == 0
    assert made and made[0].pool.k.dtype == BF16
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ckpt), "--kv-cache-dtype", "fp8", "hi"])
    assert e.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_over_a_bf16_pool_gives_the_same_tokens(ckpt):
    """compile=True runs the torch forward of the one-token rows through torch.compile (paged_cache's gather
    and widening inside the graph): the native step's greedy tokens, near ties aside."""
    native = sluice.LLM(str(ckpt), kv_cache_dtype="bfloat16").generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2))
    llm = sluice.LLM(str(ckpt), kv_cache_dtype="bfloat16", compile=True)
    assert_same_greedy_but_near_ties(native, llm.generate(PROMPTS, GREEDY))
    assert llm.batch_engine().pool.k.dtype == BF16
