"""The KV-cache memory budget (kv_cache_memory): sizes parsed and refused by name, a request over the
budget refused with the numbers before it costs memory or time (checked in a memory-capped child),
and prefill cut into slices that give the same logits as one forward."""

import pytest
import torch
from bounded import run_bounded

import sluice
import sluice.engine.kv_cache as kv_cache
from sluice import RequestError, SamplingParams
from sluice.engine.kv_cache import KVCache, check_budget, parse_size
from sluice.errors import ConfigError

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("value, expected", [
    (4096, 4096), ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), (" 1.5 gb ", 15 * 10**8),
    ("100", 100), ("3kib", 3072)])
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["4 GiBs", "", "x", "-1GB", "0", "1e9", "nan", 0, -5, 1.5, True, None, [4]])
def test_parse_size_refuses_by_name(value):
    with pytest.raises(ConfigError, match=r"^kv_cache_memory must be .*got " + repr(value).replace("[", r"\[")):
        parse_size(value)


def test_budget_arithmetic_and_message(tiny_llm):
    cfg, f32 = tiny_llm.model.config, torch.float32
    kv = KVCache.nbytes_for(cfg, 3, 128, f32)
    assert kv == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 3 * 128
    step = 3 * cfg.vocab_size * kv_cache.STEP_BYTES_PER_LOGIT
    assert check_budget(cfg, 3, 128, f32, kv + step, True) == kv + step  # exactly the budget fits
    with pytest.raises(RequestError) as e:
        check_budget(cfg, 3, 128, f32, kv + step - 1, True)
    msg = str(e.value)
    assert f"{kv:,} bytes of KV cache for 3 prompts x 128 slots" in msg and f"plus {step:,} bytes" in msg
    assert "(kv_cache_memory)" in msg and "about 2 fit" in msg and "--kv-cache-memory" in msg


def test_over_budget_request_is_refused_before_tokenizing(tiny_dir, monkeypatch):
    """The pool is sized by the budget; a request that could not fit it even alone is refused, before
    tokenizing when max_tokens alone is too much, else once its prompt's length is known."""
    llm = sluice.LLM(str(tiny_dir), kv_cache_memory="200KiB", max_num_seqs=1)
    pool = llm.batch_engine().pool
    slots = pool.num_blocks * pool.block_size
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a hopeless request"))
    with pytest.raises(RequestError, match=rf"needs \d+ KV blocks of 16 tokens, and the whole pool has "
                                           rf"{pool.num_blocks} \({slots} tokens\).*kv_cache_memory"):
        llm.generate(["hi"] * 100, SamplingParams(max_tokens=slots))
    monkeypatch.undo()
    assert llm.generate([[5] * 10] * 3, SamplingParams(max_tokens=4, **GREEDY))[0].finish_reason == "length"
    with pytest.raises(RequestError, match=rf"a prompt of {slots} tokens with max_tokens=4 needs"):
        llm.generate([[5] * slots], SamplingParams(max_tokens=4))


def test_default_budget_is_a_share_of_free_memory(tiny_dir, monkeypatch):
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 64 * 2**10)
    with pytest.raises(RequestError, match=r"over the budget of 32.0 KiB \(the default, half of the memory available"):
        sluice.LLM(str(tiny_dir)).generate(["hi"] * 100, SamplingParams(max_tokens=20))
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: None)  # a platform that does not say
    assert sluice.LLM(str(tiny_dir)).generate("hi", SamplingParams(max_tokens=2))[0].token_ids


def refused_in_capped_child(tiny_dir, llm_kwargs: str, setup: str, generate_args: str) -> str:
    """Run llm.generate(generate_args) on the tiny model in a child capped at 3000 MiB and assert it is
    refused (RequestError) with a peak under 1500 MiB, so before it cost memory (the seconds the refusal
    took are in the message, not asserted); returns the refusal message."""
    r = run_bounded(f"""
        import time, sluice
        from sluice import SamplingParams
        llm = sluice.LLM({str(tiny_dir)!r}, batching=False, {llm_kwargs})
        {setup}
        t = time.perf_counter()
        try:
            llm.generate({generate_args})
        except sluice.RequestError as e:
            print("refused", round(time.perf_counter() - t, 2), e)
    """, mem_mib=3000, timeout=120)  # a hang-stopper: 10x the quiet ~10 s (imports and load included)
    assert r.returncode == 0 and "refused" in r.stdout, r.stderr[-2000:]
    assert r.peak_mib < 1500, r.peak_mib
    return r.stdout


def test_thousand_long_prompts_refused_in_a_capped_child(tiny_dir):
    """1,000 prompts x 400 tokens, each over a small pool: refused up front with a small peak (the old
    static path took 12.8 GB for this before it checked)."""
    message = refused_in_capped_child(tiny_dir, 'kv_cache_memory="256KiB"', "",
                                      "[[5] * 400] * 1000, SamplingParams(max_tokens=100)")
    assert "prompt 0: a prompt of 400 tokens with max_tokens=100 needs 32 KV blocks" in message


def test_ten_million_character_prompt_refused_in_a_capped_child(tiny_dir):
    """10^8 characters took 11 GB and 2 minutes to tokenize before the length check; now the
    tokenizer refuses it from its byte count (Tokenizer.encode(max_tokens=))."""
    assert "prompt 0" in refused_in_capped_child(tiny_dir, "", 'text = "hello world " * (10**8 // 12)', "text")
