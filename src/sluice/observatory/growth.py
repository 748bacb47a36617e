"""Does the residual stream's variance grow linearly with depth, or does it bend?

The article's claim: every block *adds* to the residual stream, x_{l+1} = x_l + f(norm(x_l)). If the
updates were independent with equal variance, the mean square of x_l would be v_0 + l * sigma^2: a
straight line in l. That is why a final norm is needed before the LM head. Real models need not
obey it (later layers often write bigger updates, or a few "massive activation" channels dominate),
so the fit says which shape describes the measurements, and shows the bend directly.

Input: the per-layer mean square (RMS^2, the variance of an uncentred stream) of x_0 .. x_L, where
x_0 is the first block's input. Pass RMS^2, not RMS: the linear-growth claim is about variance.

Every fit uses the SAME points, l = 1..L: a power law has no value at l = 0, and x_0 (embeddings,
often a tiny mean square) would otherwise inflate the line's R^2 by stretching its range. All three
are least squares (numpy) and their R^2 are in linear space, so they compare directly:
- linear     v_l ~ a * l + b;
- quadratic  v_l ~ q * l^2 + a * l + b: q > 0 is a curve bending upward;
- power law  v_l ~ c * l^p, fitted as a line in log-log space (its log-space R^2 is given too).
The curvature is also shown without any model: the per-layer increments v_l - v_{l-1}, and
`acceleration`, the mean of the last third of the increments after block 0 over the mean of the
first third (block 0's own increment is left out: it turns an embedding into a stream and is
typically unlike any other block's).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ObservatoryError

LINEAR_OK = 0.9  # a line with R^2 below this does not describe the growth
BETTER_BY = 0.01  # the power law (or the quadratic) must beat the line's R^2 by this much to be preferred
SUPERLINEAR, SUBLINEAR = 1.25, 0.8  # exponents outside [0.8, 1.25] are not "roughly linear"
ACCELERATING = 1.5  # increments growing (or shrinking) by this factor over depth bend the curve


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


def acceleration(increments: np.ndarray) -> float:
    """Mean of the last third of `increments` over the mean of the first third (at least one each);
    NaN when the first third does not grow (a ratio to a non-positive mean says nothing)."""
    k = max(1, increments.size // 3)
    first, last = float(increments[:k].mean()), float(increments[-k:].mean())
    return last / first if first > 0 else float("nan")


def _verdict(fit: dict) -> str:
    """One plain-English line. Rules, in order: not growing; a power law that fits clearly better
    than the line with an exponent outside [0.8, 1.25] (super- or sublinear); increments that grow
    (shrink) by ACCELERATING over depth while the quadratic beats the line (accelerating,
    decelerating); a good line (R^2 >= 0.9); otherwise neither describes the data."""
    slope, r2_lin, p, r2_pow = fit["slope"], fit["linear_r2"], fit["exponent"], fit["power_r2_linear"]
    acc, q, r2_quad = fit["acceleration"], fit["quadratic"], fit["quadratic_r2"]
    fits = f"(R^2 {r2_pow:.3f} vs linear {r2_lin:.3f})"
    if slope <= 0:
        return f"not growing: the best line has slope {slope:.3g} (R^2 {r2_lin:.3f})"
    if r2_pow > r2_lin + BETTER_BY and p > SUPERLINEAR:
        return f"superlinear: power law exponent {p:.2f} fits better {fits}"
    if r2_pow > r2_lin + BETTER_BY and p < SUBLINEAR:
        return f"sublinear: power law exponent {p:.2f} fits better {fits}"
    bends = r2_quad > r2_lin + BETTER_BY
    curve = f"(linear R^2 {r2_lin:.3f}, quadratic {r2_quad:.3f}; power law exponent {p:.2f}, R^2 {r2_pow:.3f})"
    if bends and q > 0 and acc >= ACCELERATING:
        return f"accelerating: the per-layer increments grow {acc:.1f}x with depth {curve}"
    if bends and q < 0 and acc <= 1 / ACCELERATING:
        return f"decelerating: the per-layer increments shrink to {acc:.2f}x with depth {curve}"
    if r2_lin >= LINEAR_OK:
        return f"roughly linear (R^2 {r2_lin:.3f}; power law exponent {p:.2f}, R^2 {r2_pow:.3f})"
    return f"irregular: neither a line nor a power law fits well (linear R^2 {r2_lin:.3f}, power law {r2_pow:.3f})"


def fit_growth(values) -> dict:
    """Fit the mean square of x_0..x_L (L + 1 values, list or 1-D tensor) against depth.

    Returns plain Python numbers (all fits over l = 1..L, the same points):
      num_layers       L
      fit_layers       [1, L]: the depths every fit and R^2 uses
      slope, intercept v ~ slope * l + intercept
      linear_r2        R^2 of that line
      quadratic, quadratic_r2   the l^2 coefficient of the best quadratic, and its R^2
      exponent, coefficient   v ~ coefficient * l^exponent
      power_r2_log     R^2 of the power law in log-log space (where it was fitted)
      power_r2_linear  R^2 of its predictions in linear space
      increments       v_l - v_{l-1} for l = 1..L (the first is block 0's)
      acceleration     last third of the increments after block 0 over the first third (NaN if
                       the first third's mean is not positive)
      verdict          one line, see _verdict for the rules
    Raises ObservatoryError for fewer than 4 values, non-finite or non-positive values, or a
    constant stream.
    """
    v = _values(values)  # (L + 1,) fp64
    layers = np.arange(1, v.size, dtype=np.float64)  # l = 1..L
    y = v[1:]
    slope, intercept = np.polyfit(layers, y, 1)
    quad = np.polyfit(layers, y, 2)
    log_l, log_v = np.log(layers), np.log(y)
    p, log_c = np.polyfit(log_l, log_v, 1)
    increments = np.diff(v)  # (L,)
    fit = {"num_layers": v.size - 1, "fit_layers": [1, v.size - 1],
           "slope": float(slope), "intercept": float(intercept),
           "linear_r2": _r2(y, slope * layers + intercept),
           "quadratic": float(quad[0]), "quadratic_r2": _r2(y, np.polyval(quad, layers)),
           "exponent": float(p), "coefficient": float(np.exp(log_c)),
           "power_r2_log": _r2(log_v, p * log_l + log_c),
           "power_r2_linear": _r2(y, np.exp(log_c) * layers ** p),
           "increments": increments.tolist(), "acceleration": acceleration(increments[1:])}
    fit["verdict"] = _verdict(fit)
    return fit
