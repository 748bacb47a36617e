"""Does the residual stream's variance grow linearly with depth?

The article's claim: every block *adds* to the residual stream, x_{l+1} = x_l + f(norm(x_l)). If the
updates were independent with equal variance, the mean square of x_l would be v_0 + l * sigma^2: a
straight line in l. That is why a final norm is needed before the LM head. Real models need not
obey it (later layers often write bigger updates, or a few "massive activation" channels dominate),
so we fit both a line and a power law and say which describes the measurements better.

Input: the per-layer mean square (RMS^2, the variance of an uncentred stream) of x_0 .. x_L, where
x_0 is the embedding output. Pass RMS^2, not RMS: the linear-growth claim is about variance.

Two fits, both least squares (numpy):
- linear     v_l ~ a * l + b over l = 0..L;
- power law  v_l ~ c * l^p over l = 1..L, fitted as a line in log-log space (l = 0 has no logarithm).
  R^2 is given in log space (the fit's own measure) and in linear space (comparable with the line's).
The power law has no intercept, so exactly linear data with a large v_0 gets an exponent below 1
and a worse R^2 than the line: read the exponent together with the verdict, not alone.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ObservatoryError

LINEAR_OK = 0.9  # a line with R^2 below this does not describe the growth
BETTER_BY = 0.01  # the power law must beat the line's R^2 by this much to be preferred
SUPERLINEAR, SUBLINEAR = 1.25, 0.8  # exponents outside [0.8, 1.25] are not "roughly linear"


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    """Coefficient of determination, 1 - SS_res / SS_tot."""
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss_tot


def _values(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size < 4:
        raise ObservatoryError(f"fit_growth needs a 1-D sequence of at least 4 values (x_0..x_L, L >= 3 "
                               f"layers, so the power law has 3 points), got shape {v.shape}")
    if not np.isfinite(v).all():
        raise ObservatoryError(f"fit_growth got non-finite mean squares at layers "
                               f"{np.flatnonzero(~np.isfinite(v)).tolist()}: the stream overflowed?")
    if (v <= 0).any():
        raise ObservatoryError(f"fit_growth needs positive mean squares, got {v[v <= 0].tolist()} at "
                               f"layers {np.flatnonzero(v <= 0).tolist()} (pass RMS^2 of x_0..x_L)")
    if np.ptp(v[1:]) == 0:
        raise ObservatoryError(f"fit_growth got a constant stream ({v[1]!r} at every layer): no growth to fit")
    return v


def _verdict(slope: float, r2_lin: float, p: float, r2_pow: float) -> str:
    """One plain-English line. Rules, in order: not growing; a power law that fits clearly better
    than the line with an exponent outside [0.8, 1.25] (super- or sublinear); a good line
    (R^2 >= 0.9); otherwise neither describes the data."""
    fits = f"(R^2 {r2_pow:.3f} vs linear {r2_lin:.3f})"
    if slope <= 0:
        return f"not growing: the best line has slope {slope:.3g} (R^2 {r2_lin:.3f})"
    if r2_pow > r2_lin + BETTER_BY and p > SUPERLINEAR:
        return f"superlinear: power law exponent {p:.2f} fits better {fits}"
    if r2_pow > r2_lin + BETTER_BY and p < SUBLINEAR:
        return f"sublinear: power law exponent {p:.2f} fits better {fits}"
    if r2_lin >= LINEAR_OK:
        return f"roughly linear (R^2 {r2_lin:.3f}; power law exponent {p:.2f}, R^2 {r2_pow:.3f})"
    return f"irregular: neither a line nor a power law fits well (linear R^2 {r2_lin:.3f}, power law {r2_pow:.3f})"


def fit_growth(values) -> dict:
    """Fit the mean square of x_0..x_L (L + 1 values, list or 1-D tensor) against depth.

    Returns plain Python numbers:
      num_layers       L
      slope, intercept v ~ slope * l + intercept over l = 0..L
      linear_r2        R^2 of that line
      exponent, coefficient   v ~ coefficient * l^exponent over l = 1..L
      power_r2_log     R^2 of the power law in log-log space (where it was fitted)
      power_r2_linear  R^2 of its predictions in linear space, over l = 1..L
      verdict          one line, see _verdict for the rules
    Raises ObservatoryError for fewer than 4 values, non-finite or non-positive values, or a
    constant stream.
    """
    v = _values(values)  # (L + 1,) fp64
    layers = np.arange(v.size, dtype=np.float64)
    slope, intercept = np.polyfit(layers, v, 1)
    r2_lin = _r2(v, slope * layers + intercept)

    log_l, log_v = np.log(layers[1:]), np.log(v[1:])  # l = 1..L
    p, log_c = np.polyfit(log_l, log_v, 1)
    pred = np.exp(log_c) * layers[1:] ** p
    r2_pow = _r2(v[1:], pred)
    return {"num_layers": v.size - 1, "slope": float(slope), "intercept": float(intercept),
            "linear_r2": r2_lin, "exponent": float(p), "coefficient": float(np.exp(log_c)),
            "power_r2_log": _r2(log_v, p * log_l + log_c), "power_r2_linear": r2_pow,
            "verdict": _verdict(float(slope), r2_lin, float(p), r2_pow)}
