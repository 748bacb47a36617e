"""`sluice inspect` at scale: one long prompt through the whole observatory on a real-sized model, timed,
its peak memory read, and its research numbers kept for the docs.

    python bench/random_checkpoint.py qwen3-0.6b --dtype bfloat16 --out /tmp/q06
    sluice lens train --model /tmp/q06 --tokens 4096 --steps 40 --batch 64 --out /tmp/q06-lens
    python bench/inspect_scale.py --model /tmp/q06 --tuned-lens /tmp/q06-lens --tokens 512 \
        --report runs/inspect-q06 --json docs/results/inspect-q06-512.json

The prompt is the first --tokens tokens of the bundled model's held-out corpus files (Python standard
library source that the tuned lens was not fitted on). What is timed is `observatory.analysis.inspect`,
the function `sluice inspect` runs (cost estimate, forward with every probe, logit and tuned lens,
softmax safety in three dtypes, attention valves, attribution), plus writing the HTML report; the
model load is timed apart. Peak memory is the process's maximum resident set (getrusage), model
included. The run is watched for other work (observatory/disturbance.py): a disturbed run is marked.

Kept from the result: the tuned and logit lens KL per layer, the growth verdict and fit, the branches
that grow the residual most, the heads with the most sink mass beside the largest massive activation
of the stream they read, and the report's figures copied to --figures (for docs/img).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import time
from pathlib import Path

import torch
from common import cpu_info, save_json

from sluice.benchmarks.common import code_version
from sluice.model import load
from sluice.observatory.analysis import inspect
from sluice.observatory.disturbance import LoadWatch
from sluice.observatory.internals_tables import largest_massive
from sluice.observatory.report import save
from sluice.observatory.tuned_lens import load as load_tuned
from sluice.text.tokenizer import Tokenizer


def corpus_prompt(tokenizer: Tokenizer, tokens: int) -> str:
    """The first `tokens` tokens of the bundled corpus's held-out files, in the corpus's own order, as text that
    encodes back to exactly that many tokens (checked: a byte-level BPE may merge across the cut)."""
    from sluice.model.loading import bundled_model_dir
    from sluice.training.corpus import load_corpus
    from sluice.training.recipe import Recipe
    corpus = load_corpus(Recipe.load(bundled_model_dir() / "recipe.toml").corpus)
    text = ""
    for path in corpus.heldout:  # held-out files: text the tuned lens was not fitted on
        text += corpus.read(path) + "\n"
        if len(text) > tokens * 8:
            break
    ids = tokenizer.encode(text[: tokens * 8], add_special_tokens=False)[:tokens]
    prompt = tokenizer.decode(ids)
    while len(tokenizer.encode(prompt)) > tokens:  # merges across the cut: drop a token and retry
        ids = ids[:-1]
        prompt = tokenizer.decode(ids)
    return prompt


def summarise(data: dict) -> dict:
    """The numbers the docs and the issue ask for, out of the full report."""
    att, attr = data["attention"], data["attribution"]
    m = att["head_means"]
    L, H = len(m["sink_mass"]), att["num_heads"]
    best = largest_massive(data, L)
    heads = sorted(((m["sink_mass"][i][h], i, h) for i in range(L) for h in range(H)), reverse=True)
    g = attr["growth"]
    order = sorted(range(len(g["branches"])), key=lambda j: -g["mean_delta"][j])
    out = {"tokens": len(data["tokens"]["ids"]),
           "growth": {k: data["growth"][k] for k in ("verdict", "fit_layers", "linear_r2", "quadratic_r2",
                                                     "power_r2_linear", "exponent", "acceleration", "increments")},
           "growth_by_branch": {g["branches"][j]: g["mean_delta"][j] for j in range(len(g["branches"]))},
           "largest_growth": [[g["branches"][j], g["mean_delta"][j]] for j in order[:5]],
           "sink_mass_per_block": [{"block": i, "mean": sum(m["sink_mass"][i]) / H, "max": max(m["sink_mass"][i]),
                                    "head": max(range(H), key=lambda h: m["sink_mass"][i][h]),
                                    "massive_ratio": best[i]["ratio_to_rms"] if i in best else None,
                                    "massive_channel": best[i]["channel"] if i in best else None}
                                   for i in range(L)],
           "top_sink_heads": [{"block": i, "head": h, "sink_mass": s} for s, i, h in heads[:8]],
           "massive_rule": data.get("massive_rule")}
    views = data.get("lens_views")
    if views:
        out["lens_kl"] = {name: lens["mean_kl"] for name, lens in views["lenses"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--tuned-lens", default=None, help="a fitted lens (sluice lens train --out DIR)")
    ap.add_argument("--report", default=None, help="write the HTML report here")
    ap.add_argument("--figures", default=None, help="copy the report's PNGs here, prefixed with --prefix")
    ap.add_argument("--prefix", default="inspect-q06-")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    t0 = time.perf_counter()
    model = load(args.model, dtype=args.dtype)
    tokenizer = Tokenizer.from_pretrained(model.model_dir)
    tuned = load_tuned(args.tuned_lens, model) if args.tuned_lens else False
    load_s = time.perf_counter() - t0
    prompt = corpus_prompt(tokenizer, args.tokens)
    watch = LoadWatch()
    t0 = time.perf_counter()
    data = inspect(model, tokenizer, prompt, progress=False, tuned_lens=tuned)
    inspect_s = time.perf_counter() - t0
    paths = {}
    if args.report:
        t1 = time.perf_counter()
        paths = save(data, Path(args.report))
        report_s = time.perf_counter() - t1
    else:
        report_s = None
    load_watch = watch.result()
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    if args.figures and paths:
        fig = Path(args.figures)
        fig.mkdir(parents=True, exist_ok=True)
        for key in ("attention_heads", "attribution", "growth_fit", "lens_kl"):
            if key in paths:
                shutil.copy(paths[key], fig / f"{args.prefix}{key}.png")
    result = {"what": "sluice inspect (observatory.analysis.inspect) on one prompt, timed and its peak RSS read",
              "model": args.model, "dtype": args.dtype, "num_params": model.config.num_params,
              "tuned_lens": args.tuned_lens, "cpu": cpu_info(), "torch_threads": torch.get_num_threads(),
              "code": code_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "load_s": load_s, "inspect_s": inspect_s, "report_s": report_s, "peak_rss_gb": peak_gb,
              "load_watch": load_watch, "disturbed": load_watch["disturbed"], "results": summarise(data)}
    r = result["results"]
    print(f"{r['tokens']} tokens: inspect {inspect_s:.0f} s, report {report_s or 0:.0f} s, peak RSS {peak_gb:.2f} GB"
          f"{' (DISTURBED)' if result['disturbed'] else ''}")
    print(r["growth"]["verdict"])
    for name, kl in r.get("lens_kl", {}).items():
        print(f"{name} lens KL per layer:", " ".join(f"{x:.2f}" for x in kl))
    save_json(Path(args.json) if args.json else None, result)


if __name__ == "__main__":
    main()
