"""native/b16.h's bf16 dot mode of the native step's bf16-weight products (mixed.BF16_DOT "bf16", what "auto", the
default, picks where the CPU has AVX512_BF16; every chunk, decode and prefill): each activation row rounded to bf16
(to nearest even), pairs of exact bf16 x bf16 products summed into fp32 lanes by vdpbf16ps. Elsewhere asking for
it is an error. The torch path in this mode (mixed.Bf16WeightLinear) rounds each linear's input the same way.

Two references. The exact one: the same model whose linears round their input to bf16 first (torch's
.to(bfloat16), to nearest even): what is left is fp32 summation order, so 1e-4 of the largest logit, as the fp32
products' bound, on one-token chunks (in longer ones, somewhere an input can lie so near a rounding boundary of
bf16 that the two sides' summation orders upstream round it differently; on an Intel Xeon a 3-token chunk met
one). The multi-row tiles are held to it all the same: a token's numbers in any chunk and batch are bit for bit its
numbers decoded alone (test_a_token_has_the_same_numbers_in_any_chunk_and_batch). The model itself: rounding x (half
a bf16 step, 2^-9 relative, per input) costs a few 1e-3 of the largest logit on these random tiny models, so the
bound is 2e-2 of it. A token's numbers never depend on its batch or on how its prompt was cut (bit for bit)."""

import copy
import os

import pytest
import torch
from torch import nn

from chunking import assert_same_numbers_in_any_chunk_and_batch
from sluice.engine import fast_step, mixed
from sluice.engine.fast_step import FastStep
from sluice.engine.kv_cache import KVCache
from test_fast_step import random_model

pytestmark = pytest.mark.skipif(fast_step.kernel() is None or not fast_step.kernel().has_bf16_dot(),
                                reason="needs the whole-step CPU kernel on a CPU with AVX512_BF16")

EXACT = 1e-4  # against the model whose linears round x to bf16: summation order only
MODEL = 2e-2  # against the model itself: the rounding of x to bf16


def bf16_model(seed: int = 0, **fields) -> nn.Module:
    """mixed.py's mode over random_model: bf16 linear weights, everything else fp32."""
    model = random_model(seed=seed, **fields)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.to(torch.bfloat16)
    assert mixed.use_fp32_compute(model) > 0
    return model


def rounded(model: nn.Module) -> nn.Module:
    """A copy whose linears first round their fp32 input to bf16, as b16.h's dot mode does (the torch path)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).float(), *args[1:]))
    return ref


@pytest.mark.parametrize("fields", [{}, {"hidden_size": 44, "intermediate_size": 76, "head_dim": 20}])
@pytest.mark.parametrize("T", [1, 3, 40])  # 2, 6 and 80 token rows: the 16-row decode tile, 4 x 4 tiles, passes
def test_logits_equal_the_rounded_and_the_plain_model(fields, T, monkeypatch):
    monkeypatch.setattr(mixed, "BF16_DOT", "fp32")  # the torch references: the rounding only where the hooks do it
    model = bf16_model(**fields)
    exact, B = rounded(model), 2
    tokens = torch.randint(0, 50, (B, 5 + T), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5 + T).expand(B, -1)
    caches = [KVCache(model.config, B, 64) for _ in range(3)]
    step = FastStep(model, bf16_dot="bf16")
    with torch.inference_mode():
        for a, b in ((0, 5), (5, 5 + T)):  # a prompt, then the chunk under test
            want = exact(tokens[:, a:b], positions[:, a:b], caches[0])
            near = model(tokens[:, a:b], positions[:, a:b], caches[1])
            got = step(tokens[:, a:b], positions[:, a:b], caches[2].k, caches[2].v)
    scale = want.abs().max()
    assert (got - near).abs().max() <= MODEL * scale, f"{(got - near).abs().max() / scale:.2e} off the model"
    assert (got - near).abs().max() > 1e-5 * scale  # (the rounding shows: this is not the fp32 mode)
    if T == 1:  # (longer chunks: a rounding boundary that the summation order upstream can flip, see above)
        assert (got - want).abs().max() <= EXACT * scale, f"{(got - want).abs().max() / scale:.2e} off the rounded model"
        assert torch.allclose(caches[2].k, caches[0].k, atol=1e-5 * caches[0].k.abs().max())


def test_a_token_has_the_same_numbers_in_any_chunk_and_batch():
    """Odd sizes (most products end in a tail of K % 32 = 12 or 16). One row's tokens in chunks of 1, 2, 4, 1, 8, 3,
    a chunk past MAX_CHUNK, and one at a time; decode rows batched (3 and 8 rows) and each alone: bit for bit the
    same logits and cache."""
    model = bf16_model(seed=4, hidden_size=44, intermediate_size=76, head_dim=20)
    step = FastStep(model, bf16_dot="bf16")
    assert_same_numbers_in_any_chunk_and_batch(model, step)


@pytest.mark.parametrize("T", [1, 3, 70])  # 70 > gemv.MAX_ROWS rows: the prefill's blocked GEMM
def test_the_torch_path_rounds_x_in_the_dot_mode(T, monkeypatch):
    """mixed.Bf16WeightLinear with BF16_DOT "bf16" is, bit for bit, the fp32 mode over inputs rounded to bf16
    (decode rows through gemv, prefill rows through blocked_linear), and differs from the fp32 mode."""
    monkeypatch.setattr(mixed.gemv, "PREFILL_BLOCK_BYTES", 4 * 32 * 20)  # 20 rows per block: many blocks
    model = bf16_model(seed=2)
    tokens = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(3))

    def run(m, mode):
        monkeypatch.setattr(mixed, "BF16_DOT", mode)
        with torch.inference_mode():
            return m(tokens, torch.arange(T).expand(2, -1), KVCache(model.config, 2, 80))
    got = run(model, "bf16")
    assert torch.equal(got, run(rounded(model), "fp32"))
    assert not torch.equal(got, run(model, "fp32"))


def test_the_mode_is_checked_and_chosen(monkeypatch):
    model = bf16_model()
    with pytest.raises(fast_step.ConfigError, match="SLUICE_BF16_DOT.*'fp16'"):
        FastStep(model, bf16_dot="fp16")
    assert mixed.BF16_DOT == os.environ.get("SLUICE_BF16_DOT", "auto") and mixed.bf16_dot("auto") == "bf16"
    monkeypatch.setattr(mixed, "BF16_DOT", "auto")  # the default: this CPU and build have AVX512_BF16
    assert FastStep(model).bf16_dot == "bf16" and mixed.bf16_dot() == "bf16"
    monkeypatch.setattr(mixed, "BF16_DOT", "bf16")
    assert FastStep(model).bf16_dot == "bf16" and FastStep(model, bf16_dot="fp32").bf16_dot == "fp32"
    t, pos = torch.tensor([[3, 4]]), torch.tensor([[0, 1]])

    def run(step):
        cache = KVCache(model.config, 1, 8)
        with torch.inference_mode():
            return step(t, pos, cache.k, cache.v)
    assert torch.equal(run(FastStep(model)), run(FastStep(model, bf16_dot="bf16")))
    assert not torch.equal(run(FastStep(model, bf16_dot="bf16")), run(FastStep(model, bf16_dot="fp32")))
    real = fast_step.kernel()

    class NoBf16:  # the kernel as built on a CPU without AVX512_BF16
        def __getattr__(self, name):
            return (lambda: False) if name == "has_bf16_dot" else getattr(real, name)
    monkeypatch.setattr(fast_step, "kernel", NoBf16)
    with pytest.raises(fast_step.ConfigError, match="AVX512_BF16"):
        FastStep(model)
    assert FastStep(model, bf16_dot="auto").bf16_dot == "fp32"  # auto never asks for what the build lacks


def test_auto_follows_the_cpu_flags_and_the_build_flags(monkeypatch):
    """AVX512_BF16 in the CPU's flags and not taken away by SLUICE_KERNEL_FLAGS: "bf16"; else "fp32"."""
    cases = (({"avx2", "avx512f", "avx512_bf16"}, "", "bf16"), ({"avx2", "fma"}, "", "fp32"),
             ({"avx2", "avx512f", "avx512_bf16"}, "-mno-avx512f", "fp32"), ({"avx512_bf16"}, "-mno-avx512bf16", "fp32"))
    try:
        for flags, build_flags, want in cases:
            monkeypatch.setattr(mixed.gemv, "cpu_flags", lambda flags=flags: flags)
            monkeypatch.setenv("SLUICE_KERNEL_FLAGS", build_flags)
            mixed.auto_bf16_dot.cache_clear()
            assert mixed.bf16_dot("auto") == want, (flags, build_flags)
            assert mixed.bf16_dot("fp32") == "fp32" and mixed.bf16_dot("bf16") == "bf16"
    finally:
        monkeypatch.undo()
        mixed.auto_bf16_dot.cache_clear()
