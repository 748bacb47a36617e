"""Speculative decoding (engine/speculative.py, proposers.py): lossless against plain decoding.

Greedy output must be token-identical to plain decoding; sampled output must follow the target's
filtered distribution (chi-square against the exact law computed by full recompute); the target's and
the draft's paged caches after some rounds must hold exactly the accepted tokens; a draft that does not share the tokenizer is refused.
Drafts are crafted to force both outcomes: the target itself (guesses kept), the target with noisy
weights (some kept, some rejected) and an unrelated small random model (mostly rejected)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

import sluice
from ckpt import build, build_with_tokenizer
from sluice import SamplingParams
from sluice.engine.paged_cache import BlockPool, PagedView
from sluice.engine.proposers import lookup
from sluice.engine.sampling import filtered_probs
from sluice.errors import ConfigError, NumericsError
from tok_fixtures import VOCAB_SIZE, build_tokenizer

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["def add(a, b):\n    return a + b\n\nprint(add(2, 3))", "Hello world! How are you", "The"]


def noisy_copy(src, dst, scale: float, seed: int = 0):
    """The checkpoint in src with Gaussian noise (scale x each tensor's std) on every weight."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(dst / "model.safetensors")
    for t in tensors.values():
        t += scale * t.std() * torch.randn(t.shape, generator=g)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def drafts(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    small = root / "small"  # unrelated, smaller: almost every guess rejected
    build_with_tokenizer(small, "qwen3", hidden_size=32, intermediate_size=48, num_hidden_layers=1, head_dim=8,
                         max_position_embeddings=512, seed=7)
    return {"same": tiny_dir, "noisy": noisy_copy(tiny_dir, root / "noisy", 0.15), "small": small}


@pytest.fixture(scope="module")
def spec_llms(tiny_dir, drafts):
    llms = {name: sluice.LLM(str(tiny_dir), draft_model=str(d)) for name, d in drafts.items()}
    llms["lookup"] = sluice.LLM(str(tiny_dir), speculative="prompt-lookup")
    return llms


def set_k(llm, k) -> None:
    """Guesses per round for the requests llm takes from now on."""
    llm.batch_engine().scheduler.speculation.set_k(k)


# ---------------------------------------------------------------- greedy: token-identical to plain decoding


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lookup", "same", "noisy", "small"])
def test_greedy_identical_to_plain_batch_1_and_batched(tiny_llm, spec_llms, name):
    llm = spec_llms[name]
    for prompt in PROMPTS:
        plain = tiny_llm.generate([prompt], GREEDY)[0]
        out = llm.generate([prompt], GREEDY)[0]
        assert out.token_ids == plain.token_ids and out.text == plain.text
    plain = tiny_llm.generate(PROMPTS, GREEDY)
    outs = llm.generate(PROMPTS, GREEDY)  # rows of different lengths, accepting different counts
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    s = llm.last_stats
    assert s.speculative == ("prompt-lookup" if name == "lookup" else "draft")
    assert s.generated_tokens == 3 * 24 and s.proposed > 0
    if name == "same":
        assert s.acceptance_rate > 0.9 and s.tokens_per_forward > 3
    elif name == "small":
        assert s.accepted < 0.3 * s.proposed
    else:  # both outcomes within the same run
        assert 0 < s.accepted < s.proposed and s.tokens_per_forward > 1


@pytest.mark.slow
def test_adaptive_k_grows_with_kept_guesses_and_stays_exact(tiny_llm, spec_llms):
    plain = tiny_llm.generate(PROMPTS, GREEDY)
    for name in ("same", "small"):
        llm = spec_llms[name]
        set_k(llm, "auto")
        try:
            outs = llm.generate(PROMPTS, GREEDY)
        finally:
            set_k(llm, 4)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        if name == "same":  # every guess kept: k climbs from 4 to 8, past what a fixed 4 allows (5 per forward)
            assert llm.last_stats.tokens_per_forward > 5


def test_auto_k_prices_a_sampled_rows_guesses():
    """Speculation.adapt: a greedy row guesses one more than a / (1 - a); a sampled row takes the k that maximises
    a round's expected tokens over its cost (AUTO_ROUND_COST, AUTO_GUESS_COST), fewer at the same keep rate."""
    from sluice.engine.sequence import SpecState
    from sluice.engine.speculative import AUTO_MAX_TOKENS
    from sluice.engine.verify import Speculation

    def settle(rounds, sampled):
        state = SpecState(4, True)
        for _ in range(30):
            for kept, rejected in rounds:
                Speculation.adapt(state, kept, rejected, sampled)
        return state.k
    half = [(1, True)]  # one of two checked guesses kept: a = 0.5
    assert settle(half, sampled=False) == 2 and settle(half, sampled=True) == 1
    two_thirds = [(2, True)]  # a = 2/3: 1.15, 1.21, 1.17 expected tokens per plain step at k = 1, 2, 3
    assert settle(two_thirds, sampled=False) == 3 and settle(two_thirds, sampled=True) == 2
    every = [(4, False)]  # every guess kept: both climb to the most
    assert settle(every, sampled=False) == settle(every, sampled=True) == AUTO_MAX_TOKENS
    fixed = SpecState(3, False)
    Speculation.adapt(fixed, 0, True, sampled=True)  # a fixed k is left alone
    assert fixed.k == 3


def test_the_scheduler_tells_auto_k_which_rows_sample(spec_llms, monkeypatch):
    from sluice.engine.verify import Speculation
    seen = []
    inner = Speculation.adapt
    monkeypatch.setattr(Speculation, "adapt", staticmethod(lambda *a: seen.append(a[3]) or inner(*a)))
    llm = spec_llms["noisy"]
    set_k(llm, "auto")
    try:
        llm.generate([PROMPTS[0]], GREEDY)
        greedy = len(seen)
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True))
    finally:
        set_k(llm, 4)
    assert greedy > 0 and not any(seen[:greedy]) and len(seen) > greedy and all(seen[greedy:])


def test_stats_reach_as_dict(spec_llms):
    spec_llms["noisy"].generate(PROMPTS[:1], GREEDY)
    d = spec_llms["noisy"].last_stats.as_dict()
    assert d["speculative"] == "draft" and d["proposed"] >= d["accepted"] > 0
    assert d["acceptance_rate"] == round(d["accepted"] / d["proposed"], 4) and d["tokens_per_forward"] > 1


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_max_tokens_never_exceeded_inside_an_accepted_run(tiny_llm, spec_llms, max_tokens):
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for name in ("same", "lookup"):
        out = spec_llms[name].generate(PROMPTS, p)
        assert [o.token_ids for o in out] == [o.token_ids for o in tiny_llm.generate(PROMPTS, p)]
        assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in out)


def test_stop_token_and_stop_string_inside_an_accepted_run(tiny_llm, spec_llms):
    ids = tiny_llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    stop_id = ids[6]  # the draft (= target) guesses it inside a run of kept tokens
    p = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id])
    plain, spec = tiny_llm.generate([PROMPTS[0]], p)[0], spec_llms["same"].generate([PROMPTS[0]], p)[0]
    assert spec.token_ids == plain.token_ids == ids[: ids.index(stop_id) + 1] and spec.finish_reason == "stop"
    text = tiny_llm.generate([PROMPTS[0]], GREEDY)[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    plain, spec = tiny_llm.generate([PROMPTS[0]], p)[0], spec_llms["same"].generate([PROMPTS[0]], p)[0]
    assert spec.text == plain.text and stop not in spec.text and spec.finish_reason == plain.finish_reason == "stop"
    assert spec.token_ids == plain.token_ids


def test_stream_and_chat(tiny_llm, spec_llms):
    for name in ("noisy", "lookup"):
        deltas = list(spec_llms[name].stream(PROMPTS[0], GREEDY))
        assert "".join(deltas) == tiny_llm.generate([PROMPTS[0]], GREEDY)[0].text
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        assert spec_llms[name].chat(msgs, GREEDY).token_ids == tiny_llm.chat(msgs, GREEDY).token_ids


def test_non_finite_target_raises(tiny_dir, drafts):
    llm = sluice.LLM(str(tiny_dir), draft_model=str(drafts["small"]))
    with torch.no_grad():
        llm.model.layers[1].mlp.down.weight[0, 0] = float("nan")
    with pytest.raises(NumericsError, match="non-finite logits"):
        llm.generate("hi", GREEDY)


# ---------------------------------------------------------------- sampling: the target's law, exactly
# (the acceptance rule alone, on small synthetic laws: tests/engine/test_acceptance_rule.py, the inner loop)


def exact_joint(model, prompt, params, steps):
    """{(x1, .., x_steps): probability} under plain sampling, by full recompute of every prefix."""
    law = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, mass in law.items():
            ids = prompt + list(prefix)
            with torch.inference_mode():
                logits = model(torch.tensor([ids]))[0, -1]
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
            seen[ids] = True
            probs = filtered_probs(logits, params, seen)
            for t in torch.nonzero(probs > 1e-6)[:, 0].tolist():
                nxt[prefix + (t,)] = mass * probs[t].item()
        law = nxt
    return law


def chi_square_of_runs(outs, law, n):
    counts = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert set(counts) <= set(law), "a sequence plain sampling cannot produce"
    cells = sorted(law, key=law.get, reverse=True)
    # Cells expected fewer than 5 times are pooled into one, as the test's approximation needs.
    big = [c for c in cells if law[c] * n >= 5]
    small = [c for c in cells if law[c] * n < 5]
    obs = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else [])
    exp = [law[c] * n for c in big] + ([sum(law[c] for c in small) * n] if small else [])
    exp = [e * n / sum(exp) for e in exp]
    return chisquare(obs, exp).pvalue


SAMPLED = {"temp-topk": dict(temperature=0.8, top_k=3), "topp-minp": dict(temperature=1.2, top_k=6, top_p=0.8, min_p=0.2),
           "penalty": dict(temperature=1.0, top_k=4, repetition_penalty=1.5),
           "mild-penalty": dict(temperature=1.0, top_k=4, repetition_penalty=1.1),
           "penalty-4": dict(temperature=1.0, top_k=2, repetition_penalty=1.5)}  # 4 tokens: 3rd guess sees 2 before


@pytest.mark.slow
@pytest.mark.parametrize("name, kw", [("noisy", "temp-topk"), ("noisy", "topp-minp"), ("noisy", "penalty"),
                                      ("small", "temp-topk"), ("lookup", "temp-topk"), ("lookup", "mild-penalty"),
                                      ("noisy", "penalty-4")])
def test_sampled_joint_of_three_tokens_is_the_targets(tiny_llm, spec_llms, name, kw):
    kw_name = kw
    """The joint law of the first three tokens (the 2nd and 3rd come out of one speculative round of one
    guess and the token after it) against the exact law, over 800 seeds run as one batch, with guesses often rejected. Every
    case sets top_k, which keeps the law's support small enough to enumerate."""
    n, kw, steps = 800, SAMPLED[kw], 4 if kw.endswith("-4") else 3
    base = [7, 8, 9, 10]
    # The draft cases' prompt repeats the base with the model's greedy continuation after it. Prompt lookup
    # gets the model's own greedy text, which repeats a token: it finds matches whose next token the model
    # likes (kept sometimes, not always; a round guesses at most the tokens max_tokens leaves).
    cont = tiny_llm.generate([base], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    prompt = base + cont[:5] if name == "lookup" else base + cont + base
    params = [SamplingParams(max_tokens=steps, ignore_eos=True, seed=s, **kw) for s in range(n)]
    llm = spec_llms[name]
    set_k(llm, steps - 1)
    try:
        outs = llm.generate([prompt] * n, params)
    finally:
        set_k(llm, 4)
    s = llm.last_stats
    assert s.accepted < s.proposed  # rejections; and acceptances where the proposer can win them: the
    # unrelated draft's top-k rarely meets the target's, and the penalty pushes down the seen tokens lookup guesses
    assert s.accepted > 0 or name == "small" or "penalty" in kw_name
    law = exact_joint(tiny_llm.model, prompt, SamplingParams(**kw), steps)
    assert chi_square_of_runs(outs, law, n) > 1e-3


def test_seeded_sampling_repeats(spec_llms):
    p = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    a = spec_llms["noisy"].generate(PROMPTS[:2], p)
    b = spec_llms["noisy"].generate(PROMPTS[:2], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


# ---------------------------------------------------------------- the caches hold exactly the accepted tokens


def _prefilled(model, tokens: list[int]) -> BlockPool:
    """A fresh pool holding `tokens` prefilled by the plain torch forward, in blocks 0, 1, ..."""
    pool = BlockPool(model.config, -(-len(tokens) // 16) + 1, 16)
    view = PagedView(pool, [list(range(pool.num_blocks))])
    with torch.inference_mode():
        model(torch.tensor([tokens]), torch.arange(len(tokens))[None], view)
    return pool


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_equal_plain_prefill_of_the_accepted_tokens(tiny_dir, drafts, temperature):
    """After some rounds mid-generation, every slot the scheduler counts as computed holds the keys and
    values of the accepted tokens: the target's up to num_computed, the draft's up to draft_valid (the
    blocks holding only rejected guesses went back to the pool)."""
    llm = sluice.LLM(str(tiny_dir), draft_model=str(drafts["noisy"]))
    engine = llm.batch_engine()
    prompts = [[5, 17, 99, 230, 4, 61, 7], [3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=60, ignore_eos=True) for i in range(3)]
    seqs = [llm.add_request(r) for r in llm.requests(prompts, params)]
    for _ in range(8):
        llm.step()
    assert all(not s.finished for s in seqs)
    assert 0 < sum(s.spec.accepted for s in seqs) < sum(s.spec.proposed for s in seqs)
    draft_pool = engine.scheduler.speculation.proposer.pool
    for s in seqs:
        assert s.num_computed == len(s.ids) - 1  # every token but the last emitted one is in the cache
        assert len(s.blocks) == -(-len(s.ids) // 16)  # no block beyond the next token's
        for model, pool, upto in ((llm.model, engine.pool, s.num_computed), (llm.draft_model, draft_pool, s.spec.draft_valid)):
            assert upto >= s.num_computed - 1
            ref = _prefilled(model, s.ids[:upto])
            for got, want in ((pool.k, ref.k), (pool.v, ref.v)):
                flat = got[:, s.blocks].transpose(2, 3).flatten(1, 2)[:, :upto]  # (L, slots, K, D)
                torch.testing.assert_close(flat, want[:, :len(s.blocks)].transpose(2, 3).flatten(1, 2)[:, :upto],
                                           atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- prompt lookup itself


def test_lookup_takes_the_longest_suffix_match():
    h = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 3, 4]
    assert lookup(h, 3) == [6, 7, 8]  # "8 3 4" never occurred; "3 4" did twice: the latest is followed by 6 7 8
    assert lookup([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2]  # the latest match with 4 after it does not exist
    assert lookup([1, 2, 3], 4) == [] and lookup([5], 2) == []
    assert lookup([1, 2, 9, 1, 2], 2, max_ngram=2, min_ngram=2) == [9, 1]


# ---------------------------------------------------------------- refusals


def test_draft_with_other_vocab_size_or_tokenizer_refused(tiny_dir, tmp_path):
    other_size = tmp_path / "size"
    build(other_size, "qwen3", vocab_size=VOCAB_SIZE + 64, max_position_embeddings=512)
    build_tokenizer(other_size, "qwen")
    with pytest.raises(ConfigError, match=r"different vocabulary sizes \(576 vs 512\)"):
        sluice.LLM(str(tiny_dir), draft_model=str(other_size))
    other_tok = tmp_path / "tok"
    build_with_tokenizer(other_tok, "qwen3", kind="llama", max_position_embeddings=512)
    with pytest.raises(ConfigError, match=r"different tokenizers: token id \d+ is .* in the draft's"):
        sluice.LLM(str(tiny_dir), draft_model=str(other_tok))
    short = tmp_path / "short"
    build_with_tokenizer(short, "qwen3", max_position_embeddings=128)
    with pytest.raises(ConfigError, match="context of 128 tokens, shorter than max_model_len=512"):
        sluice.LLM(str(tiny_dir), draft_model=str(short))
    sluice.LLM(str(tiny_dir), draft_model=str(short), max_model_len=128)  # fits: accepted


@pytest.mark.parametrize("kw, match", [
    (dict(speculative="prompt-lookup", num_speculative_tokens=0), "num_speculative_tokens must be an integer"),
    (dict(speculative="prompt-lookup", num_speculative_tokens=17), r"in \[1, 16\] or 'auto', got 17"),
    (dict(speculative="prompt-lookup", num_speculative_tokens=True), "got True"),
    (dict(speculative="prompt-lookup", num_speculative_tokens=2.0), "got 2.0"),
    (dict(speculative="prompt-lookup", num_speculative_tokens="fast"), "or 'auto', got 'fast'"),
    (dict(speculative="medusa"), "speculative must be one of"),
    (dict(speculative="prompt-lookup", draft_model="x"), "only used with speculative='draft'"),
    (dict(speculative="off", draft_model="x"), "only used with speculative='draft'"),
    (dict(speculative="draft"), "needs draft_model="),
    (dict(num_speculative_tokens=3), "needs speculative decoding"),
])
def test_bad_speculative_arguments_refused(tiny_dir, kw, match):
    with pytest.raises(ConfigError, match=match):
        sluice.LLM(str(tiny_dir), **kw)


# ---------------------------------------------------------------- the command line


def run_cli(*args):  # timeout: a hang-stopper, 10x+ the ~25 s of the slowest run here (under load)
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_prompt_lookup_prints_stats_and_matches_plain(tiny_dir, tiny_llm):
    expected = tiny_llm.generate("Hello world", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    r = run_cli("generate", "--model", str(tiny_dir), "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
                "--prompt-lookup", "--speculative-tokens", "3", "Hello world")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hello world" + expected.text + "\n"
    assert "[speculative (prompt-lookup, 3 tokens per guess)" in r.stderr and "accepted" in r.stderr
    r = run_cli("generate", "--model", str(tiny_dir), "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
                "--draft-model", str(tiny_dir), "--json", "Hello world")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == expected.token_ids and out["stats"]["speculative"] == "draft"


@pytest.mark.slow
@pytest.mark.parametrize("args, match", [
    (["--prompt-lookup", "--speculative-tokens", "0"], "--speculative-tokens must be an integer in [1, 16] or 'auto', got 0"),
    (["--speculative-tokens", "3"], "--speculative-tokens needs --draft-model or --prompt-lookup"),
    (["--prompt-lookup", "--draft-model", "x"], "pick one"),
])
def test_cli_bad_speculative_flags(tiny_dir, args, match):
    r = run_cli("generate", "--model", str(tiny_dir), *args, "hi")
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr
