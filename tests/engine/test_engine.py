"""KV-cached, batched generation against full recompute, and the LLM API's contract (eos, stop, stats)."""

import getpass
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import sluice
from sluice import RequestError, SamplingParams
from sluice.engine import Runner, Stats
from sluice.engine.gemv import cpu_flags

GREEDY = dict(temperature=0, ignore_eos=True)


@torch.inference_mode()
def full_recompute_logits(model, ids):
    return model(torch.tensor([ids]))[0, -1]


def test_cached_decode_equals_full_recompute(tiny_llm):
    model, runner = tiny_llm.model, Runner(tiny_llm.model)
    prompt = [5, 17, 99, 230, 4, 61, 7]
    ids = list(prompt)
    logits = runner.prefill([prompt], Runner.slots_for(len(prompt) + 24))[0]
    for _ in range(24):
        ref = full_recompute_logits(model, ids)
        assert (logits - ref).abs().max().item() <= 1e-5
        nxt = int(ref.argmax())
        assert int(logits.argmax()) == nxt
        ids.append(nxt)
        logits = runner.step(torch.tensor([nxt]))[0]


@pytest.mark.slow
def test_compiled_decode_step_matches_eager(tmp_path):
    # One layer: torch.compile's cold start grows with the graph (measured 70 s for the 3-layer tiny
    # model on a fresh inductor cache, 43 s for one), and one layer already has every op the step runs.
    from ckpt import build
    build(tmp_path, "qwen3", num_hidden_layers=1)
    model = sluice.load(tmp_path)
    eager, compiled = Runner(model), Runner(model, compile=True)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4]]
    a, b = eager.prefill(prompts, 64), compiled.prefill(prompts, 64)
    for _ in range(5):
        tok = a.argmax(-1)
        assert torch.equal(tok, b.argmax(-1))
        a, b = eager.step(tok), compiled.step(tok)
        assert (a - b).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_a_capped_isa_does_not_reuse_the_native_isas_compiled_step(tmp_path):
    """Inductor's graph cache ignores ATEN_CPU_CAPABILITY: the step compiled for AVX-512 (16-lane vectors) and
    then served under ATEN_CPU_CAPABILITY=avx2 gave NaN logits. The test above runs twice here, in processes
    sharing one temp dir (inductor's default cache), as two runs on one machine do: first at the CPU's own
    width, then capped, where it must compile its own step and match eager."""
    if "avx512f" not in cpu_flags():
        pytest.skip("no AVX-512 here: capping at AVX2 changes nothing inductor generates")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    env["TMPDIR"] = str(tmp_path)
    test = f"{__file__}::test_compiled_decode_step_matches_eager"
    for cap in (None, "avx2"):
        run_env = env if cap is None else {**env, "ATEN_CPU_CAPABILITY": cap}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=run_env,
                           capture_output=True, text=True, timeout=900)  # a hang guard, not a speed limit
        assert r.returncode == 0, (cap, r.stdout[-3000:])
    assert (tmp_path / f"torchinductor_{getpass.getuser()}_avx2").is_dir()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_equals_one_by_one(tiny_llm, temperature):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 7, 50)]
    params = [SamplingParams(max_tokens=12, temperature=temperature, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    batched = tiny_llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        alone = tiny_llm.generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids and len(out.token_ids) == 12
        assert out.text == alone.text


def test_same_seed_same_output_different_seed_differs(tiny_llm):
    p = dict(max_tokens=20, temperature=1.0, ignore_eos=True)
    a = tiny_llm.generate("def add", SamplingParams(seed=7, **p))[0].token_ids
    b = tiny_llm.generate("def add", SamplingParams(seed=7, **p))[0].token_ids
    c = tiny_llm.generate("def add", SamplingParams(seed=8, **p))[0].token_ids
    assert a == b and a != c


def test_greedy_generate_matches_full_recompute(tiny_llm):
    prompt = tiny_llm.tokenizer.encode("The quick brown fox")
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))[0]
    ids = list(prompt)
    for _ in range(15):
        ids.append(int(full_recompute_logits(tiny_llm.model, ids).argmax()))
    assert out.token_ids == ids[len(prompt):]
    assert out.finish_reason == "length"
    assert out.text == tiny_llm.tokenizer.decode(out.token_ids)


def test_defaults_come_from_generation_config(tiny_llm):
    out = tiny_llm.generate("hello", SamplingParams(ignore_eos=True))[0]
    assert len(out.token_ids) == 16  # generation_config max_new_tokens
    again = tiny_llm.generate("hello", SamplingParams(ignore_eos=True))[0]
    assert out.token_ids == again.token_ids  # do_sample false -> greedy


def test_eos_and_stop_token_ids_stop_generation(tiny_llm):
    free = tiny_llm.generate("abc", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    decode = tiny_llm.tokenizer.decode
    # a stop token with text of its own (the output must leave it out), at its first occurrence
    first = next(i for i, t in enumerate(free.token_ids)
                 if i >= 1 and decode([t]) and free.token_ids.index(t) == i)
    target = free.token_ids[first]
    before = decode(free.token_ids[:first])
    out = tiny_llm.generate("abc", SamplingParams(max_tokens=10, temperature=0,
                                                  stop_token_ids=[target]))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.text == before and decode(free.token_ids[: first + 1]) != before
    tiny_llm.eos_token_ids.add(target)  # every eos id of the checkpoint stops generation
    try:
        out = tiny_llm.generate("abc", SamplingParams(max_tokens=10, temperature=0))[0]
        assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
        assert out.text == before
    finally:
        tiny_llm.eos_token_ids.discard(target)


def test_stop_string_spanning_tokens_is_excluded(tiny_llm):
    free = tiny_llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    pieces = [tiny_llm.tokenizer.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # A stop string made of the end of token 4's text and the start of token 5's.
    a, b = pieces[4][len(pieces[3]):], pieces[5][len(pieces[4]):]
    if not (a and b):
        pytest.skip("greedy text has an empty token piece here")
    stop = a[-1:] + b[:1]
    out = tiny_llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, stop=[stop],
                                                    ignore_eos=True))[0]
    cut = free.text.find(stop)
    assert out.finish_reason == "stop" and out.text == free.text[:cut] and stop not in out.text


def test_stream_deltas_concatenate_to_text(tiny_llm):
    p = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    deltas = list(tiny_llm.stream("日本語", p))
    assert "".join(deltas) == tiny_llm.last_output.text
    # A random tiny model can emit byte sequences that are never valid UTF-8; those decode to
    # U+FFFD in the final text too. What must never happen is a character split across deltas.
    assert tiny_llm.last_output.text == tiny_llm.tokenizer.decode(tiny_llm.last_output.token_ids)
    if "\ufffd" not in tiny_llm.last_output.text:
        assert all("\ufffd" not in d for d in deltas)
    assert tiny_llm.generate("日本語", p)[0].text == tiny_llm.last_output.text


def test_chat_applies_template(tiny_llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = tiny_llm.chat(msgs, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    expected = tiny_llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert out.prompt_token_ids == expected and len(out.token_ids) == 5


def test_prompt_longer_than_context_is_refused(tiny_llm):
    with pytest.raises(RequestError, match=r"500 tokens .* max_tokens=20: 520 tokens .* 512 tokens"):
        tiny_llm.generate([[5] * 500], SamplingParams(max_tokens=20))
    # nothing was lost: the engine still works afterwards
    assert tiny_llm.generate([[5] * 10], SamplingParams(max_tokens=2))[0].token_ids


def test_user_max_model_len(tiny_dir):
    llm = sluice.LLM(str(tiny_dir), max_model_len=32)
    with pytest.raises(RequestError, match="context of 32 tokens"):
        llm.generate([[5] * 30], SamplingParams(max_tokens=3))
    with pytest.raises(sluice.ConfigError, match="max_model_len"):
        sluice.LLM(str(tiny_dir), max_model_len=100000)


def test_bad_requests(tiny_llm):
    with pytest.raises(RequestError, match="empty"):
        tiny_llm.generate([""], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="stop_token_ids.*99999"):
        tiny_llm.generate("x", SamplingParams(stop_token_ids=[99999]))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        tiny_llm.generate([[1, 2, 100000]], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="2 SamplingParams for 1 prompts"):
        tiny_llm.generate(["x"], [SamplingParams(), SamplingParams()])


def test_the_llm_runs_the_native_step_where_it_fits_with_the_same_tokens(tiny_dir):
    """LLM(kernels="auto") decodes through fast_step.FastStep (step.cpp); kernels=False through the torch
    modules. Same greedy tokens, batched with rows of different lengths; a forward hook (the
    observatory's way in) sends the next request back to the torch step, named in native_reason."""
    from sluice.engine import fast_step
    if fast_step.kernel() is None:
        pytest.skip(f"no native step here: {fast_step.why_unavailable()}")
    prompts = ["def add(a, b):", "x"]
    params = sluice.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = sluice.LLM(tiny_dir, kernels=False, batching=False)  # the torch forward, one sequence at a time
    native = sluice.LLM(tiny_dir)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in native.generate(prompts, params)] == want
    forward = native.batch_engine().scheduler.forward
    assert forward.fast is not None and forward.native_reason is None
    fast, steps = forward.fast, []
    forward.fast = lambda *a, **k: steps.append(1) or fast(*a, **k)
    # step 1: the 1-token prompt in the one-token forward, the other prompt's chunk alone; then 11 decodes
    assert [o.token_ids for o in native.generate(prompts, params)] == want and len(steps) == 2 + 11
    calls = []
    handle = native.model.final_norm.register_forward_hook(lambda *a: calls.append(1))
    try:
        assert [o.token_ids for o in native.generate(prompts, params)] == want
    finally:
        handle.remove()
    assert "hook" in forward.native_reason and len(calls) == 2 + 11  # every forward of every step
    assert [o.token_ids for o in native.generate(prompts, params)] == want and forward.native_reason is None


def _copy(src, dst, generation_config):
    shutil.copytree(src, dst)
    if generation_config is None:
        (dst / "generation_config.json").unlink()
    else:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


def test_eos_falls_back_to_config_json_without_a_generation_config_eos(tiny_dir, tiny_llm, tmp_path):
    free = tiny_llm.generate("abc", SamplingParams(max_tokens=12, **GREEDY))[0].token_ids
    target = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # first seen at step i >= 2
    cut = free.index(target) + 1

    def with_config_eos(name, generation_config):
        d = _copy(tiny_dir, tmp_path / name, generation_config)
        cfg = json.loads((d / "config.json").read_text())
        cfg["eos_token_id"] = target
        (d / "config.json").write_text(json.dumps(cfg))
        return sluice.LLM(str(d))

    p = SamplingParams(max_tokens=12, temperature=0)
    for name, gen in (("no-eos-field", {"do_sample": False}), ("no-file", None)):
        llm = with_config_eos(name, gen)
        assert target in llm.eos_token_ids, name
        out = llm.generate("abc", p)[0]
        assert out.token_ids == free[:cut] and out.finish_reason == "stop", name
    # generation_config.json's own eos list wins: config.json's is not added to it
    llm = with_config_eos("own-eos", {"do_sample": False, "eos_token_id": 2})
    assert target not in llm.eos_token_ids
    assert llm.generate("abc", p)[0].token_ids[:cut + 1] == free[:cut + 1]


def test_decode_tok_s_counts_tokens_after_the_first_over_decode_time(tiny_llm):
    s = Stats(prompt_tokens=8, generated_tokens=11, prefill_seconds=0.5, decode_seconds=2.0)
    assert s.decode_tok_s == 5.0  # (11 - 1) / 2.0: the first token is prefill's
    assert s.prefill_tok_s == 16.0
    assert Stats(generated_tokens=1, decode_seconds=0.1).decode_tok_s == 0.0
    assert Stats(generated_tokens=5, decode_seconds=0.0).decode_tok_s == 0.0
    assert s.as_dict()["decode_tok_s"] == 5.0
    assert Stats(generated_tokens=11, decode_seconds=2.0, rows=3).decode_tok_s == 4.0  # (11 - 3) / 2.0
    outs = tiny_llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=n, **GREEDY) for n in (9, 4)])
    st = tiny_llm.last_stats
    assert st.generated_tokens == 13 and st.prompt_tokens == 5
    # 2 of the 13 tokens came out of prefill, one per row; 11 were decoded
    assert st.decode_seconds > 0 and st.decode_tok_s == pytest.approx(11 / st.decode_seconds)
    assert sum(len(o.token_ids) for o in outs) == st.generated_tokens
