"""A draft's round of guesses in one native call (proposers.DraftProposer._native_round, step.cpp's guess)
against the Python loop it replaces (_guess): at every round of a run, the same guesses, the same q bit
for bit, the same draft cache writes, the same random draws and draft_valid, on batches that mix greedy,
sampled and top_p rows and rows with fewer guesses than others; and the Python loop where the call cannot
take a round (a top_k row, a draft gone non-finite)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import sluice
from sluice import SamplingParams
from sluice.engine import proposers
from sluice.engine.sample import LANES

from avx2_build import run_avx2_build
from test_speculative import noisy_copy

pytestmark = pytest.mark.skipif(not LANES, reason="the native filters need torch's AVX2 or AVX-512 kernels")


@pytest.fixture(scope="module")
def noisy(tiny_dir, tmp_path_factory):
    return noisy_copy(tiny_dir, tmp_path_factory.mktemp("round") / "noisy", 0.15)


class Checked:
    """DraftProposer.propose run twice a round: as it ships (the native call where it can), then, from the
    same state, with the Python loop alone; every result of the two compared."""

    def __init__(self, monkeypatch):
        self.rounds = {True: 0, False: 0}  # rounds the native call took, and left to the loop
        self.native_round = proposers.DraftProposer._native_round
        self.propose = proposers.DraftProposer.propose
        checked = self

        def counting(proposer, rows, starts):
            took = checked.native_round(proposer, rows, starts)
            checked.rounds[took] += 1
            return took

        def propose(proposer, rows):
            before = [(r.seq.spec.draft_valid, r.seq.sampler.streams[0].draws) for r in rows]
            checked.propose(proposer, rows)
            first = checked.state(proposer, rows)
            for r, (valid, draws) in zip(rows, before, strict=True):
                r.seq.spec.draft_valid, r.seq.sampler.streams[0].draws = valid, draws
                r.guesses, r.q = [], None
            monkeypatch.setattr(proposers.DraftProposer, "_native_round", lambda *a: False)
            try:
                checked.propose(proposer, rows)
            finally:
                monkeypatch.setattr(proposers.DraftProposer, "_native_round", counting)
            second = checked.state(proposer, rows)
            for a, b in zip(first[:-1], second[:-1], strict=True):
                assert a[:3] == b[:3]  # guesses, draft_valid, draws
                assert (a[3] is None) == (b[3] is None) and (a[3] is None or torch.equal(a[3], b[3]))
            assert torch.equal(first[-1][0], second[-1][0]) and torch.equal(first[-1][1], second[-1][1])

        monkeypatch.setattr(proposers.DraftProposer, "_native_round", counting)
        monkeypatch.setattr(proposers.DraftProposer, "propose", propose)

    @staticmethod
    def state(proposer, rows):
        out = [(list(r.guesses), r.seq.spec.draft_valid, r.seq.sampler.streams[0].draws,
                None if r.q is None else r.q.clone()) for r in rows]
        return out + [(proposer.pool.k.clone(), proposer.pool.v.clone())]


def run(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


PROMPTS = ["def add(a, b):\n    return a + b\n", "Hello world! How are you", "The", "x = [1, 2, 3]\nfor i in x:"]


@pytest.mark.parametrize("k", [3, "auto"])
def test_native_round_equals_the_python_loop(tiny_dir, noisy, monkeypatch, k):
    """Mixed rows (greedy, sampled at two temperatures, one with top_p, which the draft leaves out) and
    different max_tokens, so rows near their end take fewer guesses than the others."""
    llm = sluice.LLM(str(tiny_dir), draft_model=str(noisy), num_speculative_tokens=k)
    params = [SamplingParams(temperature=0, max_tokens=29, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=1, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.3, top_p=0.8, seed=2, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=21, ignore_eos=True)]
    shipped = run(llm, PROMPTS, params)
    checked = Checked(monkeypatch)
    assert run(llm, PROMPTS, params) == shipped  # (the loop's second pass leaves the same state behind)
    assert checked.rounds[True] > 10 and checked.rounds[True] > 3 * checked.rounds[False]


def test_native_round_greedy_batch(tiny_dir, noisy, monkeypatch):
    """Every row plain greedy: no q kept, the guesses the draft's argmax."""
    llm = sluice.LLM(str(tiny_dir), draft_model=str(noisy), num_speculative_tokens=4)
    checked = Checked(monkeypatch)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 17, 25)]
    got = run(llm, PROMPTS[:3], params)
    assert checked.rounds[True] > 10
    assert got == run(sluice.LLM(str(tiny_dir)), PROMPTS[:3], params)  # lossless: plain decoding's tokens


def test_a_top_k_row_takes_the_python_loop(tiny_dir, noisy, monkeypatch):
    llm = sluice.LLM(str(tiny_dir), draft_model=str(noisy), num_speculative_tokens=3)
    checked = Checked(monkeypatch)
    run(llm, PROMPTS[:2], [SamplingParams(temperature=0.8, top_k=5, seed=4, max_tokens=20, ignore_eos=True),
                           SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)])
    assert checked.rounds[True] == 0 and checked.rounds[False] > 5


def test_a_non_finite_draft_defers_to_the_loop_and_stays_lossless(tiny_dir, tmp_path, monkeypatch):
    """A draft whose logits overflow: the native call defers every round (nothing kept from it), the loop
    cuts the guesses there, and the greedy row's output is plain decoding's."""
    bad = noisy_copy(tiny_dir, tmp_path / "inf", 0.0)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], 3e38)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    llm = sluice.LLM(str(tiny_dir), draft_model=str(bad), num_speculative_tokens=3)
    checked = Checked(monkeypatch)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=6, max_tokens=12, ignore_eos=True)]
    got = run(llm, PROMPTS[:2], params)
    assert checked.rounds[False] > 3 and checked.rounds[True] == 0
    assert got[0] == run(sluice.LLM(str(tiny_dir)), PROMPTS[:1], params[:1])[0]


@pytest.mark.slow
def test_the_avx2_build_takes_the_same_rounds():
    """The tests above against step.cpp and accept.cpp built as an AVX2-only CPU builds them (a subprocess,
    a few minutes to build)."""
    run_avx2_build("fast_step", __file__, "not avx2")
