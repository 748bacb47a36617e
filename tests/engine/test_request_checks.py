"""Issue 15, the engine: hostile or careless requests are refused with a clear error before they
cost memory or time; one LLM never mixes two requests; NaN/inf logits never pass for a completion."""

import gc
import threading

import numpy as np
import pytest
import torch
from bounded import run_bounded

import sluice
import sluice.engine.kv_cache as kv_cache
from sluice import RequestError, SamplingParams
from sluice.engine.kv_cache import KVCache, check_budget, parse_size
from sluice.errors import ConfigError, NumericsError

GREEDY = dict(temperature=0, ignore_eos=True)


# ---------------------------------------------------------------- the memory budget (item 1)

@pytest.mark.parametrize("value, expected", [
    (4096, 4096), ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), (" 1.5 gb ", 15 * 10**8),
    ("100", 100), ("3kib", 3072)])
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["4 GiBs", "", "x", "-1GB", "0", "1e9", "nan", 0, -5, 1.5, True, None, [4]])
def test_parse_size_refuses_by_name(value):
    with pytest.raises(ConfigError, match=r"^kv_cache_memory must be .*got " + repr(value).replace("[", r"\[")):
        parse_size(value)


@pytest.fixture(scope="module")
def static_llm(tiny_dir):
    """The static one-request path (runner.py): its batch-wide budget checks and its one-at-a-time rule
    are tested here; the continuous-batching engine's pool and interleaving in tests/test_scheduler.py."""
    return sluice.LLM(str(tiny_dir), batching=False)


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
    refused (RequestError) within 5 s with a peak under 1500 MiB; returns the refusal message."""
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
    """, mem_mib=3000, timeout=120)
    assert r.returncode == 0 and "refused" in r.stdout, r.stderr[-2000:]
    assert r.peak_mib < 1500, r.peak_mib
    assert float(r.stdout.split()[1]) < 5
    return r.stdout


def test_thousand_long_prompts_refused_in_a_capped_child(tiny_dir):
    """The issue's case, 1,000 prompts x 2,040 tokens (12.8 GB before): refused up front, small peak."""
    message = refused_in_capped_child(tiny_dir, 'kv_cache_memory="256MiB"', "",
                                      "[[5] * 400] * 1000, SamplingParams(max_tokens=100)")
    assert "1,000 prompts x 512 slots" in message


# ---------------------------------------------------------------- prefill in slices (item 1)

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


# ---------------------------------------------------------------- one request at a time (item 2)

def test_second_request_while_a_stream_is_open_is_refused(static_llm):
    p = SamplingParams(max_tokens=8, **GREEDY)
    alone = static_llm.generate("abc", p)[0].text
    s1, s2 = static_llm.stream("abc", p), static_llm.stream("xyz", p)
    first = next(s1)
    with pytest.raises(RequestError, match="already running a request.*stream\\(\\).*one LLM per thread"):
        next(s2)
    with pytest.raises(RequestError, match="already running"):
        static_llm.generate("xyz", p)
    assert first + "".join(s1) == alone  # the open stream was not disturbed
    assert static_llm.generate("abc", p)[0].text == alone  # and it let go when done


@pytest.mark.parametrize("how", ["close", "break", "gc"])
def test_a_stream_closed_early_frees_the_llm(tiny_llm, how):
    p = SamplingParams(max_tokens=8, **GREEDY)
    if how == "break":
        for _ in tiny_llm.stream("abc", p):
            break  # the loop held the only reference: the stream is collected and closed here
    else:
        s = tiny_llm.stream("abc", p)
        next(s)
        if how == "close":
            s.close()
        else:
            holder = [s]
            holder.append(holder)  # a reference cycle: only the cycle collector frees it
            del s, holder
            gc.collect()
    assert tiny_llm.generate("abc", SamplingParams(max_tokens=2, **GREEDY))[0].token_ids


def test_another_thread_is_refused_while_one_runs(static_llm):
    p = SamplingParams(max_tokens=4, **GREEDY)
    s = static_llm.stream("abc", p)
    next(s)
    errors = []
    t = threading.Thread(target=lambda: errors.append(_catch(lambda: static_llm.generate("xyz", p))))
    t.start()
    t.join()
    assert isinstance(errors[0], RequestError) and "already running" in str(errors[0])
    s.close()


def _catch(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001 - handed to the main thread to assert on
        return e
    return None


# ---------------------------------------------------------------- non-finite logits (item 3)

@pytest.fixture
def nan_llm(tiny_dir):
    return sluice.LLM(str(tiny_dir), batching=False)  # poisons runner.step; the scheduler: tests/test_scheduler.py


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_non_finite_weights_raise_instead_of_an_empty_completion(nan_llm, fused, poison):
    nan_llm.fused_head = fused
    with torch.no_grad():
        nan_llm.model.layers[1].mlp.down.weight[0, 0] = float(poison)
    p = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=1)
    with pytest.raises(NumericsError, match=r"non-finite logits \(NaN or inf\) at step 0 of prompt 0.*sluice inspect"):
        nan_llm.generate("hi", p)
    with pytest.raises(NumericsError):
        list(nan_llm.stream("hi", p))
    with pytest.raises(NumericsError):  # greedy rows too
        nan_llm.generate("hi", SamplingParams(max_tokens=5, temperature=0))


def _poison_steps_from(llm, monkeypatch, step: int, row: int):
    """Make decode step `step` (1 = the first after prefill) and later give NaN for batch row `row`."""
    real, calls = llm.runner.step, [0]

    def step_fn(tokens, hidden=False):
        out = real(tokens, hidden=hidden).clone()  # an inference tensor takes no in-place write outside
        calls[0] += 1
        if calls[0] >= step:
            out[row] = float("nan")
        return out
    monkeypatch.setattr(llm.runner, "step", step_fn)


@pytest.mark.parametrize("fused", [False, True])
def test_nan_mid_generation_is_not_returned_as_a_completion(nan_llm, monkeypatch, fused):
    nan_llm.fused_head = fused
    params = [SamplingParams(max_tokens=8, seed=s, temperature=1.0, top_k=20, ignore_eos=True) for s in (1, 2)]
    _poison_steps_from(nan_llm, monkeypatch, step=3, row=1)
    with pytest.raises(NumericsError, match="at step 3 of prompt 1"):
        nan_llm.generate(["hello", "world"], params)
    monkeypatch.undo()
    _poison_steps_from(nan_llm, monkeypatch, step=3, row=0)
    with pytest.raises(NumericsError, match="at step 3 of prompt 0"):
        for _ in nan_llm.stream("hello", params[0]):
            pass
    assert nan_llm.generate("x", SamplingParams(max_tokens=1))  # the LLM is free again


@pytest.mark.parametrize("fused", [False, True])
def test_nan_in_a_finished_row_does_not_stop_the_others(nan_llm, monkeypatch, fused):
    nan_llm.fused_head = fused
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=20, seed=1),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=2, ignore_eos=True)]
    _poison_steps_from(nan_llm, monkeypatch, step=1, row=0)
    outs = nan_llm.generate(["hello", "world"], params)
    assert len(outs[0].token_ids) == 1 and len(outs[1].token_ids) == 6


# ---------------------------------------------------------------- prompts at the door (items 4, 5)

@pytest.mark.parametrize("prompts, shown", [
    (b"hello", "prompts is bytes; decode it to a str first"),
    ((p for p in ["a", "b"]), "got generator \\(pass a list\\)"),
    ({"a", "b"}, "got set"),
    (None, "got NoneType"),
    (3, "got int"),
    ([None], "prompt 0 must be a str or a list of token ids, got NoneType"),
    (["ok", 1.5], "prompt 1 must be a str or a list of token ids, got float"),
    ([[1.5, 2]], "prompt 0 has a token id that is not an integer: 1.5"),
    ([[3, 1.5]], "prompt 0 has a token id that is not an integer: 1.5"),
    ([[3, True]], "prompt 0 has a token id that is not an integer: True"),
    ([[3, "4"]], "not an integer: '4'"),
    (["a", b"b"], "prompt 1 is bytes"),
    ([[1, -1]], r"outside the vocabulary \[0, 512\): -1"),
    ([[]], "prompt 0 is empty"),
    ([], "no prompts given"),
    (torch.ones(2, 2, 2, dtype=torch.long), "must be 1-D .* or 2-D"),
    ([torch.tensor([1.0, 2.0])], "dtype torch.float32; token ids must be a 1-D integer tensor"),
    (np.array([1.0, 2.0]), "numpy array of dtype float64"),
])
def test_bad_prompt_arguments_are_refused_by_name(tiny_llm, prompts, shown):
    with pytest.raises(RequestError, match=shown):
        tiny_llm.generate(prompts, SamplingParams(max_tokens=2))


def test_id_prompts_in_other_containers(tiny_llm):
    p = SamplingParams(max_tokens=3, **GREEDY)
    ref = tiny_llm.generate([[5, 6, 7]], p)[0].token_ids
    for form in ([5, 6, 7], (5, 6, 7), torch.tensor([5, 6, 7]), np.array([5, 6, 7]), [np.int64(5), 6, 7],
                 [torch.tensor([5, 6, 7])], torch.tensor([[5, 6, 7]])):
        assert tiny_llm.generate(form, p)[0].token_ids == ref, form
    assert "".join(tiny_llm.stream(np.array([5, 6, 7]), p)) == tiny_llm.last_output.text


class _UnwalkedList(list):
    """A list that fails the test if anything walks its elements: refusal must go by len() alone."""

    def __iter__(self):
        raise AssertionError("the id list was iterated before its length was checked")

    def __getitem__(self, i):
        raise AssertionError("the id list was indexed before its length was checked")


def test_huge_id_list_is_refused_by_its_length(tiny_llm):
    ids = [5] * 10**7
    with pytest.raises(RequestError, match="prompt 0 has 10000000 token ids, more than the context of 512"):
        tiny_llm.generate([ids], SamplingParams(max_tokens=2))
    # no per-element pass over ten million ids: checked by construction, not by a timing bound
    with pytest.raises(RequestError, match="prompt 0 has 10000000 token ids, more than the context of 512"):
        tiny_llm.generate([_UnwalkedList(ids)], SamplingParams(max_tokens=2))


def test_max_tokens_and_params_checked_before_any_work(tiny_llm):
    with pytest.raises(RequestError, match="max_tokens=512, which leaves no room for a prompt in the context of 512"):
        tiny_llm.generate("hi", SamplingParams(max_tokens=512))
    with pytest.raises(RequestError, match="max_tokens=10000000000"):
        tiny_llm.generate("hi", SamplingParams(max_tokens=10**10))
    with pytest.raises(RequestError, match="params 1 must be a SamplingParams, got dict"):
        tiny_llm.generate(["a", "b"], [SamplingParams(), {"max_tokens": 3}])
    with pytest.raises(RequestError, match="params must be a SamplingParams or a list of them, got int"):
        tiny_llm.generate(["a"], 5)


def test_generation_config_of_wrong_types_names_the_file(tiny_dir, tmp_path):
    import json
    import shutil
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": "16"}))
    # refused at load (the tokenizer reads the file) or, at the latest, by the first request
    with pytest.raises(sluice.SluiceError, match=r"generation_config.json: max_new_tokens must be an integer >= 1, "
                                                 r"got '16'"):
        sluice.LLM(str(d)).generate("hi")


def test_ten_million_character_prompt_refused_in_a_capped_child(tiny_dir):
    """10^8 characters took 11 GB and 2 minutes to tokenize before the length check; now the
    tokenizer refuses it from its byte count (Tokenizer.encode(max_tokens=))."""
    assert "prompt 0" in refused_in_capped_child(tiny_dir, "", 'text = "hello world " * (10**8 // 12)', "text")


def test_conversation_longer_than_the_context_is_refused_before_tokenizing(tiny_llm, monkeypatch):
    monkeypatch.setattr(tiny_llm.tokenizer._backend, "encode", lambda *a, **k: pytest.fail("tokenized it"),
                        raising=False)
    with pytest.raises(RequestError, match="512"):
        tiny_llm.chat([{"role": "user", "content": "hello " * 10**6}], SamplingParams(max_tokens=2))
