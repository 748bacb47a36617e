"""engine/fast_step.py (step.cpp, native/q4.h) on --quantize int4 models: per group the native step sums code x
input in fp32 and adds the group's scale and zero terms once, so its reference is the same model with every
Int4Linear replaced by an fp32 nn.Linear holding the dequantized weight (quant.int4_reference's product without
the bf16 rounding of x and y that torch's int4 op needs). Bound: 1e-4 of the largest logit, as the int8 and fp32
steps', and greedy tokens equal. Group sizes 32 and 128 (every group pads the tiny models' inputs somewhere). A
token's numbers never depend on its batch or on how its prompt was cut into chunks (bit for bit).

These are the fp32-widening products (gemv.INT4_DOT "fp32", pinned here for every test); the integer dot
that decode takes by default has its own bound: test_fast_step_int4_dot.py."""

from pathlib import Path

import pytest
import torch
from torch import nn

import sluice
from avx2_build import run_avx2_build
from ckpt import build
from greedy_walk import greedy_walks
from sluice.engine import fast_step, gemv
from sluice.engine.fast_step import FastStep, unsupported
from sluice.engine.kv_cache import KVCache
from sluice.model.quant import Int4Linear, quantize_

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")

RTOL = 1e-4
# name -> (arch, build overrides): per-head qk-norm (Qwen3), a tied head, no qk-norm and an untied head (Llama),
# biases on q/k/v (Qwen2) and on every linear (Llama with attention and MLP biases).
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
}
PROMPTS = [[1, 5, 9, 2, 7], [3, 11, 4, 6, 8, 10, 12, 13, 14]]  # rows at different positions


@pytest.fixture(autouse=True)
def fp32_products(monkeypatch):
    monkeypatch.setattr(gemv, "INT4_DOT", "fp32")


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    out = {}
    for name, (arch, over) in CASES.items():
        d = tmp_path_factory.mktemp(name)
        build(d, arch, **over)
        out[name] = d
    return out


def load4(path, group: int) -> nn.Module:
    return quantize_(sluice.load(path), "int4", group_size=group)


def dequantized(model: nn.Module) -> nn.Module:
    """The reference: a copy of the int4 model whose Int4Linears are fp32 nn.Linears of their dequantized
    weights (and the same biases), run on the plain torch path."""
    ref = type(model)(model.config)
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if "qweight" not in k and "scales" not in k},
                        strict=False)
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            parent, _, attr = name.rpartition(".")
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                lin.weight.copy_(m.dequantize())
                if m.bias is not None:
                    lin.bias.copy_(m.bias)
            setattr(ref.get_submodule(parent) if parent else ref, attr, lin)
    ref.inv_freq, ref.inv_freq_local = model.inv_freq, model.inv_freq_local
    return ref.eval().requires_grad_(False)


def prefill_both(model, ref, slots: int = 64):
    """Caches after the prompts, one row at a time: the native step's for the int4 model, the torch forward's
    for ref. Returns them and the rows' next positions."""
    caches = [KVCache(model.config, len(PROMPTS), slots) for _ in range(2)]
    step = FastStep(model)
    for b, p in enumerate(PROMPTS):
        t, pos = torch.tensor([p]), torch.arange(len(p))[None]
        with torch.inference_mode():
            step(t, pos, caches[0].k[:, b:b + 1], caches[0].v[:, b:b + 1])
            ref(t, pos, KVCache.wrap(caches[1].k[:, b:b + 1], caches[1].v[:, b:b + 1]))
    return caches, torch.tensor([len(p) for p in PROMPTS])


def test_int4_models_take_the_native_step(ckpt_dirs):
    for group in (32, 64, 128, 256):
        assert unsupported(load4(ckpt_dirs["qwen3"], group)) is None
    model = sluice.load(ckpt_dirs["qwen3"], quantize="int4")
    assert isinstance(model.lm_head, Int4Linear) and unsupported(model) is None


def test_a_bad_int4_linear_is_a_reason(ckpt_dirs):
    model = load4(ckpt_dirs["llama"], 32)
    model.layers[0].attn.q.scales_zeros = model.layers[0].attn.q.scales_zeros.float()
    assert "layers.0.attn.q.scales_zeros is torch.float32" in unsupported(model)
    model = load4(ckpt_dirs["llama"], 32)
    up = model.layers[1].mlp.up
    up.qweight = up.qweight[:, :8].contiguous()
    assert "layers.1.mlp.up.qweight has shape" in unsupported(model)
    model = load4(ckpt_dirs["llama"], 32)
    model.lm_head = Int4Linear(nn.Linear(model.config.hidden_size, model.config.vocab_size), group_size=64)
    assert "group sizes differ" in unsupported(model)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [1, 5, 17])  # decode's 16-row tiles, 4-row tiles, and a chunk widening its codes
def test_chunk_logits_and_cache_equal_the_dequantized_model(ckpt_dirs, name, T, group):
    model = load4(ckpt_dirs[name], group)
    ref = dequantized(model)
    (cache, ref_cache), pos = prefill_both(model, ref)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (len(PROMPTS), T), generator=g)
    positions = pos[:, None] + torch.arange(T)
    with torch.inference_mode():
        want = ref(tokens, positions, ref_cache)
        got = FastStep(model)(tokens, positions, cache.k, cache.v)
    scale = want.abs().max()
    assert (got - want).abs().max() <= RTOL * scale, f"logits differ by {(got - want).abs().max() / scale:.2e}"
    assert torch.allclose(cache.k, ref_cache.k, atol=1e-5) and torch.allclose(cache.v, ref_cache.v, atol=1e-5)
    with torch.inference_mode():  # decode of one row alone (M = 1: the 16-row tiles)
        alone = FastStep(model)(tokens[:1, -1:], positions[:1, -1:], cache.k[:, :1], cache.v[:, :1])
    assert (alone - want[:1, -1:]).abs().max() <= RTOL * scale


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied", "llama-bias"])
def test_greedy_tokens_equal_the_dequantized_model(ckpt_dirs, name):
    model = load4(ckpt_dirs[name], 32)
    ref = dequantized(model)
    (cache, ref_cache), pos = prefill_both(model, ref)
    with torch.inference_mode():
        first = ref(torch.tensor([PROMPTS[0][-1:], PROMPTS[1][-1:]]), pos[:, None] - 1,
                    KVCache.wrap(ref_cache.k.clone(), ref_cache.v.clone()))[:, 0].argmax(-1)
    tokens = greedy_walks(FastStep(model), ref, first, pos, cache, ref_cache)
    assert tokens["fast"] == tokens["ref"]


def odd_model(group: int, seed: int = 4):
    """hidden 44, intermediate 76, head_dim 20, vocab 50: every int4 weight is padded in rows (to a multiple of
    16) and in inputs (to a group), and the heads' 20-row products start mid-tile."""
    from test_fast_step import random_model
    return quantize_(random_model(seed=seed, hidden_size=44, intermediate_size=76, head_dim=20), "int4", group)


@pytest.mark.parametrize("group", [32, 128])
def test_padded_rows_and_inputs_equal_the_dequantized_model(group):
    model = odd_model(group)
    assert model.layers[0].mlp.down.qweight.shape == (48, group // 2 * -(-76 // group)) and unsupported(model) is None
    ref = dequantized(model)
    T = 9
    tokens = torch.randint(0, 50, (2, T + 1), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(T + 1).expand(2, T + 1)
    cache, ref_cache, step = KVCache(model.config, 2, 32), KVCache(model.config, 2, 32), FastStep(model)
    for a, b in ((0, T), (T, T + 1)):
        with torch.inference_mode():
            want = ref(tokens[:, a:b], positions[:, a:b], ref_cache)
            got = step(tokens[:, a:b], positions[:, a:b], cache.k, cache.v)
        assert (got - want).abs().max() <= RTOL * want.abs().max()
    for b in range(2):
        with torch.inference_mode():
            got = step(tokens[b:b + 1, T:], positions[b:b + 1, T:], cache.k[:, b:b + 1], cache.v[:, b:b + 1])
        assert (got - want[b:b + 1]).abs().max() <= RTOL * want.abs().max()


@pytest.mark.parametrize("group", [32, 128])
def test_a_token_has_the_same_numbers_in_any_chunk_and_batch(group):
    """Cuts that give the kernel's tiles 1, 2, 3, 4, 5 and more rows (16+: the widened codes), a chunk past
    MAX_CHUNK, and the rows of a batch each alone: bit for bit the same logits and cache."""
    model = odd_model(group)
    T = fast_step.MAX_CHUNK + 11
    tokens = torch.randint(0, 50, (3, T), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(T).expand(3, T)
    step, outs = FastStep(model), []
    for cuts in ([0, T], [0, 1, 3, 6, 10, 15, 29, T], [0, 5, 6, 13, 17, T]):
        cache = KVCache(model.config, 3, 96)
        with torch.inference_mode():
            outs.append((torch.cat([step(tokens[:, a:b], positions[:, a:b], cache.k, cache.v)
                                    for a, b in zip(cuts, cuts[1:], strict=False)], 1), cache.k, cache.v))
    for logits, k, v in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(k, outs[0][1]) and torch.equal(v, outs[0][2])
    logits, k, v = outs[0]
    for b in range(3):
        cache = KVCache(model.config, 1, 96)
        with torch.inference_mode():
            alone = torch.cat([step(tokens[b:b + 1, t:t + 1], positions[b:b + 1, t:t + 1], cache.k, cache.v)
                               for t in range(T)], 1)
        assert torch.equal(alone, logits[b:b + 1]) and torch.equal(cache.k, k[:, b:b + 1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_decodes_an_int4_model_on_the_native_step(tiny_dir, dtype):
    """LLM(quantize="int4") takes the native step (kernels auto; loaded in bf16, with its norms and embedding
    lookups in fp32: compute="auto") and never builds torch's packed copy of the codes; its greedy tokens are
    those of the same weights, dequantized, on the torch forward."""
    params = sluice.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 60))]
    llm = sluice.LLM(str(tiny_dir), dtype=dtype, quantize="int4")
    got = llm.generate(prompts, params)
    forward = llm.batch_engine().scheduler.forward
    assert forward.native_reason is None and forward.use_fast
    assert all(m._packed is None for m in llm.model.modules() if isinstance(m, Int4Linear))
    ref = sluice.LLM(str(tiny_dir), dtype=dtype, quantize="int4", kernels=False)
    ref.model = dequantized(llm.model)
    want = ref.generate(prompts, params)
    assert ref.batch_engine().scheduler.forward.native_reason is not None  # (the torch forward)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.slow
def test_the_avx2_int4_products_pass_on_an_avx512_cpu():
    """The AVX2 build (SLUICE_KERNEL_FLAGS=-mno-avx512f: q4_dot, and q4i.h's maddubs) passes this file's and
    test_fast_step_int4_dot.py's parity and bit-for-bit tests in a subprocess, as test_fast_step_int8.py checks
    the int8 products."""
    here = Path(__file__)  # and the integer dot's AVX2 form (q4i.h's maddubs)
    run_avx2_build("fast_step", [str(here), str(here.with_name("test_fast_step_int4_dot.py"))],
                   "(equal or same_numbers) and not avx512_cpu and not the_engine")


def test_the_engines_torch_forward_of_an_int4_linear_computes_in_fp32():
    """gemv.use_fast_linears makes an Int4Linear a FastInt4Linear: fp32 inputs times the dequantized weight in
    fp32 (the native step's numbers up to summation order, for a torch forward with hooks), bf16 inputs torch's
    op as before; neither builds torch's packed copy for fp32 inputs."""
    from sluice.engine import gemv
    torch.manual_seed(0)
    model = nn.Sequential(Int4Linear(nn.Linear(100, 70), group_size=32))
    q = model[0]
    x = torch.randn(5, 100)
    before = q(x.bfloat16())  # torch's op
    q._packed = None
    assert gemv.use_fast_linears(model) >= 1 and isinstance(q, gemv.FastInt4Linear) and unsupported(model) is not None
    y = q(x)
    assert q._packed is None and y.dtype == torch.float32
    torch.testing.assert_close(y, nn.functional.linear(x, q.dequantize(), q.bias), rtol=0, atol=1e-5)
    assert torch.equal(q(x.bfloat16()), before)
