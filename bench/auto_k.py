"""How num_speculative_tokens="auto" chooses k, checked on the bundled model and its draft (bench/speculative.py's
prompt sets): an exact replay of greedy speculation under any k rule, and the per-position keep rates of
sampled speculation.

    .venv/bin/python bench/auto_k.py --json docs/results/auto-k-zen5.json

Greedy (exact, no timing): a greedy round keeps the draft's guesses while they equal the target's argmax, and
the draft guesses from the true text while its guesses are kept. So one teacher-forced draft forward over the
prompt and plain decoding's output gives, at every position, how many guesses in a row would be kept there
(the run), and any rule's rounds follow: a round at position i with k guesses keeps min(run_i, k) and moves
past them and one more token. Tokens per round and mean k are exact (they equal what the engine does: compare
bench/speculative.py's tokens per forward). "model speedup" prices a round at 1 + ROUND + GUESS k plain steps
(speculative.py's AUTO_ROUND_COST and AUTO_GUESS_COST, the sampled rows' prices); it is a model, not a timing.

Sampled (T = 0.8, the engine itself at a fixed k, 4 by default): each round's kept count says which guess
positions were checked (up to the first rejection) and which were kept, so P(guess j kept | the guesses before
it kept) is counted per position j over every round (Speculation.adapt is wrapped to see each round).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from speculative import SEED, SETS  # noqa: E402

from sluice import LLM, SamplingParams  # noqa: E402
from sluice.benchmarks.common import environment, provenance  # noqa: E402
from sluice.engine.sequence import SpecState  # noqa: E402
from sluice.engine.speculative import AUTO_GUESS_COST, AUTO_MAX_TOKENS, AUTO_ROUND_COST  # noqa: E402
from sluice.engine.verify import Speculation  # noqa: E402


def greedy_runs(llm: LLM, prompts: list[str], new: int) -> list[list[int]]:
    """Per prompt: run[j] for each generated position j, how many guesses in a row from there the target keeps."""
    out = []
    for i, p in enumerate(prompts):
        o = llm.generate([p], SamplingParams(max_tokens=new, temperature=0, seed=SEED + i, ignore_eos=True))[0]
        seq = list(o.prompt_token_ids) + list(o.token_ids)
        with torch.inference_mode():
            pred = llm.draft_model(torch.tensor([seq]))[0].argmax(-1).tolist()  # pred[t]: its guess for seq[t + 1]
        P = len(o.prompt_token_ids)
        match = [pred[P + j - 1] == seq[P + j] for j in range(len(o.token_ids))]
        run = [0] * (len(match) + 1)
        for j in range(len(match) - 1, -1, -1):
            run[j] = run[j + 1] + 1 if match[j] else 0
        out.append(run)
    return out


def replay(runs: list[list[int]], rule, round_cost: float, guess_cost: float) -> dict:
    """A rule's rounds over the greedy runs: rule is an int (a fixed k) or an adapt(state, kept, rejected)."""
    tokens = rounds = ks = cost = 0
    for run in runs:
        state, j, n = SpecState(4, True), 1, len(run) - 1  # token 0 comes from the prefill
        while j < n:
            k = rule if isinstance(rule, int) else state.k
            kept = min(run[j], k, n - j - 1)  # (the last token of the output ends the request)
            tokens, rounds, ks = tokens + kept + 1, rounds + 1, ks + k
            cost += 1 + round_cost + guess_cost * k
            if not isinstance(rule, int):
                rule(state, kept, kept < k)
            j += kept + 1
    return {"tokens_per_round": tokens / rounds, "mean_k": ks / rounds, "model_speedup": tokens / cost}


def sampled_rates(llm: LLM, prompts: list[str], new: int, k: int) -> dict:
    """Per guess position: rounds that checked it and rounds that kept it, at a fixed k, T = 0.8."""
    checked, kept_at = [0] * k, [0] * k
    inner = Speculation.adapt

    def spy(state, kept, rejected, *a, **kw):
        for j in range(kept + int(rejected)):
            checked[j] += 1
            kept_at[j] += j < kept
        return inner(state, kept, rejected, *a, **kw)
    Speculation.adapt = staticmethod(spy)
    try:
        llm.batch_engine().scheduler.speculation.set_k(k)
        for i, p in enumerate(prompts):
            llm.generate([p], SamplingParams(max_tokens=new, temperature=0.8, seed=SEED + i, ignore_eos=True))
    finally:
        Speculation.adapt = staticmethod(inner)
    return {"k": k, "checked": checked, "kept": kept_at,
            "rate": [round(b / a, 4) if a else None for a, b in zip(checked, kept_at, strict=True)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sampled-k", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(dtype="float32", draft_model="bundled")
    result = {"benchmark": "auto_k", **environment(), "round_cost": AUTO_ROUND_COST, "guess_cost": AUTO_GUESS_COST,
              "greedy": {}, "sampled": {}}
    rules = [(f"k={k}", k) for k in range(1, AUTO_MAX_TOKENS + 1)] + [
        ("auto (greedy rule)", lambda s, kept, rej: Speculation.adapt(s, kept, rej, sampled=False)),
        ("auto (sampled rule)", lambda s, kept, rej: Speculation.adapt(s, kept, rej, sampled=True))]
    for name, (prompts, new) in SETS.items():
        runs = greedy_runs(llm, prompts, new)
        result["greedy"][name] = {rule_name: replay(runs, rule, AUTO_ROUND_COST, AUTO_GUESS_COST)
                                  for rule_name, rule in rules}
        for rule_name, r in result["greedy"][name].items():
            print(f"greedy {name:5s} {rule_name:20s} tokens/round {r['tokens_per_round']:.2f}  mean k "
                  f"{r['mean_k']:.2f}  model speedup {r['model_speedup']:.2f}")
        result["sampled"][name] = sampled_rates(llm, prompts, new, a.sampled_k)
        print(f"sampled {name:5s} k={a.sampled_k} keep rate per position {result['sampled'][name]['rate']}")
    if a.json:
        Path(a.json).write_text(json.dumps({**result, **provenance()}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
