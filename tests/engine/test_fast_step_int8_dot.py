"""native/q8t.h, the integer-dot mode of the native step's int8 products (gemv.INT8_DOT "int8", the default; every
chunk, decode and prefill): each activation row is rounded per block of 32 inputs to int8 (d = max|x| / 127,
a = rint(x / d), as llama.cpp's Q8_0) and code x code sums in integers, times d per block, times the row's scale.

Two references. The exact one: the dequantized model (test_fast_step_int8.py's) whose linears round their input as
q8t.h does first (gemv.round_blocks_int8, plain torch): what is left is fp32 summation order, so 1e-4 of the largest
logit, as the fp32 products' bound, checked on one-token chunks (in longer ones, somewhere an input can lie on a tie
of the rounding that the two sides' summation orders upstream break differently: one step of x; on an Intel Xeon
a 3-token chunk met one). The multi-row tiles are held to it all the same: a token's numbers in any chunk are bit
for bit its numbers decoded alone. The
model itself: the rounding of x (up to half a step, max|x| / 254, per input) costs ~1% of the largest logit on these
random tiny models, so the bound against the dequantized model is 5e-2 of it; greedy tokens equal the rounded
model's (20 tokens of two rows). A token's numbers never depend on its batch or on how its prompt was cut
into chunks (bit for bit)."""

from pathlib import Path

import pytest
import torch
from torch import nn

import sluice
from avx2_build import run_avx2_build
from greedy_walk import caches_after_prompts, check_chunk, greedy_walks
from chunking import assert_same_numbers_in_any_chunk_and_batch
from sluice.engine import fast_step, gemv
from sluice.engine.fast_step import FastStep
from sluice.engine.kv_cache import KVCache
from sluice.model.quant import Int8Linear
from test_fast_step_int8 import CASES, PROMPTS, ckpt_dirs, dequantized, odd_model  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")

EXACT = 1e-4  # against the dequantized model with q8t.h's rounding of x: summation order only
MODEL = 5e-2  # against the dequantized model itself: the rounding of x to 8 bits per block of 32


class RoundedInputLinear(nn.Linear):
    """An fp32 linear that first rounds its input as q8t.h does (over the row zero-padded to a multiple of 32)."""

    def __init__(self, lin: nn.Linear):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None)
        self.load_state_dict(lin.state_dict())

    def forward(self, x):
        return super().forward(gemv.round_blocks_int8(x, -(-self.in_features // 32) * 32))


def rounded(model: nn.Module) -> nn.Module:
    ref = dequantized(model)
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            parent, _, attr = name.rpartition(".")
            owner = ref.get_submodule(parent) if parent else ref
            setattr(owner, attr, RoundedInputLinear(getattr(owner, attr)))
    return ref


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [1, 3, 17])  # 2, 6 and 34 token rows: tiles of 1-4 rows
def test_chunk_logits_equal_the_rounded_and_the_dequantized_model(ckpt_dirs, name, T):
    model = sluice.load(ckpt_dirs[name], quantize="int8")
    exact, plain = rounded(model), dequantized(model)
    check_chunk(model, exact, plain, PROMPTS, T, MODEL, EXACT, exact_upto=1, int8_dot="int8")


def test_padded_rows_equal_the_rounded_model():
    """hidden 44, intermediate 76, head_dim 20: every row ends in a partial block of 32 (12 or 16 inputs)."""
    model = odd_model()
    exact = rounded(model)
    tokens = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(3).expand(2, 3)
    cache, ref_cache = KVCache(model.config, 2, 32), KVCache(model.config, 2, 32)
    with torch.inference_mode():
        want = exact(tokens, positions, ref_cache)
        got = FastStep(model, int8_dot="int8")(tokens, positions, cache.k, cache.v)
    assert (got - want).abs().max() <= EXACT * want.abs().max()


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied", "llama-bias"])
def test_greedy_tokens_equal_the_rounded_model(ckpt_dirs, name):
    """(Against the dequantized model itself the tokens part where a margin is below the rounding of x: on qwen3
    one row at token 19 of 20.)"""
    model = sluice.load(ckpt_dirs[name], quantize="int8")
    ref = rounded(model)
    (cache, ref_cache), pos = caches_after_prompts(model, PROMPTS, 1, int8_dot="int8")
    step = FastStep(model, int8_dot="int8")
    first = torch.tensor([PROMPTS[0][-1], PROMPTS[1][-1]])
    tokens = greedy_walks(step, ref, first, pos, cache, ref_cache)
    assert tokens["fast"] == tokens["ref"]


def test_a_token_has_the_same_numbers_in_any_chunk_and_batch():
    """Decode rows batched (3 and 8 rows) and each alone, and one row's tokens in chunks of 1, 2, 4, 1, 8, 3 and a
    chunk past MAX_CHUNK, and one at a time: bit for bit the same logits and cache."""
    model = odd_model()
    assert_same_numbers_in_any_chunk_and_batch(model, FastStep(model, int8_dot="int8"))


def test_the_mode_is_checked_and_chosen(ckpt_dirs, monkeypatch):
    model = sluice.load(ckpt_dirs["qwen3"], quantize="int8")
    with pytest.raises(fast_step.ConfigError, match="SLUICE_INT8_DOT.*'int16'"):
        FastStep(model, int8_dot="int16")
    monkeypatch.setattr(gemv, "INT8_DOT", "fp32")
    assert FastStep(model).int8_dot == "fp32" and FastStep(model, int8_dot="int8").int8_dot == "int8"
    monkeypatch.setattr(gemv, "INT8_DOT", "int8")
    t, pos = torch.tensor([[3, 4]]), torch.tensor([[0, 1]])

    def run(step):
        cache = KVCache(model.config, 1, 8)
        with torch.inference_mode():
            return step(t, pos, cache.k, cache.v)
    outs = {m: run(FastStep(model, int8_dot=m)) for m in ("int8", "fp32")}
    assert not torch.equal(outs["int8"], outs["fp32"]) and torch.equal(run(FastStep(model)), outs["int8"])


def test_the_torch_forward_of_an_int8_linear_rounds_x_as_the_integer_dot(monkeypatch):
    """Where the engine runs the torch forward (a hook attached), gemv.FastInt8Linear rounds fp32 inputs as q8t.h
    does when the mode is "int8" (decode rows and prefill), so a hooked model decodes the native step's numbers up to
    summation order."""
    torch.manual_seed(0)
    model = nn.Sequential(Int8Linear(nn.Linear(100, 70)))  # 100 inputs: blocks of 32 padded to 128
    q = model[0]
    assert gemv.use_fast_linears(model) >= 1 and isinstance(q, gemv.FastInt8Linear)
    lin = nn.Linear(100, 70)
    with torch.no_grad():
        lin.weight.copy_(q.dequantize())
        lin.bias.copy_(q.bias)
    for rows in (3, 20):  # the decode kernel's rows and prefill's
        x = torch.randn(rows, 100)
        monkeypatch.setattr(gemv, "INT8_DOT", "int8")
        got = q(x)
        torch.testing.assert_close(got, RoundedInputLinear(lin)(x), rtol=0, atol=1e-5)
        assert (got - lin(x)).abs().max() > 1e-4  # (the rounding shows)
        monkeypatch.setattr(gemv, "INT8_DOT", "fp32")
        torch.testing.assert_close(q(x), lin(x), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_avx2_int8_dot_passes_on_an_avx512_cpu():
    """The AVX2 build (SLUICE_KERNEL_FLAGS=-mno-avx512f: 8-row tiles, maddubs with the weights' sign instead of
    VNNI) passes this file's parity and bit-for-bit tests in a subprocess."""
    run_avx2_build("fast_step", str(Path(__file__)), "(equal or same_numbers) and not avx512_cpu")
