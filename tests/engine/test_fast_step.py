"""engine/fast_step.py (step.cpp): the native whole-model step against sluice's plain torch forward,
which test_parity checks against transformers. After a prefill of rows of different lengths, a
chunk of T tokens per row must give the same logits (and hidden states), write the same keys and
values into the cache, and greedy decoding must pick the same tokens. Models outside what step.cpp
implements must be refused with a reason naming the feature. The other families: test_fast_step_families.py."""

import os

import pytest
import torch

import sluice
from avx2_build import run_avx2_build
from ckpt import build
from sluice.engine import fast_step, mixed
from sluice.engine.fast_step import FastStep, native_check, unsupported
from sluice.engine.kv_cache import KVCache
from sluice.engine.native import cpu_flags
from sluice.engine.runner import Runner
from sluice.model.config import ModelConfig
from sluice.model.layers import Transformer

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")

PROMPTS = [[1, 5, 9, 2, 7], [3, 11, 4, 6, 8, 10, 12, 13, 14]]  # two rows at different positions
SLOTS = 64

# name -> (arch, build overrides); every supported variation the brief lists appears once.
CASES = {
    "qwen3": ("qwen3", {}),  # per-head qk-norm, head_dim 24, GQA ratio 2
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "llama": ("llama", {}),  # untied head, no qk-norm
    "llama-mha-bias-scaled": ("llama", {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True,
                                        "rms_norm_eps": 1e-3, "random_norms": True,
                                        "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8}}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "mistral-window": ("mistral", {"sliding_window": 6}),
}


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    out = {}
    for name, (arch, over) in CASES.items():
        d = tmp_path_factory.mktemp(name)
        build(d, arch, **over)
        out[name] = d
    return out


def load(d, weights: str = "float32"):
    """The fp32 model, or (weights="bfloat16") mixed.py's mode: bf16 linear weights, fp32 compute."""
    model = sluice.load(d, dtype=weights)
    if weights == "bfloat16":
        mixed.use_fp32_compute(model)
    return model


def prefilled(model, slots: int = SLOTS):
    r = Runner(model)
    r.prefill(PROMPTS, slots)
    return r


def chunk(r, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, r.model.config.vocab_size, (len(PROMPTS), T), generator=g)
    return tokens, r.pos[:, None] + torch.arange(T)  # (B, T) each


def check_chunk(model, T: int, rtol: float = 1e-4, cache_atol: float = 1e-5):
    """cache_atol: the keys' and values' bound, absolute; a model with large weights (their ulps are larger
    than 1e-5) passes one relative to its cache's scale."""
    r = prefilled(model, max(SLOTS, 16 + T))
    tokens, positions = chunk(r, T)
    k, v = r.cache.k.clone(), r.cache.v.clone()
    with torch.inference_mode():
        want = model(tokens, positions, r.cache)  # writes the torch path's keys into r.cache
        want_h = model(tokens, positions, KVCache.wrap(r.cache.k.clone(), r.cache.v.clone()), return_hidden=True)
        got = FastStep(model)(tokens, positions, k, v)
        got_h = FastStep(model)(tokens, positions, k.clone(), v.clone(), hidden=True)
    assert got.shape == want.shape == (len(PROMPTS), T, model.config.vocab_size) and got.dtype == torch.float32
    scale = want.abs().max()
    assert (got - want).abs().max() <= rtol * scale, f"logits differ by {(got - want).abs().max() / scale:.2e}"
    assert torch.allclose(got_h, want_h, atol=rtol * want_h.abs().max())
    assert torch.allclose(k, r.cache.k, atol=cache_atol) and torch.allclose(v, r.cache.v, atol=cache_atol)
    assert (k[:, :, :, positions.max() + 1:] == 0).all()  # nothing written past the chunk


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [1, 5])
def test_chunk_logits_and_cache_equal_the_torch_path(ckpt_dirs, name, T):
    assert unsupported(load(ckpt_dirs[name])) is None
    check_chunk(load(ckpt_dirs[name]), T)


@pytest.mark.parametrize("head_dim", [20, 40, 64])
def test_chunk_logits_at_other_head_widths(head_dim):
    """Attention at head widths below, across and at whole register blocks (the AVX2 path's value pass takes 32
    channels, the AVX-512 one's 64; the scores 8 or 16 slots at a time, a short last group), against torch."""
    check_chunk(random_model(seed=7, head_dim=head_dim), 3)


@pytest.mark.parametrize("name", ["qwen3", "mistral-window"])
def test_a_chunk_past_max_chunk_runs_in_pieces_bit_for_bit(ckpt_dirs, name):
    """A prefill-sized chunk (> MAX_CHUNK, the kernel's piece) equals the torch path, and any cut of it
    into smaller calls gives exactly the same numbers: the scheduler's chunking never changes a prompt's."""
    T = 2 * fast_step.MAX_CHUNK + 21
    check_chunk(load(ckpt_dirs[name]), T)
    model = load(ckpt_dirs[name])
    r = prefilled(model, 16 + T)
    tokens, positions = chunk(r, T, seed=3)
    step, outs = FastStep(model), []
    for cuts in ([0, T], [0, 1, 37, 100, T], [0, fast_step.MAX_CHUNK - 1, T]):
        k, v = r.cache.k.clone(), r.cache.v.clone()
        outs.append((torch.cat([step(tokens[:, a:b], positions[:, a:b], k, v) for a, b in zip(cuts, cuts[1:], strict=False)], 1),
                     k, v))
    for logits, k, v in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(k, outs[0][1]) and torch.equal(v, outs[0][2])


# mixed.BF16_DOT's modes on this CPU and build: "fp32", and "bf16" where "auto" picks it (AVX512_BF16), where the
# torch path rounds each linear's input to bf16 as the native step's vdpbf16ps reads it
BF16_DOTS = sorted({"fp32", mixed.bf16_dot("auto")})


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("bf16_dot", BF16_DOTS)
def test_bf16_weights_with_fp32_compute(ckpt_dirs, name, T, bf16_dot, monkeypatch):
    monkeypatch.setattr(mixed, "BF16_DOT", bf16_dot)  # the native step and the torch path alike
    model = load(ckpt_dirs[name], "bfloat16")
    assert model.layers[0].mlp.up.weight.dtype == torch.bfloat16 and unsupported(model) is None
    check_chunk(model, T)


def test_decode_step_matches_runner_decode(ckpt_dirs):
    model = load(ckpt_dirs["qwen3"])
    r = prefilled(model)
    tokens, positions = chunk(r, 1)
    k, v = r.cache.k.clone(), r.cache.v.clone()
    with torch.inference_mode():
        want = r._decode(tokens, positions, r.cache.k, r.cache.v)  # (B, V)
    got = FastStep(model)(tokens, positions, k, v)[:, 0]
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max())


@pytest.mark.parametrize("name", ["qwen3", "mistral-window"])
def test_greedy_generation_is_the_same(ckpt_dirs, name):
    model = load(ckpt_dirs[name])
    fast, ref = prefilled(model), prefilled(model)
    step = FastStep(model)
    last = None
    tokens = {"fast": [], "ref": []}
    with torch.inference_mode():
        first = model(torch.tensor([PROMPTS[0][-1:], PROMPTS[1][-1:]]), ref.pos[:, None] - 1, KVCache.wrap(
            ref.cache.k.clone(), ref.cache.v.clone()))[:, 0]
        for key, r in (("fast", fast), ("ref", ref)):
            last = first.argmax(-1)
            for _ in range(20):  # 20 new tokens, past the window of 6 for mistral
                pos = r.pos[:, None]
                out = step(last[:, None], pos, r.cache.k, r.cache.v)[:, 0] if key == "fast" else \
                    r._decode(last[:, None], pos, r.cache.k, r.cache.v)
                r.pos += 1
                last = out.argmax(-1)
                tokens[key].append(last.tolist())
    assert tokens["fast"] == tokens["ref"]
    assert torch.allclose(fast.cache.k, ref.cache.k, atol=1e-4)


def random_model(seed: int = 0, **fields) -> Transformer:
    """A sluice model with a non-default value of config fields transformers has no tiny switch for."""
    cfg = ModelConfig(**{**dict(vocab_size=50, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, max_position_embeddings=128, qk_norm="head"), **fields})
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(seed)
    model.init_weights(std=0.2, generator=g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("fields", [{"rotary_dim": 8}, {"attn_scale": 0.3}, {"final_norm": False},
                                    {"norm_offset": 1.0, "norm_gain_fp32": True},
                                    {"sliding_window": 3, "layer_types": ("sliding", "full")},
                                    {"rope_theta": 50.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}])
def test_config_fields_with_non_default_values(fields):
    model = random_model(**fields)
    assert unsupported(model) is None
    check_chunk(model, 4)


@pytest.mark.parametrize("weights", ["float32", "bfloat16"] + [f"bfloat16-{d}" for d in BF16_DOTS if d != "fp32"])
def test_odd_sizes_give_a_token_the_same_numbers_in_any_chunk(weights, monkeypatch):
    """hidden 44, intermediate 76, head_dim 20: most products end in a scalar tail of 12 (K % 16). A chunk cut
    so that the kernel's tiles take 1, 2, 3, 4, 5 and more rows gives bit for bit one call's logits
    and cache (the scheduler cuts prompts wherever its token budget ends)."""
    model = random_model(seed=4, hidden_size=44, intermediate_size=76, head_dim=20)
    monkeypatch.setattr(mixed, "BF16_DOT", weights.partition("-")[2] or "fp32")
    if weights.startswith("bfloat16"):  # mixed.py's mode: bf16 linear weights, everything else fp32
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.to(torch.bfloat16)
        assert mixed.use_fp32_compute(model) > 0
    T = 60
    tokens = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(T)[None]
    outs = []
    # (cuts of one token take the decode tiles, in either order they read their rows: fast_step.DECODE_ORDERS)
    for order in fast_step.DECODE_ORDERS:
        step = FastStep(model, decode_order=order)
        for cuts in ([0, T], [0, 1, 3, 6, 10, 15, 29, T], [0, 5, 6, 13, 17, T], [0, *range(40, T + 1)]):
            cache = KVCache(model.config, 1, 64)
            with torch.inference_mode():
                outs.append((torch.cat([step(tokens[:, a:b], positions[:, a:b], cache.k, cache.v)
                                        for a, b in zip(cuts, cuts[1:], strict=False)], 1), cache.k, cache.v))
    for logits, k, v in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(k, outs[0][1]) and torch.equal(v, outs[0][2])


def test_an_unknown_decode_order_is_refused_by_name(ckpt_dirs, monkeypatch):
    model = load(ckpt_dirs["qwen3"])
    with pytest.raises(sluice.ConfigError, match="decode_order.*rows, interleaved.*'zigzag'"):
        FastStep(model, decode_order="zigzag")
    monkeypatch.setattr(fast_step, "DECODE_ORDER", "Rows")
    with pytest.raises(sluice.ConfigError, match="SLUICE_DECODE_ORDER.*'Rows'"):
        FastStep(model)


def test_a_chunk_is_causal_within_itself(ckpt_dirs):
    """Token t of a chunk sees tokens < t of the same chunk, and nothing after: the logits of a
    chunk's prefix do not depend on what follows it."""
    model = load(ckpt_dirs["qwen3"])
    r = prefilled(model)
    tokens, positions = chunk(r, 6)
    step = FastStep(model)
    full = step(tokens, positions, r.cache.k.clone(), r.cache.v.clone())
    head = step(tokens[:, :3], positions[:, :3], r.cache.k.clone(), r.cache.v.clone())
    assert torch.allclose(full[:, :3], head, atol=1e-5)
    assert not torch.allclose(full[:, 3:], step(tokens[:, 3:], positions[:, 3:], r.cache.k.clone(),
                                                r.cache.v.clone()), atol=1e-3)


def test_hooks_quantized_linears_and_bf16_activations_are_refused(ckpt_dirs):
    model = load(ckpt_dirs["qwen3"])
    handle = model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert "hook" in unsupported(model) and "layers.1.mlp" in unsupported(model)
    handle.remove()
    handle = model.layers[0].attn_norm.register_forward_pre_hook(lambda *a: None)
    assert "hook" in unsupported(model)
    handle.remove()
    assert unsupported(model) is None
    quantized = sluice.load(ckpt_dirs["qwen3"], quantize="int4")  # int8 and int4 run: test_fast_step_int8/int4
    quantized.layers[0].mlp.up.__class__ = type("CustomQuantLinear", (type(quantized.layers[0].mlp.up),), {})
    assert "CustomQuantLinear" in unsupported(quantized)
    assert "activations are torch.bfloat16" in unsupported(sluice.load(ckpt_dirs["qwen3"], dtype="bfloat16"))
    fast = FastStep(model)
    model.final_softcap = 30.0  # surgery sets these attributes live; the config alone is not enough
    assert unsupported(model) is None and not fast.current() and native_check(model, fast)[1] is not fast


def test_bad_inputs_give_clear_errors(ckpt_dirs):
    model = load(ckpt_dirs["qwen3"])
    r = prefilled(model)
    step = FastStep(model)
    tokens, positions = chunk(r, 1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        step(tokens, positions + SLOTS, r.cache.k, r.cache.v)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        step(tokens + 1000, positions, r.cache.k, r.cache.v)
    with pytest.raises(RuntimeError, match="cache"):
        step(tokens, positions, r.cache.k[:, :1], r.cache.v[:, :1])


def test_a_missing_kernel_is_a_reason(ckpt_dirs, monkeypatch):
    monkeypatch.setenv("SLUICE_NO_KERNELS", "1")
    monkeypatch.setattr(fast_step, "_EXT", fast_step.NativeExtension(fast_step._EXT.source, "whole-step CPU kernel"))
    assert "SLUICE_NO_KERNELS" in unsupported(load(ckpt_dirs["qwen3"]))


@pytest.mark.slow
def test_the_avx2_products_are_built_and_pass_on_an_avx512_cpu():
    """Which product path runs depends on the CPU (step.cpp's AVX-512 tiles, else AVX2's dot_NxM), and
    machines differ. On an AVX-512 CPU the default build must use the tiles, and the AVX2 path is built
    too (SLUICE_KERNEL_FLAGS=-mno-avx512f, about a minute) and checked in a subprocess: torch parity,
    greedy tokens and a token's bits in any chunk. On an AVX2-only CPU the tests above run that path."""
    if "avx512f" in cpu_flags() and not os.environ.get("SLUICE_KERNEL_FLAGS"):
        assert fast_step.kernel().has_avx512()
    run_avx2_build("fast_step", __file__, "(odd_sizes or chunk_logits or greedy or bf16_weights) and not avx512_cpu")
