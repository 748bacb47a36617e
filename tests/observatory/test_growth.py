"""fit_growth recovers known lines and power laws, tells them apart, and refuses degenerate input."""

import json

import numpy as np
import pytest
import torch

from sluice.errors import ObservatoryError
from sluice.observatory.growth import fit_growth

KEYS = {"num_layers", "slope", "intercept", "linear_r2", "exponent", "coefficient", "power_r2_log",
        "power_r2_linear", "verdict"}


def test_exact_line():
    fit = fit_growth([0.5 + 2.0 * l for l in range(29)])
    assert set(fit) == KEYS and fit["num_layers"] == 28
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
