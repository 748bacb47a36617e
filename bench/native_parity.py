"""The native step's parity with the torch path, per family: the largest logit difference, relative to
the largest logit, of a 5-token chunk over a prefilled cache (fp32 weights, and bf16 weights in fp32
compute with fp32 products, SLUICE_BF16_DOT=fp32: the dot mode has its own bound, test_fast_step_bf16_dot.py), on the tiny random checkpoints the tests build (tests/engine/test_fast_step*.py: every family
sluice loads, with non-default values of the fields each reads). The tests assert <= 1e-4.

    .venv/bin/python bench/native_parity.py --json docs/results/native-parity.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests"), str(Path(__file__).parents[1] / "tests" / "engine")]
from common import environment, save_json  # noqa: E402
from test_fast_step import CASES as OLD_CASES  # noqa: E402
from test_fast_step import chunk, load, prefilled  # noqa: E402
from test_fast_step_families import CASES as NEW_CASES  # noqa: E402
from test_fast_step_families import build_live  # noqa: E402

from ckpt import build  # noqa: E402
from sluice.engine import mixed  # noqa: E402
from sluice.engine.fast_step import FastStep  # noqa: E402


def parity(model, T: int = 5) -> float:
    r = prefilled(model, 32)
    tokens, positions = chunk(r, T)
    k, v = r.cache.k.clone(), r.cache.v.clone()
    with torch.inference_mode():
        want = model(tokens, positions, r.cache)
        got = FastStep(model)(tokens, positions, k, v)
    return float((got - want).abs().max() / want.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    mixed.BF16_DOT = "fp32"  # (the native step and the torch path alike)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = {n: (a, o, build) for n, (a, o) in OLD_CASES.items()}
        cases.update({n: (a, o, build_live) for n, (a, o) in NEW_CASES.items()})
        for name, (arch, over, make) in cases.items():
            d = Path(tmp) / name
            make(d, arch, **over)
            row = {"case": name, "arch": arch,
                   "fp32": parity(load(d)), "bf16_weights": parity(load(d, "bfloat16"))}
            rows.append(row)
            print(f"{name:<40} {arch:<8} fp32 {row['fp32']:.1e}  bf16 weights {row['bf16_weights']:.1e}", flush=True)
    if args.json:
        save_json(Path(args.json), {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
