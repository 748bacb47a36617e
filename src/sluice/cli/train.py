"""`sluice train`: pretrain a model from a TOML recipe."""

from __future__ import annotations

import json
from pathlib import Path


def cmd_train(args) -> int:
    from ..observatory.training import valve_summary
    from ..training.recipe import Recipe
    from ..training.train import run
    recipe = Recipe.load(args.recipe or Path(__file__).parents[1] / "training" / "recipes" / "stdlib.toml")
    summary = run(recipe, args.out, resume=args.resume, stop_at=args.stop_at, valves=valve_summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "data"}, indent=1))
    return 0
