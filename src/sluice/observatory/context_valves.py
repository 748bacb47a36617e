"""The four valves of one context, small enough to send to a browser every few tokens: what the live
page of `sluice serve` draws (server/live.py), and the same numbers `observe()` gives from Python.

    residual   RMS of x_0..x_L per layer: the mean over the context's positions, and at its last one
    norms      every norm's gain (RMS out / RMS in): mean over positions, and at the last one
    logits     the LM head at every position: max, min, log Z, entropy (nats), top-1 probability
    softmax    softmax.softmax_safety of the last position's logits (the distribution the next token
               is drawn from) in fp32, fp16 and bf16, with the final norm and without it (the LM head
               on the raw x_L: what the final norm prevents), and per dtype the headroom
               log(dtype max) - max logit, which goes negative exactly when a naive exp() overflows

One plain forward with the probes attached (the attention statistics left off: they recompute every
layer's scores, and no valve needs them). It runs on the caller's model object and uses no cache, so
the caller decides when that is safe (the server runs it on its engine's own thread between steps).
"""

from __future__ import annotations

import torch

from ..errors import ObservatoryError
from .analysis import jsonable
from .attach import observe
from .lens import head_logits
from .probes import LOGIT_STATS
from .softmax import overflow_threshold, softmax_safety

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _safety(z: torch.Tensor) -> dict:
    """softmax_safety of one row of logits (V,), and the headroom of each dtype."""
    top = float(z.max())
    return {"logit_max": top, "table": softmax_safety(z[None], DTYPES),
            "headroom": {str(d).removeprefix("torch."): overflow_threshold(d) - top for d in DTYPES}}


def context_valves(model, ids: list[int]) -> dict:
    """The valves of the context `ids` (token ids) under `model`, as plain JSON-ready data (NaN and
    inf as the strings "nan", "inf": see analysis.jsonable)."""
    if not ids:
        raise ObservatoryError("the context is empty: at least one token is needed")
    if getattr(model, "world", 1) > 1:  # a rank's probes reduce over the ranks: every rank must call
        raise ObservatoryError("the live valves are not available on a tensor-parallel rank")
    T, last = len(ids), {}
    with torch.inference_mode(), observe(model, capacity=(1, T), attention=False) as obs:
        hook = model.layers[-1].register_forward_hook(lambda _m, _i, out: last.update(x=out[0, -1:].detach()))
        try:
            logits = model(torch.tensor([ids], device=model.embed.weight.device))[0]  # (T, V) fp32
        finally:
            hook.remove()
        raw = head_logits(model, last["x"][None], final_norm=False)[0, 0]  # (V,) fp32, the final norm bypassed
    s, gain = obs.stats, obs.norm_gain()[:, 0]  # gain: (norms, T)
    rms = s["resid_rms"][:, 0]  # (L+1, T)
    data = {
        "tokens": T, "num_layers": obs.num_layers,
        "residual": {"rms_mean": rms.mean(-1).tolist(), "rms_last": rms[:, -1].tolist(),
                     "absmax_last": s["resid_absmax"][:, 0, -1].tolist()},
        "norms": {"names": list(obs.norm_names), "gain_mean": gain.mean(-1).tolist(),
                  "gain_last": gain[:, -1].tolist()},
        "logits": {k: s["logits"][i, 0].tolist() for i, k in enumerate(LOGIT_STATS)},
        "softmax": {"with_final_norm": _safety(logits[-1].float()), "without_final_norm": _safety(raw)},
        "nonfinite": obs.first_nonfinite(),
    }
    return jsonable(data)
