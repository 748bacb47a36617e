"""native/q4i.h, the integer-dot mode of the native step's int4 products (gemv.INT4_DOT "int8", the default;
every chunk, decode and prefill): each activation row is rounded per block of 32 inputs to int8 (d = max|x| / 127,
a = rint(x / d), as llama.cpp's Q8_0) and code x code sums in integers.

Two references. The exact one: the dequantized model (test_fast_step_int4.py's) whose linears round their input
as q4i.h does first: what is left is fp32 summation order, so 1e-4 of the largest logit, as the fp32 products'
bound, checked on one-token chunks (in longer ones, somewhere an input can lie on a tie of the rounding that the
two sides' summation orders upstream break differently: one step of x, ~1e-2 of a logit on these models; on an
Intel Xeon a 3-token chunk of the int8 dot met one). The multi-row tiles are held to it all the same: a token's
numbers in any chunk are bit for bit its numbers decoded alone (below). The model itself: the rounding of x (up to half a step, max|x| / 254, per input) costs ~1-2% of the
largest logit on these random tiny models, so the bound against the dequantized model is 5e-2 of it (measured
up to 1.8e-2), and greedy tokens equal where the margins allow (checked: 20 tokens of two rows). A token's
numbers never depend on its batch or on how its prompt was cut into chunks (bit for bit)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chunking import assert_same_numbers_in_any_chunk_and_batch
from greedy_walk import caches_after_prompts, check_chunk, greedy_walks
from sluice.engine import fast_step, gemv
from sluice.engine.fast_step import FastStep
from sluice.engine.kv_cache import KVCache
from sluice.model.quant import Int4Linear
from test_fast_step_int4 import CASES, PROMPTS, ckpt_dirs, dequantized, load4, odd_model  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")

EXACT = 1e-4  # against the dequantized model with q4i.h's rounding of x: summation order only
MODEL = 5e-2  # against the dequantized model itself: the rounding of x to 8 bits per block of 32


class RoundedInputLinear(nn.Linear):
    """An fp32 linear that first rounds its input as q4i.h does: over the row zero-padded to `padded` inputs,
    per block of 32, a = rint(clamp(x * (127 / max|x|))), x ~ a * (max|x| / 127)."""

    def __init__(self, lin: nn.Linear, padded: int):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None)
        self.load_state_dict(lin.state_dict())
        self.padded = padded

    def forward(self, x):
        K = x.shape[-1]
        xb = F.pad(x, (0, self.padded - K)).unflatten(-1, (-1, 32))
        amax = xb.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        a = torch.round((xb * inv).clamp(-127, 127))
        return F.linear((a * (amax / 127)).flatten(-2)[..., :K], self.weight, self.bias)


def rounded(model: nn.Module) -> nn.Module:
    ref = dequantized(model)
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            parent, _, attr = name.rpartition(".")
            owner = ref.get_submodule(parent) if parent else ref
            setattr(owner, attr, RoundedInputLinear(getattr(owner, attr), 2 * m.qweight.shape[1]))
    return ref


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [1, 3, 17])  # 2, 6 and 34 token rows: tiles of 1-4 rows (and MAX_CHUNK's pieces)
def test_decode_logits_equal_the_rounded_and_the_dequantized_model(ckpt_dirs, name, T, group):
    model = load4(ckpt_dirs[name], group)
    exact, plain = rounded(model), dequantized(model)
    cache, tokens, positions, near, scale = check_chunk(model, exact, plain, PROMPTS, T, MODEL, EXACT, exact_upto=1,
                                                        int4_dot="int8")
    with torch.inference_mode():  # decode of one row alone (one token row)
        alone = FastStep(model, int4_dot="int8")(tokens[:1, -1:], positions[:1, -1:], cache.k[:, :1], cache.v[:, :1])
    assert (alone - near[:1, -1:]).abs().max() <= MODEL * scale


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied"])  # (the llamas: a row turns at token 14 of 20)
def test_greedy_tokens_equal_the_dequantized_model(ckpt_dirs, name):
    model = load4(ckpt_dirs[name], 32)
    ref = dequantized(model)
    (cache, ref_cache), pos = caches_after_prompts(model, PROMPTS, 1, int4_dot="int8")
    step = FastStep(model, int4_dot="int8")
    first = torch.tensor([PROMPTS[0][-1], PROMPTS[1][-1]])
    tokens = greedy_walks(step, ref, first, pos, cache, ref_cache)
    assert tokens["fast"] == tokens["ref"]


@pytest.mark.parametrize("group", [32, 128])
def test_a_token_has_the_same_numbers_in_any_chunk_and_batch(group):
    """Decode rows batched (3 and 8 rows) and each alone, and one row's tokens in chunks of 1, 2, 4, 1, 8, 3 and a
    chunk past MAX_CHUNK, and one at a time: bit for bit the same logits and cache."""
    model = odd_model(group)
    step = FastStep(model, int4_dot="int8")
    assert_same_numbers_in_any_chunk_and_batch(model, step)


def test_the_mode_is_checked_and_chosen(ckpt_dirs, monkeypatch):
    model = load4(ckpt_dirs["qwen3"], 32)
    with pytest.raises(fast_step.ConfigError, match="SLUICE_INT4_DOT.*'int16'"):
        FastStep(model, int4_dot="int16")
    monkeypatch.setattr(gemv, "INT4_DOT", "fp32")
    assert FastStep(model).int4_dot == "fp32" and FastStep(model, int4_dot="int8").int4_dot == "int8"
    monkeypatch.setattr(gemv, "INT4_DOT", "int8")
    t, pos = torch.tensor([[3, 4]]), torch.tensor([[0, 1]])

    def run(step):
        cache = KVCache(model.config, 1, 8)
        with torch.inference_mode():
            return step(t, pos, cache.k, cache.v)
    outs = {m: run(FastStep(model, int4_dot=m)) for m in ("int8", "fp32")}  # (2 rows: the modes differ)
    default = run(FastStep(model))
    assert not torch.equal(outs["int8"], outs["fp32"]) and torch.equal(default, outs["int8"])


def test_the_torch_forward_of_an_int4_linear_rounds_x_as_the_integer_dot(monkeypatch):
    """Where the engine runs the torch forward (a hook attached), gemv.FastInt4Linear rounds fp32 inputs as q4i.h
    does when the step's mode is "int8", so a hooked model decodes the native step's numbers up to summation order."""
    from sluice.engine import gemv
    torch.manual_seed(0)
    model = nn.Sequential(Int4Linear(nn.Linear(100, 70), group_size=64))  # 100 inputs padded to 128
    q = model[0]
    assert gemv.use_fast_linears(model) >= 1 and isinstance(q, gemv.FastInt4Linear)
    lin = nn.Linear(100, 70)
    with torch.no_grad():
        lin.weight.copy_(q.dequantize())
        lin.bias.copy_(q.bias)
    x = torch.randn(5, 100)
    monkeypatch.setattr(gemv, "INT4_DOT", "int8")
    got = q(x)
    torch.testing.assert_close(got, RoundedInputLinear(lin, 128)(x), rtol=0, atol=1e-5)
    assert (got - lin(x)).abs().max() > 1e-4  # (the rounding shows)
    monkeypatch.setattr(gemv, "INT4_DOT", "fp32")
    torch.testing.assert_close(q(x), lin(x), rtol=0, atol=1e-5)
