"""engine/fast_step.py (step.cpp) on --quantize int8 models, in the fp32-widening mode (gemv.INT8_DOT "fp32", pinned
here for every test; the integer dot that is the default has its own bound: test_fast_step_int8_dot.py): the native
step multiplies by the int8 codes in fp32 and scales each row's sum once, so its reference is the same model with
every Int8Linear replaced by an fp32 nn.Linear holding the dequantized weight (quant.int8_reference's product without its bf16 rounding of x and y,
which torch's int8 op needs and step.cpp does not). Bound: 1e-4 of the largest logit, as the fp32 step's
against the torch path (test_fast_step.py), and greedy tokens equal. A token's numbers never depend on its
batch or on how its prompt was cut into chunks (bit for bit). int4: test_fast_step_int4.py."""


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
from sluice.model.quant import Int8Linear, quantize_

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
    monkeypatch.setattr(gemv, "INT8_DOT", "fp32")


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    out = {}
    for name, (arch, over) in CASES.items():
        d = tmp_path_factory.mktemp(name)
        build(d, arch, **over)
        out[name] = d
    return out


def dequantized(model: nn.Module) -> nn.Module:
    """The reference: a copy of the int8 model whose Int8Linears are fp32 nn.Linears of their dequantized
    weights (and the same biases), run on the plain torch path."""
    ref = type(model)(model.config)
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if "qweight" not in k and "scales" not in k},
                        strict=False)
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
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
    """Caches after the prompts, one row at a time (rows of different lengths): the native step's for the int8
    model, the torch forward's for ref. Returns them and the rows' next positions."""
    caches = [KVCache(model.config, len(PROMPTS), slots) for _ in range(2)]
    step = FastStep(model)
    for b, p in enumerate(PROMPTS):
        t, pos = torch.tensor([p]), torch.arange(len(p))[None]
        with torch.inference_mode():  # both write through views of row b into the caches
            step(t, pos, caches[0].k[:, b:b + 1], caches[0].v[:, b:b + 1])
            ref(t, pos, KVCache.wrap(caches[1].k[:, b:b + 1], caches[1].v[:, b:b + 1]))
    return caches, torch.tensor([len(p) for p in PROMPTS])


def test_int8_models_take_the_native_step_and_other_quantized_linears_are_refused(ckpt_dirs):
    model = sluice.load(ckpt_dirs["qwen3"], quantize="int8")
    assert isinstance(model.layers[0].mlp.up, Int8Linear) and unsupported(model) is None
    gemv.use_fast_linears(model)  # the engine's kernels swap in a subclass with the same buffers
    assert isinstance(model.lm_head, gemv.FastInt8Linear) and unsupported(model) is None
    model.lm_head.__class__ = type("OtherQuantLinear", (Int8Linear,), {})  # a scheme step.cpp does not know
    why = unsupported(model)
    assert "OtherQuantLinear" in why and "torch path" in why
    assert "activations are torch.bfloat16" in unsupported(sluice.load(ckpt_dirs["qwen3"], dtype="bfloat16",
                                                                       quantize="int8"))


def test_an_int8_weight_of_the_wrong_shape_or_dtype_is_a_reason(ckpt_dirs):
    model = sluice.load(ckpt_dirs["llama"], quantize="int8")
    up = model.layers[1].mlp.up
    up.qweight = up.qweight[:, :8].contiguous()
    assert "layers.1.mlp.up.qweight has shape" in unsupported(model)
    model = sluice.load(ckpt_dirs["llama"], quantize="int8")
    model.layers[0].attn.q.scales = model.layers[0].attn.q.scales.half()
    assert "layers.0.attn.q.scales is torch.float16" in unsupported(model)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [1, 5])
def test_chunk_logits_and_cache_equal_the_dequantized_model(ckpt_dirs, name, T):
    model = sluice.load(ckpt_dirs[name], quantize="int8")
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


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied", "llama-bias"])
def test_greedy_tokens_equal_the_dequantized_model(ckpt_dirs, name):
    model = sluice.load(ckpt_dirs[name], quantize="int8")
    ref = dequantized(model)
    (cache, ref_cache), pos = prefill_both(model, ref)
    with torch.inference_mode():
        first = ref(torch.tensor([PROMPTS[0][-1:], PROMPTS[1][-1:]]), pos[:, None] - 1,
                    KVCache.wrap(ref_cache.k.clone(), ref_cache.v.clone()))[:, 0].argmax(-1)
    tokens = greedy_walks(FastStep(model), ref, first, pos, cache, ref_cache)
    assert tokens["fast"] == tokens["ref"]


def odd_model(seed: int = 4):
    """hidden 44, intermediate 76, head_dim 20: every int8 weight row is padded (to 48, 80, 64 codes), and most
    products end in a scalar tail of 12 inputs (K % 16)."""
    from test_fast_step import random_model
    return quantize_(random_model(seed=seed, hidden_size=44, intermediate_size=76, head_dim=20), "int8")


def test_padded_rows_equal_the_dequantized_model():
    model = odd_model()
    assert model.layers[0].mlp.down.qweight.shape == (44, 80) and unsupported(model) is None
    ref = dequantized(model)
    T = 9
    tokens = torch.randint(0, 50, (2, T + 1), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(T + 1).expand(2, T + 1)
    cache, ref_cache, step = KVCache(model.config, 2, 32), KVCache(model.config, 2, 32), FastStep(model)
    for a, b in ((0, T), (T, T + 1)):  # a chunk (tiles of several rows), then one token per row (decode's tiles)
        with torch.inference_mode():
            want = ref(tokens[:, a:b], positions[:, a:b], ref_cache)
            got = step(tokens[:, a:b], positions[:, a:b], cache.k, cache.v)
        assert (got - want).abs().max() <= RTOL * want.abs().max()
    for b in range(2):  # decode of one row alone: M = 1, one 16-row tile per weight block
        with torch.inference_mode():
            got = step(tokens[b:b + 1, T:], positions[b:b + 1, T:], cache.k[:, b:b + 1], cache.v[:, b:b + 1])
        assert (got - want[b:b + 1]).abs().max() <= RTOL * want.abs().max()


def test_a_token_has_the_same_numbers_in_any_chunk_and_batch():
    """Cuts that give the kernel's tiles 1, 2, 3, 4, 5 and more rows, a chunk past MAX_CHUNK, and the rows of
    a batch each alone: bit for bit the same logits and cache."""
    model = odd_model()
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
    # decode: each row alone, one token at a time, against the batch of 3 rows
    logits, k, v = outs[0]
    for b in range(3):
        cache = KVCache(model.config, 1, 96)
        with torch.inference_mode():
            alone = torch.cat([step(tokens[b:b + 1, t:t + 1], positions[b:b + 1, t:t + 1], cache.k, cache.v)
                               for t in range(T)], 1)
        assert torch.equal(alone, logits[b:b + 1]) and torch.equal(cache.k, k[:, b:b + 1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_decodes_an_int8_model_on_the_native_step(tiny_dir, dtype):
    """LLM(quantize="int8") takes the native step (kernels auto; loaded in bf16, with its norms and embedding
    lookups in fp32: compute="auto"), and its greedy tokens are those of the same weights on the torch forward
    with sluice's int8 kernels (kernels=True: fp32 products of x with the dequantized weight, the native
    step's arithmetic up to summation order)."""
    params = sluice.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 60))]
    llm = sluice.LLM(str(tiny_dir), dtype=dtype, quantize="int8")
    got = llm.generate(prompts, params)
    forward = llm.batch_engine().scheduler.forward
    assert forward.native_reason is None and forward.use_fast
    ref = sluice.LLM(str(tiny_dir), dtype=dtype, quantize="int8", kernels=True)
    handle = ref.model.layers[0].register_forward_hook(lambda *a: None)  # the torch forward, with the kernels
    try:
        want = ref.generate(prompts, params)
    finally:
        handle.remove()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.slow
def test_the_avx2_int8_products_pass_on_an_avx512_cpu():
    """The AVX2 build (SLUICE_KERNEL_FLAGS=-mno-avx512f: dot_NxM with int8 loads) passes this file's parity and
    bit-for-bit tests in a subprocess, as test_fast_step.py checks the float paths."""
    run_avx2_build("fast_step", __file__, "(equal or same_numbers) and not avx512_cpu and not the_engine")
