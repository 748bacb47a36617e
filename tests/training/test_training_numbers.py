"""The training numbers against hand-computed values: the learning-rate schedule (warmup, cosine, floor)
and evaluation's loss and bits per byte, which refuses to measure nothing."""

import math

import numpy as np
import pytest
import torch

from sluice.training.train import TrainingError, evaluate, lr_at


def test_lr_schedule_against_hand_computed_values():
    class T:
        lr, min_lr_ratio, warmup_steps, steps = 2e-3, 0.1, 60, 1200
    assert lr_at(0, T) == pytest.approx(2e-3 / 60, rel=1e-12)  # warmup's first step is not 0
    assert lr_at(29, T) == pytest.approx(1e-3, rel=1e-12)
    assert lr_at(59, T) == pytest.approx(2e-3, rel=1e-12)
    assert lr_at(60, T) == pytest.approx(2e-3, rel=1e-12)  # the cosine starts at the peak
    assert lr_at(630, T) == pytest.approx(2e-3 * (0.1 + 0.9 * 0.5), rel=1e-12)  # half way: the mean
    # The last step trained (1199): 0.5 * (1 + cos(pi * 1139/1140)) = 1.898e-6 of the way up from min.
    assert lr_at(1199, T) == pytest.approx(2e-4 + 1.8e-3 * 1.8988e-6, rel=1e-6)
    assert lr_at(1200, T) == pytest.approx(2e-4, rel=1e-12)  # the cosine's end is min_lr_ratio * lr


class _Uniform(torch.nn.Module):
    """Logits all equal: every token costs exactly ln(vocab) nats."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, x):
        return torch.zeros(*x.shape, self.vocab)


def test_bits_per_byte_against_a_hand_computed_value():
    tokens = np.array([0, 1, 2, 3, 1, 1, 2, 0, 3], dtype=np.uint16)
    byte_len = np.array([3, 1, 2, 0], dtype=np.int64)
    ev = evaluate(_Uniform(4), tokens, byte_len, seq_len=4, max_tokens=100, autocast=False)
    # Two windows of 4 targets: tokens[1:5] = 1 2 3 1 (1+2+0+1 = 4 bytes), tokens[5:9] = 1 2 0 3
    # (1+2+3+0 = 6 bytes). 8 targets at ln 4 nats each = 16 bits over 10 bytes.
    assert ev["tokens"] == 8 and ev["bytes"] == 10
    assert ev["loss"] == pytest.approx(math.log(4), rel=1e-6)
    assert ev["bpb"] == pytest.approx(1.6, rel=1e-6)
    ev = evaluate(_Uniform(4), tokens, byte_len, seq_len=4, max_tokens=5, autocast=False)
    assert ev["tokens"] == 4 and ev["bpb"] == pytest.approx(8 / 4, rel=1e-6)  # max_tokens: one window


def test_evaluate_refuses_to_measure_nothing():
    model = _Uniform(4)
    with pytest.raises(TrainingError, match="evaluation measured nothing"):
        evaluate(model, np.zeros(3, dtype=np.uint16), np.ones(4, dtype=np.int64), 8, 100, False)
