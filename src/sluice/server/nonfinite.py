"""Where a NaN or inf starts, for the message of a request whose logits went non-finite (batch_engine.py):
its tokens run once more through the model with the observatory's probes (observatory/probes.py
first_nonfinite)."""

from __future__ import annotations

import torch


def nonfinite_origin(model, ids: list[int]) -> str:
    """Where a NaN or inf first appears when `ids` run through `model` (a plain forward with probes)."""
    from ..observatory.attach import observe
    try:
        with torch.inference_mode(), observe(model, capacity=(1, len(ids))) as obs:
            model(torch.tensor([ids], device=model.embed.weight.device))
            first = obs.first_nonfinite()
    except Exception as e:  # noqa: BLE001 -- the diagnosis must not turn one failed request into a crash
        return f"locating its origin failed ({type(e).__name__}: {e})"
    if first is None:
        return "a rerun of the sequence without the cache gave finite values everywhere (a transient fault?)"
    where = f"layer {first['layer']}" if first["layer"] is not None else "outside the blocks"
    return (f"it starts in {first['module']} ({where}) at prompt position {first['position']} "
            f"(the observatory's first non-finite value)")
