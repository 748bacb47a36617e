"""OpenAI's presence / frequency penalties in the sampler, and per-token logprobs (engine/logprobs.py),
against hand-written references. Their HTTP shapes: test_penalties_logprobs_http.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sluice.engine.logprobs import token_logprobs
from sluice.engine.sampling import Sampler, SamplingParams, filtered_probs
from sluice.errors import RequestError
from test_sampling import LOGITS, expected_probs

BIG = 1e4  # a logit that makes its token certain: exp(-2e4) is 0 in fp32 and the race noise is < 90


def penalised(logits, prompt=(), generated=(), repetition=1.0, presence=0.0, frequency=0.0):
    """Reference in float64: the repetition penalty over prompt + generated, then OpenAI's penalties
    over the generated tokens only (vLLM's order)."""
    x = np.array(logits, dtype=np.float64)
    for t in set(prompt) | set(generated):
        x[t] = x[t] * repetition if x[t] < 0 else x[t] / repetition
    counts = np.bincount(np.array(generated, dtype=np.int64), minlength=len(x))
    return x - presence * (counts > 0) - frequency * counts


def force(sampler: Sampler, token: int) -> None:
    """Make every row generate `token` through __call__ (so its counting path is the one tested)."""
    B, V = sampler.seen.shape
    logits = torch.full((B, V), -BIG)
    logits[:, token] = BIG
    assert (sampler(logits) == token).all()


# ------------------------------------------------------------------------------ penalties: the math


def test_filtered_probs_with_counts_matches_the_reference():
    prompt, generated = [0, 9], [2, 2, 2, 5, 9, 0]
    kw = dict(temperature=0.8, top_k=9, repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.35)
    x = penalised(LOGITS, prompt, generated, 1.3, 0.6, 0.35)
    expected = expected_probs(x, temperature=0.8, top_k=9)
    seen = torch.zeros(len(LOGITS), dtype=torch.bool)
    seen[prompt + generated] = True
    counts = torch.bincount(torch.tensor(generated), minlength=len(LOGITS))
    ours = filtered_probs(torch.tensor(LOGITS, dtype=torch.float32), SamplingParams(**kw), seen=seen, counts=counts)
    np.testing.assert_allclose(ours.numpy(), expected, atol=1e-6)
    # and the penalties did matter: without counts the distribution differs
    plain = filtered_probs(torch.tensor(LOGITS, dtype=torch.float32), SamplingParams(**kw), seen=seen)
    assert (plain - ours).abs().max() > 0.05


def test_order_after_repetition_penalty_and_before_temperature():
    # token 0: logit 2, in the prompt and generated once. Repetition 2 then presence 1 gives 2/2 - 1 = 0;
    # the other order would give (2 - 1)/2 = 0.5 and beat token 1's 0.3.
    logits = torch.tensor([2.0, 0.3, 0.0])
    seen, counts = torch.tensor([True, False, False]), torch.tensor([1, 0, 0])
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=1.0)
    assert filtered_probs(logits, greedy, seen=seen, counts=counts).argmax() == 1
    s = Sampler([greedy], 3)
    s.add_context(0, [0])
    s.add_generated(0, [0])
    assert s(logits[None]).item() == 1
    # before temperature: softmax((x - penalty) / T), not softmax(x / T - penalty)
    p = filtered_probs(logits, SamplingParams(temperature=0.5, presence_penalty=1.0), counts=counts)
    want = torch.tensor([1.0, 0.3, 0.0]).div(0.5).softmax(-1)
    torch.testing.assert_close(p, want)


def test_greedy_rows_take_the_argmax_of_penalised_logits_step_by_step():
    V = 16
    g = torch.Generator().manual_seed(5)
    prompt = [1, 4]
    kw = dict(temperature=0, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.25)
    s = Sampler([SamplingParams(**kw)], V)
    s.add_context(0, prompt)
    generated, moved = [], 0
    for _ in range(20):
        logits = torch.randn(V, generator=g) * 0.5
        logits[3] += 1.5  # a favourite that the frequency penalty must keep pushing down
        ref = penalised(logits.double().numpy(), prompt, generated, 1.2, 0.3, 0.25)
        top2 = np.sort(ref)[-2:]
        assert top2[1] - top2[0] > 1e-4, "a near tie: pick another seed"
        token = s(logits[None]).item()
        assert token == int(ref.argmax())
        moved += token != int(penalised(logits.double().numpy(), prompt, generated, 1.2).argmax())
        generated.append(token)
    assert moved > 0 and generated.count(3) < 15, generated  # the penalties changed choices
    assert torch.equal(s.counts[0], torch.bincount(torch.tensor(generated), minlength=V).float())


def test_prompt_tokens_are_not_counted():
    s = Sampler([SamplingParams(temperature=0, frequency_penalty=2.0)], 4)
    s.add_context(0, [0, 0, 0])
    assert s(torch.tensor([[1.0, 0.5, 0.0, 0.0]])).item() == 0  # the prompt's 0s cost nothing
    assert s(torch.tensor([[1.0, 0.5, 0.0, 0.0]])).item() == 1  # the generated one does


N_DRAWS = 20_000


def test_sampled_draws_follow_the_penalised_distribution():
    prompt, history = [0, 9], [2, 2, 5, 0]
    kw = dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    s = Sampler([SamplingParams(seed=500 + i, **kw) for i in range(N_DRAWS)], len(LOGITS))
    for row in range(N_DRAWS):
        s.add_context(row, prompt)
    for t in history:
        force(s, t)
    tokens = s(torch.tensor(LOGITS, dtype=torch.float32).expand(N_DRAWS, -1).contiguous())
    counts = np.bincount(tokens.numpy(), minlength=len(LOGITS))
    expected = expected_probs(penalised(LOGITS, prompt, history, 1.3, 0.5, 0.4), temperature=0.9)
    assert chisquare(counts, expected * N_DRAWS).pvalue > 1e-3
    unpenalised = expected_probs(penalised(LOGITS, prompt, history, 1.3), temperature=0.9)
    assert chisquare(counts, unpenalised * N_DRAWS).pvalue < 1e-6  # the test can tell the difference


def test_negative_penalties_encourage_repeats():
    s = Sampler([SamplingParams(temperature=0, presence_penalty=-2.0)], 3)
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    force(s, 0)
    assert s(logits).item() == 0  # 0 + 2 beats 1


# ------------------------------------------------------------------------ penalties: the sampler's state


def test_no_penalty_keeps_no_counts_and_identical_tokens():
    V = 50
    logits = torch.randn(8, 3, V, generator=torch.Generator().manual_seed(2))
    plain = Sampler([SamplingParams(seed=i, top_k=20) for i in range(3)], V)
    zero = Sampler([SamplingParams(seed=i, top_k=20, presence_penalty=0.0, frequency_penalty=0) for i in range(3)], V)
    assert plain.counts is None and zero.counts is None
    assert all(torch.equal(plain(x), zero(x)) for x in logits)


def test_same_seed_same_tokens_and_batch_independence():
    V, steps = 40, 15
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(steps, 3, V, generator=g) * 2
    params = [SamplingParams(seed=7, presence_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(seed=8),
              SamplingParams(temperature=0, frequency_penalty=1.0)]
    a, b = Sampler(params, V), Sampler(params, V)
    alone = [Sampler([p], V) for p in params]
    for x in logits:
        ta = a(x)
        assert torch.equal(ta, b(x))
        assert torch.equal(ta, torch.cat([s(x[r:r + 1]) for r, s in enumerate(alone)]))
    assert a.counts[1].sum() == steps  # every row is counted; only rows with penalties read it


def test_set_row_resets_the_counts():
    V = 30
    logits = torch.randn(12, 1, V, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    used = Sampler([p], V)
    for x in logits:
        used(x)
    assert used.counts.sum() == 12
    used.set_row(0, p)
    assert used.counts.sum() == 0
    fresh = Sampler([p], V)
    assert [used(x).item() for x in logits] == [fresh(x).item() for x in logits]


def test_set_row_turns_penalties_on_later():
    V = 6
    s = Sampler([SamplingParams(temperature=0), SamplingParams(temperature=0)], V)
    assert s.counts is None
    force(s, 2)  # not counted: no row asked
    s.set_row(1, SamplingParams(temperature=0, frequency_penalty=2.0))
    assert s.counts is not None and s.counts.sum() == 0
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]] * 2)
    assert s(logits).tolist() == [2, 2]
    assert s(logits).tolist() == [2, 0]  # row 1 counted its own 2 and now avoids it


def test_penalize_on_a_chunk_equals_the_full_row():
    V = 20
    params = [SamplingParams(repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.2, seed=1),
              SamplingParams(seed=2), SamplingParams(frequency_penalty=-0.5, seed=3)]
    s = Sampler(params, V)
    s.add_context(0, [1, 2, 3])
    s.add_generated(2, [5, 5, 6])
    for t in (4, 4, 7):
        force(s, t)
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    full = s.penalize(x)
    rows = torch.tensor([0, 2])
    torch.testing.assert_close(s.penalize(x[rows, 8:15], rows=rows, start=8), full[rows, 8:15], rtol=0, atol=0)
    assert s.counts[2, 5] == 2 and s.counts[2, 4] == 2 and s.seen[2, 6]


# ---------------------------------------------------------------------------------------- validation

BAD = [
    ("presence_penalty", 2.5, "2.5"),
    ("presence_penalty", -2.01, "-2.01"),
    ("presence_penalty", float("nan"), "nan"),
    ("presence_penalty", "0.5", "'0.5'"),
    ("frequency_penalty", math.inf, "inf"),
    ("frequency_penalty", True, "True"),
    ("logprobs", 21, "21"),
    ("logprobs", -1, "-1"),
    ("logprobs", 1.0, "1.0"),
    ("logprobs", True, "True"),
]


@pytest.mark.parametrize("name,value,shown", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_bad_values_are_named(name, value, shown):
    with pytest.raises(RequestError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert message.startswith(f"{name} must be ") and message.endswith(f"got {shown}"), message


def test_defaults_and_edges():
    p = SamplingParams().with_defaults({"presence_penalty": 1.0})  # not an HF generation_config key
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.0, 0.0, None)
    assert isinstance(p.presence_penalty, float)
    q = SamplingParams(presence_penalty=-2, frequency_penalty=2, logprobs=np.int64(20)).with_defaults()
    assert (q.presence_penalty, q.frequency_penalty, q.logprobs) == (-2.0, 2.0, 20) and type(q.logprobs) is int
    assert SamplingParams(logprobs=0).with_defaults().logprobs == 0


# --------------------------------------------------------------------------------------------- logprobs


def decode_one(i: int) -> str:
    return "é" if i == 3 else f"<{i}>"


def test_token_logprobs_match_log_softmax_and_topk():
    B, V = 4, 50
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(1)) * 3
    chosen = torch.tensor([3, logits[1].argmin().item(), 17, 49])
    top_n = [0, 1, 5, 20]
    out = token_logprobs(logits, chosen, top_n, decode_one)
    ref = torch.log_softmax(logits.double(), -1)
    for b, item in enumerate(out):
        assert item.token_id == chosen[b] and item.token == decode_one(item.token_id)
        assert item.logprob == pytest.approx(ref[b, chosen[b]].item(), abs=1e-5)
        values, ids = ref[b].topk(top_n[b])
        assert [t.token_id for t in item.top] == ids.tolist()
        np.testing.assert_allclose([t.logprob for t in item.top], values.numpy(), atol=1e-5)
        assert all(t.token == decode_one(t.token_id) and t.bytes == list(t.token.encode()) for t in item.top)
    assert out[0].bytes == [0xC3, 0xA9] and out[0].top == []
    # the chosen token is reported even when it is outside the top
    assert out[1].token_id not in [t.token_id for t in out[1].top] and out[1].logprob < out[1].top[0].logprob


def test_token_logprobs_entropy_is_the_whole_distributions():
    from scipy.stats import entropy
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2)) * 4
    logits[1, 100:] = -math.inf  # tokens the model rules out add nothing (0 log 0 = 0), not NaN
    logits[2] = 0.0  # uniform: log V
    out = token_logprobs(logits, torch.tensor([0, 1, 2]), [2, 2, 2], decode_one)
    for row, item in zip(logits, out, strict=True):
        assert item.entropy == pytest.approx(entropy(torch.softmax(row.double(), -1).numpy()), abs=1e-5)
    assert out[2].entropy == pytest.approx(math.log(300), abs=1e-5)


def test_token_logprobs_are_the_raw_fp32_distribution_for_any_dtype():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = token_logprobs(logits, torch.tensor([5, 6]), [3, 3], decode_one)
    ref = torch.log_softmax(logits.float(), -1)
    assert [o.logprob for o in out] == [ref[0, 5].item(), ref[1, 6].item()]


def test_token_logprobs_break_ties_by_token_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0]])
    [item] = token_logprobs(logits, torch.tensor([4]), [3], decode_one)
    assert [t.token_id for t in item.top] == [1, 2, 4]
    [item] = token_logprobs(torch.zeros(1, 1000), torch.tensor([999]), [4], decode_one)
    assert [t.token_id for t in item.top] == [0, 1, 2, 3]
    assert item.logprob == pytest.approx(-math.log(1000))

