"""fit_growth recovers known lines and power laws, tells them apart, and refuses degenerate input."""

import json

import numpy as np
import pytest
import torch

from sluice.errors import ObservatoryError
from sluice.observatory.growth import fit_growth

KEYS = {"num_layers", "slope", "intercept", "linear_r2", "exponent", "coefficient", "power_r2_log",
        "power_r2_linear", "verdict", "quadratic", "quadratic_r2", "acceleration"}
SERIES = {"fit_layers", "increments"}  # lists, compared separately


def test_exact_line():
    fit = fit_growth([0.5 + 2.0 * l for l in range(29)])
    assert set(fit) == KEYS | SERIES and fit["num_layers"] == 28
    assert fit["slope"] == pytest.approx(2.0, abs=1e-9)
    assert fit["intercept"] == pytest.approx(0.5, abs=1e-9)
    assert abs(fit["linear_r2"] - 1) < 1e-9
    assert fit["verdict"].startswith("roughly linear")
    json.dumps(fit)


@pytest.mark.parametrize("p, c", [(2.0, 0.3), (1.5, 4.0), (0.5, 10.0)])
def test_exact_power_law(p, c):
    values = torch.tensor([0.01] + [c * l ** p for l in range(1, 25)], dtype=torch.float32)
    fit = fit_growth(values)  # a tensor works too; x_0 is not used by the power law
    assert fit["exponent"] == pytest.approx(p, rel=1e-5)
    assert fit["coefficient"] == pytest.approx(c, rel=1e-5)
    assert abs(fit["power_r2_log"] - 1) < 1e-9 and abs(fit["power_r2_linear"] - 1) < 1e-9


def test_verdicts_differ():
    linear = fit_growth([1 + l for l in range(25)])["verdict"]
    quadratic = fit_growth([1 + l * l for l in range(25)])["verdict"]
    sqrt = fit_growth([np.sqrt(l) + 1e-3 for l in range(25)])["verdict"]
    shrinking = fit_growth([30 - l for l in range(25)])["verdict"]
    assert linear.startswith("roughly linear")
    assert quadratic.startswith("superlinear: power law exponent 1.8")  # the +1 pulls it below 2
    assert sqrt.startswith("sublinear: power law exponent 0.5")
    assert shrinking.startswith("not growing")


def test_noisy_line_is_still_linear():
    rng = np.random.default_rng(0)
    values = 1 + 3 * np.arange(30) + rng.normal(0, 2, 30)
    fit = fit_growth(values)
    assert fit["slope"] == pytest.approx(3, rel=0.05)
    assert fit["verdict"].startswith("roughly linear")


@pytest.mark.parametrize("values, match", [
    ([1.0, 2.0, 3.0], "at least 4"),
    ([[1.0, 2.0], [3.0, 4.0]], "1-D"),
    ([1.0, 2.0, float("nan"), 4.0], "non-finite"),
    ([1.0, 2.0, float("inf"), 4.0], "non-finite"),
    ([1.0, 0.0, 3.0, 4.0], "positive"),
    ([1.0, -2.0, 3.0, 4.0], "positive"),
    ([0.0] * 6, "positive"),
    ([1.0, 5.0, 5.0, 5.0], "constant"),
])
def test_degenerate_inputs(values, match):
    with pytest.raises(ObservatoryError, match=match):
        fit_growth(values)
    assert issubclass(ObservatoryError, ValueError)


def test_inspect_fits_the_mean_square_of_the_stream(tiny_dir):
    """`sluice inspect` fits the mean square of x_0..x_L (not the RMS): its growth section equals
    fit_growth of the mean of x_l^2 that the logit lens measures on the same forward, on its own."""
    import sluice
    from sluice.observatory.analysis import inspect
    from sluice.observatory.attach import logit_lens

    model = sluice.load(str(tiny_dir))
    tok = sluice.Tokenizer.from_pretrained(tiny_dir)
    prompt = "def add(a, b):\n    return a + b"
    data = inspect(model, tok, prompt, progress=False)
    mean_square = logit_lens(model, torch.tensor([tok.encode(prompt)])).mean_square
    want = fit_growth(mean_square)
    assert {k: data["growth"][k] for k in KEYS - {"verdict"}} == pytest.approx(
        {k: want[k] for k in KEYS - {"verdict"}}, rel=1e-4)
    rms_fit = fit_growth(mean_square.sqrt())  # what the RMS would give: visibly other numbers
    assert data["growth"]["slope"] != pytest.approx(rms_fit["slope"], rel=1e-2)


# The bundled model's mean squares of x_0..x_6 on "def read_config(path):" (issue 31): block 0's jump,
# then increments 6.9, 14.2, 19.4, 20.5, 26.0 that grow with depth.
BUNDLED = np.cumsum([0.0027, 28.489, 6.911, 14.237, 19.360, 20.539, 26.048])


def test_every_fit_uses_the_same_points():
    """x_0 takes part in no fit: moving it changes no R^2, and the line's R^2 is the one of l = 1..L."""
    base = fit_growth(BUNDLED)
    moved = fit_growth(np.r_[BUNDLED[1] * 0.5, BUNDLED[1:]])
    for k in ("slope", "intercept", "linear_r2", "quadratic", "quadratic_r2", "exponent", "power_r2_linear"):
        assert moved[k] == pytest.approx(base[k], rel=1e-12), k
    layers, y = np.arange(1, 7), BUNDLED[1:]
    line = np.polyval(np.polyfit(layers, y, 1), layers)
    assert base["linear_r2"] == pytest.approx(1 - ((y - line) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    assert base["fit_layers"] == [1, 6]


def test_an_upward_bend_is_accelerating_not_linear():
    fit = fit_growth(BUNDLED)
    assert fit["linear_r2"] == pytest.approx(0.968, abs=1e-3)  # was 0.980 with x_0 in the line's points
    assert fit["increments"] == pytest.approx(np.diff(BUNDLED).tolist())
    assert fit["acceleration"] == pytest.approx(26.048 / 6.911, rel=1e-6)  # last / first, 5 increments
    assert fit["quadratic"] > 0 and fit["quadratic_r2"] > fit["linear_r2"] + 0.01
    assert fit["verdict"].startswith("accelerating: the per-layer increments grow 3.8x"), fit["verdict"]
    # mirrored (increments shrinking with depth), the same data decelerates
    shrinking = np.r_[BUNDLED[:2], BUNDLED[1] + np.cumsum(np.diff(BUNDLED)[1:][::-1])]
    assert fit_growth(shrinking)["verdict"].startswith("decelerating"), fit_growth(shrinking)["verdict"]


def test_acceleration_needs_growing_first_increments():
    flat_start = [1.0, 2.0, 2.0, 2.0, 5.0, 9.0]  # first third after block 0 adds nothing
    assert np.isnan(fit_growth(flat_start)["acceleration"])
