"""SamplingParams validation/defaults and the batched sampler's distribution and determinism."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from sluice.errors import RequestError
from sluice.engine.sampling import Sampler, SamplingParams, filtered_probs

# No ties, and no filter threshold lands near a cut (checked in expected_probs), so rounding
# cannot move a token across a boundary.
LOGITS = np.array([2.0, 1.6, 1.3, 1.1, 0.9, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -2.5])
N_DRAWS = 20_000


def expected_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seen=(), penalty=1.0):
    """The filtered distribution, written out step by step in float64 (independent of sluice)."""
    x = np.array(logits, dtype=np.float64)
    for t in set(seen):
        x[t] = x[t] * penalty if x[t] < 0 else x[t] / penalty
    p = np.exp(x / temperature - (x / temperature).max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_k > 0:
        p[order[top_k:]] = 0.0
        p /= p.sum()
    if top_p < 1.0:
        cum, kept = 0.0, []
        for t in order:
            kept.append(t)
            cum += p[t]
            if cum >= top_p:
                break
        assert abs(cum - top_p) > 1e-3 and abs(cum - p[t] - top_p) > 1e-3, "top_p cut too close to call"
        mask = np.zeros_like(p, dtype=bool)
        mask[kept] = True
        p[~mask] = 0.0
        p /= p.sum()
    if min_p > 0.0:
        ratio = p / p.max()
        assert np.all(np.abs(ratio - min_p) > 1e-3), "min_p cut too close to call"
        p[ratio < min_p] = 0.0
        p /= p.sum()
    return p


def draw_counts(params_kwargs, context=(), base_seed=1000):
    """N_DRAWS single draws: one row per draw, each row with its own seed, in one call."""
    params = [SamplingParams(seed=base_seed + i, **params_kwargs) for i in range(N_DRAWS)]
    sampler = Sampler(params, vocab_size=len(LOGITS))
    for row in range(N_DRAWS) if context else ():
        sampler.add_context(row, list(context))
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(N_DRAWS, -1).contiguous()
    tokens = sampler(logits)
    assert tokens.dtype == torch.int64 and tokens.shape == (N_DRAWS,)
    return np.bincount(tokens.numpy(), minlength=len(LOGITS))


CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.75),
    "min_p": dict(min_p=0.12),
    "combined": dict(temperature=1.3, top_k=9, top_p=0.85, min_p=0.12),
}


@pytest.mark.parametrize("name", CASES)
def test_draws_follow_the_filtered_distribution(name):
    kwargs = CASES[name]
    expected = expected_probs(LOGITS, **kwargs)
    if name != "temperature":
        assert (expected == 0).any(), "the filter should remove something, or the test proves little"
    counts = draw_counts(kwargs)
    assert counts[expected == 0].sum() == 0
    nz = expected > 0
    assert chisquare(counts[nz], expected[nz] * N_DRAWS).pvalue > 1e-3
    # filtered_probs (what the sampler uses) agrees with the hand computation too.
    ours = filtered_probs(torch.tensor(LOGITS, dtype=torch.float32), SamplingParams(**kwargs))
    np.testing.assert_allclose(ours.numpy(), expected, atol=1e-6)


def test_draws_with_repetition_penalty_and_filters():
    seen = [0, 2, 9]  # positive and negative logits
    kwargs = dict(temperature=0.9, top_k=8, top_p=0.9, repetition_penalty=1.8)
    expected = expected_probs(LOGITS, seen=seen, penalty=1.8, **{k: v for k, v in kwargs.items() if k != "repetition_penalty"})
    counts = draw_counts(kwargs, context=seen)
    assert counts[expected == 0].sum() == 0
    nz = expected > 0
    assert chisquare(counts[nz], expected[nz] * N_DRAWS).pvalue > 1e-3


def test_greedy_is_argmax_for_any_float_dtype():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = logits.to(dtype)
        sampler = Sampler([SamplingParams(temperature=0, seed=i) for i in range(6)], vocab_size=50)
        assert torch.equal(sampler(x), x.float().argmax(-1))


def test_top_k_keeps_ties_and_top_p_breaks_ties_by_token_id():
    p = filtered_probs(torch.tensor([1.0, 1.0, 1.0, 0.0]), SamplingParams(top_k=2))
    assert (p[:3] > 0).all() and p[3] == 0
    p = filtered_probs(torch.zeros(4), SamplingParams(top_p=0.5))
    assert p.tolist() == [0.5, 0.5, 0.0, 0.0]


def test_filtered_probs_greedy_is_one_hot_and_batches():
    x = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0]])
    p = filtered_probs(x, [SamplingParams(temperature=0), SamplingParams(temperature=1)])
    assert p[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(p[1], x[1].softmax(-1))


def run(sampler, steps, V, seed=0, rows=1):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([sampler(torch.randn(rows, V, generator=g)) for _ in range(steps)], 1)


def test_same_seed_same_tokens_different_seed_different_tokens():
    V = 1000
    make = lambda seed: Sampler([SamplingParams(temperature=1.0, seed=seed)], V)  # noqa: E731
    a, b, c = run(make(123), 30, V), run(make(123), 30, V), run(make(124), 30, V)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # seed None draws fresh entropy each time
    assert not torch.equal(run(make(None), 30, V), run(make(None), 30, V))


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_k=10, seed=1),
    SamplingParams(top_p=0.9, repetition_penalty=1.2, seed=2),
    SamplingParams(min_p=0.1, temperature=1.5, seed=3),
    SamplingParams(temperature=0, repetition_penalty=1.5),
]


def test_batched_rows_match_one_by_one():
    V, steps = 64, 12
    prompts = [[1, 2], [], [5, 6, 7], [8], [0, 3, 3]]
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(steps, len(MIXED), V, generator=g) * 3
    batched = Sampler(MIXED, V)
    singles = [Sampler([p], V) for p in MIXED]
    for row, prompt in enumerate(prompts):
        batched.add_context(row, prompt)
        singles[row].add_context(0, prompt)
    for step in range(steps):
        together = batched(logits[step])
        alone = torch.cat([s(logits[step, row : row + 1]) for row, s in enumerate(singles)])
        assert torch.equal(together, alone)


def test_set_row_resets_only_that_row():
    V = 100
    base = [SamplingParams(seed=10), SamplingParams(seed=20)]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 2, V, generator=g)
    s = Sampler(base, V)
    first = [s(logits[i]) for i in range(5)]
    s.set_row(1, SamplingParams(seed=99, repetition_penalty=1.3), context=[4, 5])
    second = [s(logits[i]) for i in range(5, 10)]
    row0_alone, row1_alone = Sampler([base[0]], V), Sampler([SamplingParams(seed=99, repetition_penalty=1.3)], V)
    row1_alone.add_context(0, [4, 5])
    assert [t[0].item() for t in first + second] == [row0_alone(logits[i, :1]).item() for i in range(10)]
    assert [t[1].item() for t in second] == [row1_alone(logits[i, 1:]).item() for i in range(5, 10)]


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    V, penalty = 40, 1.7
    g = torch.Generator().manual_seed(11)
    prompt = [3, 7, 7, 12, 30]
    hf = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    sampler = Sampler([SamplingParams(temperature=0, repetition_penalty=penalty)], V)
    sampler.add_context(0, prompt)
    ids, flipped = list(prompt), 0
    for _ in range(8):
        logits = torch.randn(1, V, generator=g)
        logits[0, ids[-1]] = 2.5  # a strong repeat that the penalty should usually overturn
        want = hf(torch.tensor([ids]), logits.clone())
        seen = torch.zeros(1, V, dtype=torch.bool)
        seen[0, ids] = True
        got = filtered_probs(logits, SamplingParams(temperature=1, repetition_penalty=penalty), seen=seen)
        torch.testing.assert_close(got, want.softmax(-1))
        token = sampler(logits)
        assert token.item() == want.argmax(-1).item()
        flipped += token.item() != logits.argmax(-1).item()
        ids.append(token.item())
    assert flipped > 0


# ------------------------------------------------------------------------------------ validation

BAD = [
    ("temperature", float("nan"), "nan"),
    ("temperature", -0.1, "-0.1"),
    ("temperature", 2.5, "2.5"),
    ("temperature", math.inf, "inf"),
    ("temperature", "0.5", "'0.5'"),
    ("temperature", True, "True"),
    ("top_p", 0.0, "0.0"),
    ("top_p", 1.5, "1.5"),
    ("top_p", float("nan"), "nan"),
    ("min_p", -0.1, "-0.1"),
    ("min_p", 1.01, "1.01"),
    ("top_k", -2, "-2"),
    ("top_k", 2.5, "2.5"),
    ("top_k", True, "True"),
    ("max_tokens", 0, "0"),
    ("max_tokens", True, "True"),
    ("max_tokens", 10.0, "10.0"),
    ("repetition_penalty", 0.0, "0.0"),
    ("repetition_penalty", -1.0, "-1.0"),
    ("repetition_penalty", math.inf, "inf"),
    ("repetition_penalty", float("nan"), "nan"),
    ("seed", 1.5, "1.5"),
    ("seed", "42", "'42'"),
    ("seed", False, "False"),
    ("stop", "", "''"),
    ("stop", ["ok", ""], "''"),
    ("stop", ["ok", 3], "3"),
    ("stop", 5, "5"),
    ("stop_token_ids", [1, -1], "-1"),
    ("stop_token_ids", [True], "True"),
    ("stop_token_ids", 7, "7"),
    ("ignore_eos", 1, "1"),
    ("ignore_eos", "yes", "'yes'"),
]


@pytest.mark.parametrize("name,value,shown", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_bad_values_name_parameter_and_value(name, value, shown):
    with pytest.raises(RequestError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert message.startswith(f"{name} must be ") and message.endswith(f"got {shown}"), message
    assert isinstance(info.value, ValueError)


def test_stop_token_ids_checked_against_vocab():
    p = SamplingParams(stop_token_ids=[2, 10])
    p.validate()
    with pytest.raises(RequestError, match=r"stop_token_ids must be .*< vocab size 10, got 10$"):
        p.validate(vocab_size=10)
    with pytest.raises(RequestError, match="stop_token_ids"):
        Sampler([p], vocab_size=10)


def test_good_edge_values_pass():
    """Values on the edge of each rule are taken as given (a falsy 0 is not "unset"), normalised to
    Python numbers, and a sampler runs with them."""
    edges = [
        (dict(temperature=0, top_p=1, min_p=0, top_k=-1, max_tokens=1, repetition_penalty=1e-3, seed=-5),
         dict(temperature=0.0, top_p=1.0, min_p=0.0, top_k=-1, max_tokens=1, repetition_penalty=1e-3, seed=-5)),
        (dict(temperature=2, top_p=1e-9, min_p=1, top_k=0, seed=2**80, stop=("a", "b"), ignore_eos=True),
         dict(temperature=2.0, top_p=1e-9, min_p=1.0, top_k=0, seed=2**80, stop=["a", "b"], ignore_eos=True)),
        (dict(temperature=np.float32(0.5), top_k=np.int64(3)), dict(temperature=0.5, top_k=3)),
    ]
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    for given, want in edges:
        p = SamplingParams(**given).with_defaults({"temperature": 0.9, "top_k": 7, "max_new_tokens": 5})
        got = {k: getattr(p, k) for k in want}
        assert got == want and all(type(got[k]) is type(want[k]) for k in want), given
        # every edge here leaves one token: greedy, top_p 1e-9, min_p 1 with no tie, top_k 3 at T 0.5 aside
        token = Sampler([p], 4)(logits).item()
        assert token == 1 or (given.get("top_k") == 3 and token in (0, 1, 3))


# ---------------------------------------------------------------------------------- with_defaults


def test_library_defaults():
    p = SamplingParams().with_defaults(None)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (256, 1.0, 0, 1.0, 0.0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.ignore_eos is False


def test_generation_config_fills_unset_fields_and_do_sample_false_means_greedy():
    cfg = {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 100, "eos_token_id": 2}
    p = SamplingParams().with_defaults(cfg)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 0.9, 20, 100)
    q = SamplingParams(temperature=0.5, max_tokens=7, stop="\n").with_defaults(cfg)
    assert (q.temperature, q.max_tokens, q.top_p, q.stop) == (0.5, 7, 0.9, ["\n"])
    assert q.with_defaults({"temperature": 1.9, "top_p": 0.1}) == q  # resolved is a fixed point


def test_generation_config_sampling_values():
    cfg = {"do_sample": True, "temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1, "top_k": None}
    p = SamplingParams(top_p=0.95).with_defaults(cfg)
    assert (p.temperature, p.min_p, p.repetition_penalty, p.top_p, p.top_k) == (0.7, 0.05, 1.1, 0.95, 0)
    assert isinstance(SamplingParams(temperature=1).with_defaults({}).temperature, float)


@pytest.mark.parametrize("cfg, shown", [
    ({"temperature": 5.0}, r"^generation_config.json: temperature must be .*got 5.0$"),
    ({"max_new_tokens": "16"}, r"^generation_config.json: max_new_tokens must be an integer >= 1, got '16'$"),
    ({"max_new_tokens": True}, r"max_new_tokens must be .*got True$"),
    ({"top_k": 2.5}, r"top_k must be an integer .*got 2.5$"),
    ({"top_p": [0.9]}, r"top_p must be .*got \[0.9\]$"),
    ({"repetition_penalty": float("nan")}, r"repetition_penalty must be .*got nan$"),
    ({"do_sample": "false"}, r"^generation_config.json: do_sample must be true or false, got 'false'$"),
])
def test_bad_generation_config_value_is_reported_as_such(cfg, shown):
    # named by the file and its own key, even when the request overrides that field
    with pytest.raises(RequestError, match=shown):
        SamplingParams(max_tokens=3, temperature=1.0, top_k=1, top_p=1.0).with_defaults(cfg)
    with pytest.raises(RequestError, match="generation_config.json must hold a JSON object"):
        SamplingParams().with_defaults([cfg])


def test_with_defaults_revalidates_mutated_fields():
    p = SamplingParams(temperature=1.0)
    p.temperature = 3.0
    with pytest.raises(RequestError, match="temperature must be .*got 3.0"):
        p.with_defaults({})


def test_top_p_one_row_keeps_far_tail_next_to_a_filtered_row():
    # Row 1's tail is so light (e^-30 each) that its fp32 cumulative mass reaches exactly 1 after the
    # top token: only the explicit "top_p == 1 is off" rule keeps it. Row 0 turns top_p on for the batch.
    V = 1001
    logits = torch.full((2, V), -30.0)
    logits[:, 0] = 0.0
    assert logits[1].softmax(-1).cumsum(-1)[0] == 1.0  # the premise: rounding would drop the tail
    probs = filtered_probs(logits, [SamplingParams(top_p=0.5), SamplingParams(top_p=1.0)])
    assert probs[0, 1:].sum() == 0 and probs[0, 0] == 1  # the filtered row did cut
    assert (probs[1] > 0).all()  # the top_p = 1 row kept every far-tail token
    torch.testing.assert_close(probs[1], logits[1].softmax(-1), rtol=1e-5, atol=0)


def _filter_by_full_sort(x, rows, use_top_k, use_top_p, use_min_p):
    """sampling.filter_logits as it was before the top-k prefix (one stable sort of the whole row): the reference."""
    import math
    import torch.nn.functional as F
    x = (x - x.amax(-1, keepdim=True)) / rows["temperature"][:, None]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if use_top_k:
        keep &= sorted_x >= sorted_x.gather(1, rows["top_k"][:, None] - 1)
    if use_top_p or use_min_p:
        probs = sorted_x.masked_fill(~keep, -math.inf).softmax(-1)
        if use_top_p:
            mass_before = F.pad(probs.cumsum(-1)[:, :-1], (1, 0))
            keep &= (mass_before < rows["top_p"][:, None]) | (rows["top_p"][:, None] >= 1)
        if use_min_p:
            keep &= probs >= rows["min_p"][:, None] * probs[:, :1]
    keep[:, 0] = True
    return x.masked_fill(~torch.empty_like(keep).scatter_(1, order, keep), -math.inf)


def test_top_k_prefix_filter_equals_the_full_sort_bit_for_bit():
    """filter_logits sorts only the k largest when every sampled row has top_k (filtering._descending): the
    result must be the full stable sort's exactly, ties included (logits rounded to halves make many,
    also across the k-th value, where the full sort has to take over)."""
    import random
    from sluice.engine.filtering import filter_flags as _flags, filter_logits, row_tensors as _row_tensors
    rng = random.Random(0)
    for trial in range(400):
        V, B = rng.choice([64, 1000, 8192]), rng.randint(1, 5)
        x = torch.randn(B, V, generator=torch.Generator().manual_seed(trial)) * rng.choice([0.1, 1, 5])
        if trial % 2:
            x = (x * 2).round() / 2
        params = [SamplingParams(temperature=0) if rng.random() < 0.2 else
                  SamplingParams(temperature=rng.choice([0.3, 1.0, 1.7]), top_k=rng.choice([1, 2, 5, 40, V // 5]),
                                 top_p=rng.choice([1.0, 0.9, 0.3]), min_p=rng.choice([0.0, 0.05])) for _ in range(B)]
        params = [p.with_defaults(None) for p in params]
        rows = _row_tensors(params, V, "cpu")
        got, want = filter_logits(x, rows, *_flags(params)), _filter_by_full_sort(x, rows, *_flags(params))
        sampled = ~rows["greedy"]
        assert torch.equal(got[sampled], want[sampled]), (trial, V, [(p.top_k, p.top_p, p.min_p) for p in params])


def test_a_top_k_race_over_the_candidates_equals_the_full_row_race():
    """With top_k on every sampled row (k <= V/4) the Sampler races only the sort's first k candidates
    (filtering.race). Its token must be the full-row formula's, bit for bit: argmax over the
    vocabulary of filtered(x) - log E, the filters from the full-sort reference (filter_logits with top_k
    too large for the prefix) and E the whole row's noise from the row's own seed. Tie-heavy logits included."""
    from sluice.engine.noise import RowStream, log_exp_noise, uniforms_range
    from sluice.engine.filtering import filter_flags as _flags, filter_logits, row_tensors as _row_tensors

    V, g = 2000, torch.Generator().manual_seed(5)
    settings = [dict(top_k=40, top_p=0.9), dict(top_k=7, min_p=0.2), dict(top_k=100, top_p=0.6, min_p=0.01),
                dict(top_k=1), dict(top_k=25)]
    for trial in range(60):
        scale = [0.5, 3.0, 8.0][trial % 3]
        logits = torch.randn(4, V, generator=g) * scale
        if trial % 2:
            logits = (logits * 2).round() / 2  # many exact ties, some across the k-th value
        params = [SamplingParams(temperature=[0.7, 1.0, 1.3][trial % 3], seed=trial * 10 + r,
                                 **settings[(trial + r) % len(settings)]) for r in range(3)]
        params.insert(trial % 4, SamplingParams(temperature=0))  # a greedy row among them
        got = Sampler(params, V)(logits)
        for r, p in enumerate(params):
            if p.temperature == 0:
                assert got[r] == logits[r].argmax()
                continue
            p = p.with_defaults(None)
            # The same row's filters through the full sort: a second row with top_k off forces it.
            both = [p, SamplingParams(**{**vars(p), "top_k": 0})]
            reference = filter_logits(logits[[r, r]], _row_tensors(both, V, "cpu"), *_flags(both))[:1]
            kept = filter_logits(logits[r:r + 1], _row_tensors([p], V, "cpu"), *_flags([p]))  # through the prefix
            assert torch.equal(kept, reference)
            log_e = log_exp_noise(uniforms_range([RowStream(p.seed)], 0, V))[0]  # the row's first draw
            assert got[r] == (reference[0] - log_e).argmax(), (trial, r, p)


def test_nonfinite_rows_matches_isfinite_all_for_nan_and_both_infinities():
    """nonfinite_rows (amax/amin, shared by every sampler and head) flags exactly the rows
    isfinite().all() rejects: a NaN, a +inf or a -inf anywhere, in any float dtype and any leading shape."""
    from sluice.engine.sampling import nonfinite_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 500, generator=g)
    for (i, j, k), bad in zip([(0, 0, 7), (1, 2, 499), (2, 1, 0), (4, 0, 250)],
                              [float("nan"), float("inf"), float("-inf"), float("nan")], strict=True):
        x[i, j, k] = bad
    x[5, 1, :] = float("-inf")  # a whole row masked out
    for t in (x, x.bfloat16(), x[:, 1]):
        assert torch.equal(nonfinite_rows(t), ~t.isfinite().all(-1))
    assert int(nonfinite_rows(x).sum()) == 5



def test_filtered_probs_without_tail_cuts_is_the_law_without_top_p_and_min_p():
    """What speculative decoding's draft proposes from: penalties, temperature and top_k as the row's
    params say, top_p and min_p left out, bit for bit what params without them give."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 300, generator=g) * 3
    seen = torch.rand(4, 300, generator=g) < 0.1
    rows = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.1, top_k=20, min_p=0.1),
            SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.5, repetition_penalty=1.3)]
    plain = [SamplingParams(temperature=p.temperature, top_k=p.top_k, repetition_penalty=p.repetition_penalty)
             for p in rows]
    got = filtered_probs(x, rows, seen, tail_cuts=False)
    assert torch.equal(got, filtered_probs(x, plain, seen))
    assert (got[0] > 0).sum() > (filtered_probs(x, rows, seen)[0] > 0).sum()  # the tail top_p cut is back
