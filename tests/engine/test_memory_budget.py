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
    llm = sluice.LLM(str(tiny_dir), kv_cache_memory="200KiB", batching=False)
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a hopeless request"))
    with pytest.raises(RequestError, match=r"100 prompts x 64 slots.*budget of 200.0 KiB \(kv_cache_memory\)"):
        llm.generate(["hi"] * 100, SamplingParams(max_tokens=20))
    monkeypatch.undo()
    # the exact check, after tokenizing: one row fits 200 KiB at 64 slots, not at 448
    assert llm.generate([[5] * 10], SamplingParams(max_tokens=4, **GREEDY))[0].finish_reason == "length"
    with pytest.raises(RequestError, match=r"1 prompts x 448 slots"):
        llm.generate([[5] * 400], SamplingParams(max_tokens=4))


def test_default_budget_is_a_share_of_free_memory(static_llm, monkeypatch):
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 2 * 2**20)
    with pytest.raises(RequestError, match=r"budget of 1.0 MiB \(the default, 0.5 of the memory available now\)"):
        static_llm.generate(["hi"] * 100, SamplingParams(max_tokens=20))
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: None)  # a platform that does not say
    assert static_llm.generate("hi", SamplingParams(max_tokens=2))[0].token_ids


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
    """The issue's case, 1,000 prompts x 2,040 tokens (12.8 GB before): refused up front, small peak."""
    message = refused_in_capped_child(tiny_dir, 'kv_cache_memory="256MiB"', "",
                                      "[[5] * 400] * 1000, SamplingParams(max_tokens=100)")
    assert "1,000 prompts x 512 slots" in message


def test_ten_million_character_prompt_refused_in_a_capped_child(tiny_dir):
    """10^8 characters took 11 GB and 2 minutes to tokenize before the length check; now the
    tokenizer refuses it from its byte count (Tokenizer.encode(max_tokens=))."""
    assert "prompt 0" in refused_in_capped_child(tiny_dir, "", 'text = "hello world " * (10**8 // 12)', "text")


def test_sliced_prefill_equals_one_forward(tiny_llm, monkeypatch):
    import sluice.engine.runner as runner_mod
    prompts = [[7, 8, 9, 10, 11, 12, 13], [3, 4], list(range(20, 60))]
    p = SamplingParams(max_tokens=6, **GREEDY)
    whole = tiny_llm.generate(prompts, p)
    logits = tiny_llm.runner.prefill(prompts, 64)
    # So small that every forward takes one row and a few positions: rows and positions both sliced.
    per_token = runner_mod.PREFILL_BYTES // runner_mod.prefill_tokens_per_forward(tiny_llm.model.config, 64, 4)
    monkeypatch.setattr(runner_mod, "PREFILL_BYTES", 5 * per_token)
    assert runner_mod.prefill_tokens_per_forward(tiny_llm.model.config, 64, 4) == 5
    sliced = tiny_llm.runner.prefill(prompts, 64)
    torch.testing.assert_close(sliced, logits, rtol=0, atol=1e-5)
    assert [o.token_ids for o in tiny_llm.generate(prompts, p)] == [o.token_ids for o in whole]
