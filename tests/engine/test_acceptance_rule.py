"""The speculative acceptance rule alone (engine/speculative.py accept / accept_greedy, engine/verify.py),
on small synthetic laws: fast enough for the inner loop. Exact cases need no statistics; the laws are
checked by chi-square over a few thousand rows, with fixed seeds (each row's RowStream), so a run is
deterministic and the 1e-3 threshold is a fixed, honest bar rather than a flaky one. The end-to-end
checks against a real model's joint law are test_speculative.py's (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from sluice import SamplingParams
from sluice.engine.noise import RowStream
from sluice.engine.sampling import Sampler
from sluice.engine.speculative import accept, accept_greedy
from sluice.engine.verify import stacks, verify


def streams(n: int, first_seed: int = 0) -> list[RowStream]:
    return [RowStream(first_seed + i) for i in range(n)]


def follows(tokens: torch.Tensor, law: torch.Tensor) -> None:
    """tokens are draws from `law` (V,): none where it is 0, and a chi-square p-value over 1e-3."""
    counts = torch.bincount(tokens, minlength=law.numel()).float()
    keep = law > 0
    assert counts[~keep].sum() == 0, f"draws where the law is 0: {counts.tolist()}"
    assert chisquare(counts[keep], law[keep] / law[keep].sum() * counts.sum()).pvalue > 1e-3, counts.tolist()


@pytest.mark.parametrize("proposer", ["lookup", "rule"])
def test_accept_alone_against_the_formula(proposer):
    """One guess per row, 20000 rows: the emitted token follows p, guesses are kept with probability
    sum_x min(p(x), q(x)), and after a rejection the token follows norm(max(0, p - q))."""
    N, V = 20000, 6
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])
    q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
    gens = [RowStream(i) for i in range(N)]
    g = torch.Generator().manual_seed(1234)
    x = torch.multinomial(q, N, replacement=True, generator=g)[:, None]  # (N, 1) guesses drawn from q
    if proposer == "lookup":
        x = torch.full((N, 1), 2)  # a point mass: q = onehot(2)
        q = torch.nn.functional.one_hot(torch.tensor(2), V).float()
    P = p.expand(N, 2, V)
    n, final = accept(P, None if proposer == "lookup" else q.expand(N, 1, V), x, [1] * N, list(range(N)), gens)
    first = torch.where(n == 1, x[:, 0], final)
    counts = torch.bincount(first, minlength=V).float()
    keep = p > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep], p[keep] * N).pvalue > 1e-3
    rate = torch.minimum(p, q).sum().item()
    assert abs(n.float().mean().item() - rate) < 4 * (rate * (1 - rate) / N) ** 0.5
    residual = (p - q).clamp_min(0)
    residual /= residual.sum()
    rej = torch.bincount(final[n == 0], minlength=V).float()
    keep = residual > 0
    assert rej[~keep].sum() == 0
    assert chisquare(rej[keep], residual[keep] * rej.sum()).pvalue > 1e-3


def test_every_emitted_position_follows_its_own_target_law():
    """Three guesses a row from a q unlike p, a different p and q at each position: the emitted token at
    position j (reached when the j guesses before it were kept) follows p_j, whatever was kept before;
    the bonus token after three kept guesses follows p_3."""
    N, V, K = 6000, 5, 3
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)
    p[1, 4] = 0.0  # a token the target never takes at position 1
    p[1] /= p[1].sum()
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    draft = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)  # (N, K)
    n, final = accept(p.expand(N, K + 1, V), q.expand(N, K, V), draft, [K] * N, list(range(N)), streams(N))
    emitted = torch.where(torch.arange(K + 1) < n[:, None], torch.cat([draft, draft[:, :1]], 1), final[:, None])
    for j in range(K + 1):
        reached = n >= j
        follows(emitted[reached, j], p[j])
    rate = torch.minimum(p[0], q[0]).sum().item()  # P(the first guess is kept)
    assert abs((n >= 1).float().mean().item() - rate) < 4 * (rate * (1 - rate) / N) ** 0.5


def test_exact_cases():
    """No statistics: p == q keeps every guess a row proposed, and no more; a point-mass guess the target
    gives probability 0 is never kept and never drawn; greedy rows (not listed as sampled) keep a guess
    iff it is the argmax, the same as accept_greedy."""
    V, K = 6, 3
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, K + 1, V, generator=g), -1)
    draft = torch.randint(0, V, (4, K), generator=g)
    n, _ = accept(p, p[:, :K], draft, [3, 1, 0, 2], [0, 1, 2, 3], streams(4))
    assert n.tolist() == [3, 1, 0, 2]
    zero = p.clone()
    zero[:, 0, 2] = 0.0
    for seed in range(20):
        n, final = accept(zero, None, torch.full((4, K), 2), [K] * 4, [0, 1, 2, 3], streams(4, 10 * seed))
        assert n.tolist() == [0] * 4 and 2 not in final.tolist()
    onehot = torch.nn.functional.one_hot(p.argmax(-1), V).float()  # what a greedy row's p is
    best = p.argmax(-1)  # (4, K+1)
    draft = best[:, :K].clone()
    draft[0, 1] = (draft[0, 1] + 1) % V  # row 0 misses its second guess
    draft[2, 0] = (draft[2, 0] + 1) % V  # row 2 its first
    n, final = accept(onehot, None, draft, [K] * 4, [], streams(4))
    assert n.tolist() == [1, 3, 0, 3]
    assert final.tolist() == best.gather(1, n[:, None])[:, 0].tolist()
    assert [t.tolist() for t in accept_greedy(best, draft, [K] * 4)] == [n.tolist(), final.tolist()]
    n, _ = accept_greedy(best, best[:, :K], [2, 0, 3, 1])  # never past a row's own guesses
    assert n.tolist() == [2, 0, 3, 1]


def test_a_rows_outcome_is_its_own_and_repeats_with_its_seed():
    """Each row draws from its own stream: alone or in a batch, and run again with the same seeds, it
    keeps the same guesses and draws the same token."""
    N, V, K = 6, 7, 2
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(N, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(N, K, V, generator=g), -1)
    draft = torch.randint(0, V, (N, K), generator=g)
    together = accept(p, q, draft, [K] * N, list(range(N)), streams(N, 100))
    again = accept(p, q, draft, [K] * N, list(range(N)), streams(N, 100))
    alone = [accept(p[i:i + 1], q[i:i + 1], draft[i:i + 1], [K], [0], [RowStream(100 + i)]) for i in range(N)]
    assert [t.tolist() for t in together] == [t.tolist() for t in again]
    assert together[0].tolist() == [a[0].item() for a in alone] and together[1].tolist() == [a[1].item() for a in alone]


def _row(params: SamplingParams, guesses: list[int], V: int, prompt=()):
    sampler = Sampler([params], V)
    sampler.add_context(0, list(prompt))
    return SimpleNamespace(seq=SimpleNamespace(sampler=sampler), guesses=guesses, q=None)


def test_verify_penalises_each_position_by_the_guesses_before_it():
    """verify() with a strong repetition penalty on a greedy row: every position's logits favour the
    row's own first guess, so once that guess is kept it is penalised and the next position's argmax
    moves: the run is [guess, second best], where a verify blind to earlier guesses keeps both."""
    V = 6
    logits = torch.tensor([[0.0, 4.0, 3.0, 0.0, 0.0, 0.0]] * 3)  # argmax 1 everywhere, 2 next
    row = _row(SamplingParams(temperature=0, repetition_penalty=10.0), [1, 1], V)
    assert verify([row], [logits]) == [[1, 2]]
    plain = _row(SamplingParams(temperature=0), [1, 1], V)  # no penalty: both kept, then the bonus
    assert verify([plain], [logits]) == [[1, 1, 1]]


def test_penalty_sees_every_earlier_guess():
    """The penalties' context grows inside a round: after guesses x1..xi, both p and q count x1..xi as
    seen (repetition penalty) and as generated (presence / frequency; the chi-square above has too
    little power to see this alone)."""
    seen = torch.zeros(1, 16, dtype=torch.bool)
    seen[0, 1] = True
    counts = torch.zeros(1, 16)
    counts[0, 5] = 2
    seen_at, counts_at = stacks(seen, counts, torch.tensor([[4, 5, 4]]))
    assert [torch.nonzero(seen_at[0, i])[:, 0].tolist() for i in range(4)] == [[1], [1, 4], [1, 4, 5], [1, 4, 5]]
    assert [counts_at[0, i, [4, 5]].tolist() for i in range(4)] == [[0, 2], [1, 2], [1, 3], [2, 3]]


@pytest.mark.parametrize("native", [True, False])
def test_staged_verify_decides_what_the_full_one_decides(monkeypatch, native):
    """verify() with top_p / min_p filters only the positions the rule reads (verify.staged_probs: it stops
    at a row's first rejection). Over random rounds whose guesses are often kept (q near p), with mixed
    greedy and sampled rows, penalties and uneven guess counts: the same runs and the same streams as
    verify() filtering every position, on the native rule and on the torch one."""
    import random

    from sluice.engine import accept as accept_kernel
    from sluice.engine.spec_probs import RoundProbs
    if not native:
        monkeypatch.setattr(accept_kernel, "kernel", lambda: None)
    rng, gen, V = random.Random(0), torch.Generator().manual_seed(0), 40
    kinds = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_p=0.7, min_p=0.05),
             dict(temperature=0.9, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5), dict(temperature=0)]
    kept = 0
    for t in range(150):
        B, K = rng.randint(1, 4), rng.randint(1, 5)
        shapes = [(rng.choice(kinds[:3] if b == 0 else kinds), rng.randint(1, K)) for b in range(B)]
        logits = [torch.randn(n + 1, V, generator=gen) * 3 for _, n in shapes]
        qs = [torch.softmax(lg[:-1] + 0.3 * torch.randn(lg.shape[0] - 1, V, generator=gen), -1) for lg in logits]
        guesses = [torch.multinomial(q, 1, generator=gen)[:, 0].tolist() for q in qs]

        def batch(seed=1000 * t):
            return [SimpleNamespace(seq=SimpleNamespace(sampler=Sampler([SamplingParams(seed=seed + b, **kw)], V)),
                                    guesses=g, q=q) for b, ((kw, _), g, q) in enumerate(zip(shapes, guesses, qs))]

        staged, full = batch(), batch()
        a = verify(staged, logits, RoundProbs())
        with monkeypatch.context() as m:
            m.setattr(RoundProbs, "sorts", staticmethod(lambda samplers: False))
            b = verify(full, logits, RoundProbs())
        assert a == b
        assert [r.seq.sampler.streams[0].draws for r in staged] == [r.seq.sampler.streams[0].draws for r in full]
        kept += sum(len(run) - 1 for run in a)
    assert kept > 300  # rounds that keep guesses, where a stage too few or too many would show


def same_on_both_rules(monkeypatch, batch, logits, t) -> list[list[int]]:
    """verify() on two copies of batch(), on the native rule and on the torch one: the same runs, and every
    row's stream advanced alike. Returns the runs."""
    from sluice.engine import accept as accept_kernel
    from sluice.engine.spec_probs import RoundProbs
    native, torch_path = batch(), batch()
    a = verify(native, logits, RoundProbs())
    with monkeypatch.context() as m:
        m.setattr(accept_kernel, "kernel", lambda: None)
        b = verify(torch_path, logits, RoundProbs())
    assert a == b, t
    assert [r.seq.sampler.streams[0].draws for r in native] == [r.seq.sampler.streams[0].draws for r in torch_path]
    return a


def test_native_round_decides_what_the_torch_round_decides(monkeypatch):
    """verify() on rows of temperature and top_p alone (and greedy rows) takes accept.accept on its logits: the
    rule with each p it reads filtered natively. Over random rounds whose guesses are often kept, uneven
    guess counts, a point-mass proposer as well as a draft: the same runs and the same streams as the torch
    path (RoundProbs' torch filters, speculative.accept's tensor rule)."""
    import random

    from sluice.engine import accept as accept_kernel
    if accept_kernel.kernel() is None or not accept_kernel.LANES:
        pytest.skip("the native acceptance kernel is not built")
    rng, gen, V = random.Random(1), torch.Generator().manual_seed(1), 300
    kinds = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, top_p=0.6), dict(temperature=0.7, top_p=1.0),
             dict(temperature=0)]
    kept, calls = 0, accept_kernel.STATS["calls"]
    for t in range(150):
        B, K = rng.randint(1, 3), rng.randint(1, 5)
        shapes = [(rng.choice(kinds[:3] if b == 0 else kinds), rng.randint(1, K)) for b in range(B)]
        logits = [torch.randn(n + 1, V, generator=gen) * 3 for _, n in shapes]
        point = t % 3 == 0  # prompt lookup's guesses: no q
        qs = [torch.softmax(lg[:-1] + 0.3 * torch.randn(lg.shape[0] - 1, V, generator=gen), -1) for lg in logits]
        guesses = [torch.multinomial(q, 1, generator=gen)[:, 0].tolist() for q in qs]

        def batch(seed=1000 * t):
            return [SimpleNamespace(seq=SimpleNamespace(sampler=Sampler([SamplingParams(seed=seed + b, **kw)], V)),
                                    guesses=g, q=None if point else q)
                    for b, ((kw, _), g, q) in enumerate(zip(shapes, guesses, qs))]

        a = same_on_both_rules(monkeypatch, batch, logits, t)
        kept += sum(len(run) - 1 for run in a)
    assert kept > 150
    assert accept_kernel.STATS["calls"] - calls >= 150  # every round took the native rule


@pytest.mark.parametrize("above", [False, True])
def test_native_round_with_a_cut_proven_to_within_a_token(monkeypatch, above):
    """64 equal logits and top_p 0.5 (torch keeps 32 tokens: the mass before the 33rd is 0.5, not below it) or
    one ulp above (torch keeps 33): the native rule's bounded cut cannot tell which, so it takes each guess's
    decision and the final draw under both cuts, and cuts exactly (the sort) where they differ. Guesses on the
    uncertain token (id 32), on kept ones and on cut ones: the same runs and streams as the torch path, and
    both ways were taken."""
    import random

    from sluice.engine import accept as accept_kernel
    if accept_kernel.kernel() is None or not accept_kernel.LANES:
        pytest.skip("the native acceptance kernel is not built")
    rng, gen, V = random.Random(2), torch.Generator().manual_seed(2), 64
    top_p = float(torch.nextafter(torch.tensor(0.5), torch.tensor(1.0))) if above else 0.5
    before = accept_kernel.top_p_rows()
    for t in range(120):
        K = 1 + t % 3
        logits = [torch.zeros(K + 1, V)]
        q = torch.softmax(torch.randn(K, V, generator=gen), -1)
        guesses = [[32 if (t + j) % 3 == 0 else rng.randrange(40) for j in range(K)]]

        def batch(seed=1000 * t):
            return [SimpleNamespace(seq=SimpleNamespace(sampler=Sampler([SamplingParams(seed=seed, temperature=1.0,
                                                                                         top_p=top_p)], V)),
                                    guesses=guesses[0], q=q)]

        same_on_both_rules(monkeypatch, batch, logits, t)
    bounded, sorted_, moving = (x - y for x, y in zip(accept_kernel.top_p_rows(), before, strict=True))
    assert moving >= 120 and sorted_ >= 10 and bounded == 0, (bounded, sorted_, moving)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_native_round_ends_a_run_at_a_nonfinite_position(monkeypatch, bad):
    """A sampled top_p row whose logits turn non-finite at its second position, after a first guess it keeps
    (q = p: kept whatever u), and a greedy row beside it: the native call defers, and verify() ends that run
    with NONFINITE where the torch path does, the other row decided as before."""
    from sluice.engine import accept as accept_kernel
    from sluice.engine.sampling import NONFINITE
    from sluice.engine.sampling import filtered_probs
    if accept_kernel.kernel() is None or not accept_kernel.LANES:
        pytest.skip("the native acceptance kernel is not built")
    gen, V = torch.Generator().manual_seed(3), 50
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    logits = [torch.randn(3, V, generator=gen) * 3, torch.randn(2, V, generator=gen)]
    q0 = filtered_probs(logits[0][:2], params)
    guess = int(q0[0].argmax())
    logits[0][1, 7] = bad
    greedy_guess = int(logits[1][0].argmax())

    def batch():
        return [SimpleNamespace(seq=SimpleNamespace(sampler=Sampler([params], V)), guesses=[guess, 3], q=q0),
                SimpleNamespace(seq=SimpleNamespace(sampler=Sampler([SamplingParams(temperature=0)], V)),
                                guesses=[greedy_guess], q=torch.nn.functional.one_hot(torch.tensor([greedy_guess]),
                                                                                    V).float())]
    fallback = accept_kernel.STATS["fallback"]
    runs = same_on_both_rules(monkeypatch, batch, logits, bad)
    assert runs[0] == [guess, NONFINITE]
    assert runs[1] == [greedy_guess, int(logits[1][1].argmax())]
    assert accept_kernel.STATS["fallback"] > fallback
