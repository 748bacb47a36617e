"""Issue 28's speed check: the engine before and after speculative decoding, the fused head and compile
moved onto the continuous-batching scheduler, timed side by side in one run.

    flock /tmp/sluice-bench.lock .venv/bin/python bench/compose_speed.py --before /path/to/old/src \\
        --json docs/results/compose-speed.json

--before names the src/ directory of the old checkout (e.g. a `git worktree` of the commit before).
Each row runs in a fresh child process per side (PYTHONPATH picks the side's code; kernels build into
their own cache directories), one warm-up request and then --timed timed ones (the process reports
their median), alternating which side goes first from round to round; a cell is the median of the
rounds' decode tok/s (LLM.last_stats: decode tokens / decode seconds, as each side measures its own). Greedy, so both sides must emit the same
tokens: a row whose outputs differ is marked.

Rows: plain decoding on the bundled model and a random Qwen3-0.6B-shaped checkpoint, fp32 and bf16
weights, batch 1 and 8; speculative decoding on the bundled model with its shipped draft and with
prompt lookup, k=2 and auto, on code prompts and an edit prompt at batch 1 (the old engine ran
speculation on its one-request path) and at batch 8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, save_json  # noqa: E402
from decode_speed import FULL, build_checkpoint  # noqa: E402
from speculative import CODE_PROMPTS, EDIT_PROMPT  # noqa: E402

WORKER = r"""
import json, sys, time
from sluice import LLM, SamplingParams
row = json.loads(sys.argv[1])
kw = dict(dtype=row["dtype"])
if row["spec"] == "draft":
    kw.update(draft_model="bundled", num_speculative_tokens=row["k"])
elif row["spec"] == "prompt-lookup":
    kw.update(speculative="prompt-lookup", num_speculative_tokens=row["k"])
llm = LLM(row["model"], **kw)
p = SamplingParams(max_tokens=row["gen"], temperature=0, ignore_eos=True)
prompts = row["prompts"]
llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up: kernels, caches
speeds = []
for _ in range(row["timed"]):
    outs = llm.generate(prompts, p)
    s = llm.last_stats
    speeds.append(s.decode_tok_s)
print(json.dumps({"decode_tok_s": sorted(speeds)[len(speeds) // 2], "tokens": [o.token_ids for o in outs],
                  "accepted": s.accepted, "proposed": s.proposed}))
"""


def rows(q06: str, quick: bool) -> list[dict]:
    code8 = (CODE_PROMPTS * 2)[:8]
    out = []
    for model, gen in ((None, 64), (q06, 16 if quick else 32)):
        for dtype in ("float32", "bfloat16"):
            for b in (1, 8):
                out.append(dict(name=f"{'bundled' if model is None else 'q06'} {dtype} b{b}", model=model,
                                dtype=dtype, spec="off", k=None, gen=gen, prompts=code8[:b]))
    for task, prompts, gen in (("code", CODE_PROMPTS[:1], 128), ("edit", [EDIT_PROMPT], 256), ("code", code8, 128)):
        b = len(prompts)
        for spec, k in (("off", None), ("draft", 2), ("draft", "auto"), ("prompt-lookup", 2), ("prompt-lookup", "auto")):
            if spec == "prompt-lookup" and task == "code" and b == 8:
                continue
            name = f"bundled {task} b{b} " + ("plain" if spec == "off" else f"{spec} k={k}")
            out.append(dict(name=name, model=None, dtype="float32", spec=spec, k=k, gen=gen, prompts=prompts))
    return out


def run(side: str, src: str, row: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=src, TORCH_EXTENSIONS_DIR=f"/work/.ext/bench-{side}", SLUICE_KERNEL_BUILD="wait")
    r = subprocess.run([sys.executable, "-c", WORKER, json.dumps(row)], capture_output=True, text=True, env=env,
                       timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{side} {row['name']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="src/ of the old checkout")
    ap.add_argument("--after", default=str(Path(__file__).parents[1] / "src"))
    ap.add_argument("--reps", type=int, default=2, help="processes per side and row")
    ap.add_argument("--timed", type=int, default=3, help="timed generates per process (their median counts)")
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "sluice-bench"))
    ap.add_argument("--quick", action="store_true", help="fewer tokens on the 0.6B shape")
    ap.add_argument("--only", default=None, help="rows whose name contains this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for side in ("before", "after"):  # a missing tree would silently import the installed sluice instead
        if not (Path(getattr(args, side)) / "sluice" / "__init__.py").is_file():
            ap.error(f"--{side} {getattr(args, side)} is not a src/ directory holding sluice/")
    q06 = str(build_checkpoint(Path(args.workdir), FULL, "qwen3-0.6b-shape"))
    env = environment()
    results = []
    for row in rows(q06, args.quick):
        if args.only and args.only not in row["name"]:
            continue
        row["timed"] = args.timed
        got = {"before": [], "after": []}
        for rep in range(args.reps):
            for side in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                got[side].append(run(side, args.before if side == "before" else args.after, row))
        cell = {side: statistics.median(g["decode_tok_s"] for g in got[side]) for side in got}
        same = got["before"][0]["tokens"] == got["after"][0]["tokens"]
        acc = got["after"][0]
        res = dict(name=row["name"], before_tok_s=round(cell["before"], 1), after_tok_s=round(cell["after"], 1),
                   ratio=round(cell["after"] / cell["before"], 3), same_tokens=same,
                   acceptance=round(acc["accepted"] / acc["proposed"], 3) if acc["proposed"] else None)
        results.append(res)
        print(f"{res['name']:<40} before {res['before_tok_s']:>8} after {res['after_tok_s']:>8} "
              f"x{res['ratio']:<6} same={same} acc={res['acceptance']}", flush=True)
    env["loadavg_at_end"] = list(os.getloadavg())
    if args.json:
        save_json(Path(args.json), {"environment": env, "before": args.before, "rows": results})


if __name__ == "__main__":
    main()
