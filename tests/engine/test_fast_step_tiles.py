"""The native step's own copies of int4/int8 codes (the integer dots' tiles, q4t.h / q8t.h): each linear packed once.
The head is one linear whatever the depth, so over models that differ only in their number of layers the tile bytes
grow by one layer's tiles a layer, and what is left at zero layers is the head's tiles, at least its codes (the
head packed once per layer, as it once was, made them L times the head and nothing at zero)."""

import pytest

import sluice
from sluice.engine import fast_step

from ckpt import build

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")


@pytest.mark.parametrize("quantize, code_bytes", [("int8", 1.0), ("int4", 0.5)])
def test_every_linear_is_packed_once(tmp_path, quantize, code_bytes):
    sizes = {}
    for layers in (1, 2, 3):
        d = tmp_path / f"{quantize}-{layers}"
        # a vocabulary wide enough that the head's tiles outweigh a layer's
        build(d, "qwen3", num_hidden_layers=layers, vocab_size=1024, hidden_size=64, tie_word_embeddings=False)
        model = sluice.load(d, quantize=quantize)
        step = fast_step.FastStep(model)
        sizes[layers] = step._step.tile_bytes()
        layer_codes = sum(m.in_features * m.out_features for m in model.layers[0].modules()
                          if hasattr(m, "in_features")) * code_bytes
    per_layer = sizes[2] - sizes[1]
    assert sizes[3] - sizes[2] == per_layer
    assert layer_codes <= per_layer < 2 * layer_codes  # a layer's codes once (with padding), and nothing else
    head = sizes[1] - per_layer
    assert head >= 1024 * 64 * code_bytes  # the head's codes, once
    assert head < 2 * 1024 * 64 * code_bytes + 4096  # (its padding and scales, not a second copy)
