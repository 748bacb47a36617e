"""lm-evaluation-harness against `sluice serve`: a multiple-choice task run through lm-eval's
`local-completions` model (echo + logprobs on /v1/completions) and through lm-eval's own `hf` backend
(transformers, fp32) on the same checkpoint; per item and choice, the two loglikelihoods and their
difference, and both accuracies (docs/server.md, "lm-evaluation-harness").

    .venv/bin/python bench/lm_eval_parity.py --out docs/results/lm-eval-echo.json

The task is tests/server/lm_eval_task (a YAML task and its jsonl data, read offline); the model is the
bundled one unless --model names a checkpoint directory (with its tokenizer). The server is a real
`sluice serve --dtype float32` process on a free 127.0.0.1 port, stopped with SIGTERM at the end.
tests/server/test_lm_eval.py runs this script and checks what it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Offline, before lm_eval (and so datasets and huggingface_hub) read their settings at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours, however this file was loaded
from serve_servers import _commit, sluice_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "tests/server/lm_eval_task"
TOLERANCE = 1e-4  # the issue's: per-item loglikelihoods within this


def task_config(task_dir: Path = TASK_DIR) -> dict:
    """The task's YAML as a dict, its data file's path made absolute (lm-eval reads it from the cwd)."""
    import yaml
    cfg = yaml.safe_load((task_dir / "stdlib_mc.yaml").read_text())
    files = cfg["dataset_kwargs"]["data_files"]
    cfg["dataset_kwargs"]["data_files"] = {split: str(task_dir / name) for split, name in files.items()}
    return cfg


def evaluate(model: str, model_args: str, cfg: dict) -> tuple[float, list[dict]]:
    """(accuracy, per item: its choices' loglikelihoods and lm-eval's pick) of one lm-eval run."""
    import lm_eval
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[cfg], batch_size=1, log_samples=True,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    name = cfg["task"]
    items = [{"doc_id": s["doc_id"], "target": s["target"], "acc": s["acc"],
              "loglikelihoods": [float(r[0][0]) for r in s["resps"]]}
             for s in sorted(out["samples"][name], key=lambda s: s["doc_id"])]
    return out["results"][name]["acc,none"], items


def compare(model_dir: str, served_name: str, cfg: dict) -> dict:
    server = sluice_server(model_dir, "float32", 8, ["--served-model-name", served_name])
    try:
        server.wait_ready(300)
        api_args = (f"model={served_name},base_url={server.base}/v1/completions,tokenizer_backend=huggingface,"
                    f"tokenizer={model_dir},tokenized_requests=True,max_retries=1")
        sluice_acc, sluice_items = evaluate("local-completions", api_args, cfg)
    finally:
        server.stop()
    hf_acc, hf_items = evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", cfg)
    rows = []
    for h, s in zip(hf_items, sluice_items, strict=True):
        assert h["doc_id"] == s["doc_id"]
        for c, (a, b) in enumerate(zip(h["loglikelihoods"], s["loglikelihoods"], strict=True)):
            rows.append({"doc_id": h["doc_id"], "choice": c, "target": c == h["target"], "hf": a, "sluice": b,
                         "diff": b - a})
    return {"task": cfg["task"], "items": len(hf_items), "hf_acc": hf_acc, "sluice_acc": sluice_acc,
            "max_abs_diff": max(abs(r["diff"]) for r in rows), "tolerance": TOLERANCE,
            "same_picks": [h["acc"] for h in hf_items] == [s["acc"] for s in sluice_items], "rows": rows}


def table(result: dict) -> str:
    lines = ["| item | choice | target | hf loglikelihood | sluice loglikelihood | diff |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['doc_id']} | {r['choice']} | {'*' if r['target'] else ''} | {r['hf']:.6f} | "
                     f"{r['sluice']:.6f} | {r['diff']:+.2e} |")
    lines.append(f"\naccuracy: hf {result['hf_acc']:.4f}, sluice {result['sluice_acc']:.4f}; "
                 f"max |diff| {result['max_abs_diff']:.2e} over {len(result['rows'])} loglikelihoods")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory with its tokenizer (default: the bundled model)")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.model is None:
        from sluice.model.loading import bundled_model_dir
        args.model = str(bundled_model_dir())
    import lm_eval
    import transformers
    result = compare(args.model, "sluice-lm-eval", task_config())
    result["model"] = Path(args.model).name
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["commit"] = _commit()
    result["versions"] = {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__}
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["max_abs_diff"] <= TOLERANCE and result["hf_acc"] == result["sluice_acc"] else 1


if __name__ == "__main__":
    sys.exit(main())
