"""inspect says what it will cost before it starts, and shows signs of life in a log."""

from types import SimpleNamespace

import pytest

import sluice
from sluice.observatory import analysis
from sluice.observatory.inspect_cost import LineProgress, SAFETY_PASSES, describe, estimate
from sluice.observatory.lens import lens_flops


def test_flops_and_bytes_follow_the_shapes(tiny_dir):
    model = sluice.load(str(tiny_dir))
    cfg = model.config
    cost = estimate(model, 40, calibrate=False)
    L, C, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    assert cost["lens_flops"] == lens_flops(cfg, 1, 40) == 2 * (L + 1) * 40 * C * V
    assert cost["forward_flops"] == 2 * cfg.num_params * 40 + 2 * L * 40 * 40 * cfg.num_heads * cfg.head_dim
    assert cost["safety_logits"] == 18 * 40 * V and SAFETY_PASSES == 18
    assert cost["weight_bytes"] == sum(p.nbytes for p in model.parameters())
    assert cost["peak_bytes_estimate"] > (L + 1) * 40 * C * model.embed.weight.element_size()
    assert "seconds_estimate" not in cost and "estimated" not in describe(cost)
    # the Qwen3-0.6B shape at 512 tokens: the issue's ~4.6 TFLOP of lens
    q06 = SimpleNamespace(num_layers=28, hidden_size=1024, vocab_size=151936)
    assert lens_flops(q06, 1, 512) == pytest.approx(4.62e12, rel=1e-2)


def test_calibration_scales_a_timed_chunk(tiny_dir):
    model = sluice.load(str(tiny_dir))
    cost = estimate(model, 64, calibrate=True)
    c = cost["calibration"]
    assert c["lens_chunk_s"] > 0 and c["safety_row_s"] > 0 and c["lens_flop_s"] > 0
    assert c["lens_chunk_rows"] == 64  # a tiny vocabulary: the whole prompt is one chunk
    assert cost["lens_s"] == pytest.approx(1.3 * (model.config.num_layers + 1) * c["lens_chunk_s"])
    assert cost["safety_s"] == pytest.approx(2 * 64 * c["safety_row_s"])
    assert cost["seconds_estimate"] > cost["lens_s"] + cost["safety_s"]
    assert "estimated" in describe(cost) and "GFLOP/s" in describe(cost)


def test_a_logged_run_prints_the_cost_and_progress_lines(tiny_dir, capsys):
    """progress=True with stderr not a terminal (as under pytest): plain lines, one per stage and
    about every tenth of the lens's layers, after the cost."""
    model = sluice.load(str(tiny_dir))
    tok = sluice.Tokenizer.from_pretrained(tiny_dir)
    data = analysis.inspect(model, tok, "def add(a, b):\n    return a + b", progress=True)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith(f"inspect of {len(data['tokens']['ids'])} tokens: two forwards")
    L = model.config.num_layers
    assert any(f"logit lens (layers): {L + 1}/{L + 1}" in line for line in lines)
    assert any("forward + probes (layers): started" in line for line in lines)
    assert lines[-1].startswith("[inspect") and "done in" in lines[-1]
    assert "cost" not in data  # timings stay out of the report (a TP run's equals one process's)
    assert any("softmax safety, growth fit: 2/2" in line for line in lines)
    # quiet by default on a short prompt and a small model
    analysis.inspect(model, tok, "x = 1", progress=None)
    assert capsys.readouterr().err == ""


def test_line_progress_thins_its_lines(capsys):
    with LineProgress() as bar:
        t = bar.add_task("lens", total=100)
        for _ in range(100):
            bar.advance(t)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 + 10 + 1 and lines[-2].endswith("lens: 100/100")


def test_only_massive_channels_are_listed(tmp_path):
    """inspect lists a channel only from MASSIVE_RATIO x its token's RMS: a planted 200 in one
    channel is listed at every layer that carries it, the ordinary top channels of a random model
    are not, and the largest ratio is named either way."""
    from ckpt import build_with_tokenizer
    build_with_tokenizer(tmp_path, "qwen3", hidden_size=256)  # at hidden 64, one channel tops out at 8x RMS
    model = sluice.load(tmp_path)
    tok = sluice.Tokenizer.from_pretrained(tmp_path)
    prompt = "def add(a, b):\n    return a + b"
    plain = analysis.inspect(model, tok, prompt, progress=False)
    assert plain["massive_activations"] == []  # random weights: top channels at ~3x RMS
    big = plain["massive_rule"]["largest"]
    assert 1 < big["ratio_to_rms"] < analysis.MASSIVE_RATIO and plain["massive_rule"]["min_ratio_to_rms"] == 10

    def plant(_m, _i, out):
        out = out.clone()
        out[0, 2, 7] = 200.0
        return out
    handle = model.layers[1].register_forward_hook(plant)
    try:
        data = analysis.inspect(model, tok, prompt, progress=False)
    finally:
        handle.remove()
    rows = data["massive_activations"]
    assert rows and all(r["ratio_to_rms"] >= analysis.MASSIVE_RATIO for r in rows)
    assert {r["layer"] for r in rows} == set(range(2, model.config.num_layers + 1))  # x_2 on
    assert all((r["channel"], r["position"]) == (7, 2) for r in rows)
    assert data["massive_rule"]["largest"]["channel"] == 7
