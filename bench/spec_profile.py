"""Where a speculative round's time goes on the bundled model (batch 1, a prompt set of
bench/speculative.py: --set code, the default, or edit), against plain decoding's per-token cost: the scheduler's step split into the
target forward, the draft's round in one native call (its forwards, probabilities and draws: step.cpp's
guess), the draft's forwards, probabilities and draws where the Python loop runs them, the verify (acceptance
and the target's probabilities), and the rest (planning, output, Python glue), each in ms per step and per
generated token. Timers wrap the engine's own objects, so the split costs a few microseconds a call.

    bash /work/.prof/quiet.sh .venv/bin/python bench/spec_profile.py --json /tmp/spec-profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from speculative import SEED, SETS, TEMPS  # noqa: E402

import torch  # noqa: E402

from sluice import LLM, SamplingParams  # noqa: E402
from sluice.benchmarks.common import environment, provenance  # noqa: E402
from sluice.engine import proposers as proposers_mod  # noqa: E402
from sluice.engine.fast_step import FastStep  # noqa: E402


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, attr: str, name: str):
        inner = getattr(owner, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        if isinstance(inner, (types.FunctionType, types.MethodType)):
            setattr(owner, attr, timed)
        else:  # a callable object (BatchForward, RoundProbs): time its calls, keep it the same object
            inner.__class__ = type(type(inner).__name__, (type(inner),), {"__call__": lambda _, *a, **kw: timed(*a, **kw)})
            inner_call = type(inner).__mro__[1].__call__
            inner = lambda *a, **kw: inner_call(getattr(owner, attr), *a, **kw)  # noqa: E731


def profile(llm: LLM, k, temp: float, new: int, reps: int, prompts: list[str]) -> dict:
    sched = llm.batch_engine().scheduler
    timer = Timer()
    guess = FastStep.guess
    timer.wrap(sched, "step", "step")
    timer.wrap(sched, "forward", "target_forward")
    timer.wrap(sched, "draw", "verify_or_sample")
    if sched.speculation is not None:
        sched.speculation.set_k(k)
        prop = sched.speculation.proposer
        timer.wrap(prop, "propose", "draft_total")
        timer.wrap(prop.forward, "feed", "draft_forwards")
        inner_prefill = prop.prefill

        def prefill(rows):  # the prompt's feeds: counted as draft_prefill, not as a round's draft_forwards
            before, t = timer.seconds.get("draft_forwards", 0.0), time.perf_counter()
            try:
                return inner_prefill(rows)
            finally:
                timer.seconds["draft_prefill"] = timer.seconds.get("draft_prefill", 0.0) + time.perf_counter() - t
                timer.seconds["draft_forwards"] = before
        prop.prefill = prefill
        timer.wrap(prop, "probs", "draft_probs")
        timer.wrap(proposers_mod, "draw", "draft_draws")
        timer.wrap(proposers_mod.accept_kernel, "propose", "draft_probs")  # q and its draw in one call
        timer.wrap(proposers_mod.accept_kernel, "accept_rows", "verify_rule")  # inside verify_or_sample
        timer.wrap(FastStep, "guess", "draft_round")  # the usual round's forwards, q and draws in one call
    tokens = steps = 0
    for rep in range(reps + 1):
        if rep == 1:  # the first round warms up
            timer.seconds.clear()
            tokens = steps = 0
        for i, p in enumerate(prompts):
            s0 = sched.steps
            out = llm.generate([p], SamplingParams(max_tokens=new, temperature=temp, seed=SEED + i, ignore_eos=True))
            tokens += len(out[0].token_ids) - 1
            steps += sched.steps - s0 - 1  # the prefill step made the first token
    if sched.speculation is not None:
        FastStep.guess = guess  # the class's own method again (the next profile wraps it anew)
    ms = {name: 1e3 * s for name, s in timer.seconds.items()}
    spec = sched.speculation is not None
    parts = {"target_forward": ms["target_forward"], "verify_or_sample": ms["verify_or_sample"]}
    if spec:
        parts["draft_prefill"] = ms.get("draft_prefill", 0.0)
        parts["draft_forwards"] = ms.get("draft_forwards", 0.0)  # the Python loop's (the native round has its own)
        parts["draft_probs"] = ms.get("draft_probs", 0.0)
        parts["draft_draws"] = ms.get("draft_draws", 0.0)
        parts["draft_round"] = ms.get("draft_round", 0.0)
        parts["draft_glue"] = (ms["draft_total"] - parts["draft_forwards"] - parts["draft_probs"] - parts["draft_draws"]
                               - parts["draft_round"])
    parts["other"] = ms["step"] - sum(parts.values())
    if spec:  # a part of verify_or_sample, not added to the total
        parts["verify_rule"] = ms.get("verify_rule", 0.0)
    # the step timer includes prefill steps; those are small against 128 decode steps a prompt
    return {"temperature": temp, "k": k if spec else None, "steps": steps, "tokens": tokens,
            "tokens_per_step": tokens / steps,
            "ms_per_step": {n: v / steps for n, v in parts.items()},
            "ms_per_token": {n: v / tokens for n, v in parts.items()},
            "total_ms_per_token": ms["step"] / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new", type=int, default=None, help="tokens a prompt (default: the set's, as bench/speculative.py)")
    ap.add_argument("--set", default="code", choices=sorted(SETS), help="bench/speculative.py's prompt set")
    ap.add_argument("--temps", default="sampled,greedy", help=f"comma list of {','.join(TEMPS)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    plain, spec = LLM(dtype="float32"), LLM(dtype="float32", draft_model="bundled")
    prompts, new = SETS[args.set]
    new = args.new or new
    runs = []
    for temp in (TEMPS[t] for t in args.temps.split(",")):
        runs.append({"config": "plain", "set": args.set, **profile(plain, None, temp, new, args.reps, prompts)})
        for k in (2, "auto"):
            runs.append({"config": f"draft k={k}", "set": args.set, **profile(spec, k, temp, new, args.reps, prompts)})
    for r in runs:
        parts = "  ".join(f"{n} {v:.3f}" for n, v in r["ms_per_step"].items())
        print(f"T={r['temperature']} {r['config']:<13} {r['tokens_per_step']:.2f} tok/step  "
              f"{r['total_ms_per_token']:.3f} ms/tok | per step: {parts}")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "spec_profile", **environment(), "runs": runs, **provenance()},
                                              indent=1))


if __name__ == "__main__":
    main()
