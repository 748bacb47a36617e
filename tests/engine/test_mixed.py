"""engine/mixed.py: bf16 weights with fp32 compute, against an fp32 model of the same bf16-rounded
weights (the numbers that mode promises), on prefill, decode rows and greedy generation; in the bf16 dot mode
(mixed.BF16_DOT "bf16", the default's choice on a CPU with AVX512_BF16) one whose linears round x to bf16 too."""

import pytest
import torch

import sluice
from sluice.engine import gemv, mixed, sample
from sluice.engine import cpu_paths
from sluice.errors import ConfigError

pytestmark = pytest.mark.skipif(not gemv.available(), reason="needs sluice's CPU kernel")


# the modes whose torch path runs here (rounding x needs no bf16 instructions), and those the LLM's native step has
DOTS = ["fp32", "bf16"]
NATIVE_DOTS = sorted({"fp32", mixed.bf16_dot("auto")})


def rounded_fp32(tiny_dir, bf16_dot: str = "fp32", model=None):
    """The reference: the fp32 model whose every weight is rounded to bf16 first; with bf16_dot "bf16", whose
    linears also round their input to bf16."""
    model = model or sluice.load(tiny_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    if bf16_dot == "bf16":
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(), *args[1:]))
    return model


@pytest.mark.parametrize("bf16_dot", DOTS)
def test_forward_equals_fp32_of_the_rounded_weights(tiny_dir, monkeypatch, bf16_dot):
    monkeypatch.setattr(mixed, "BF16_DOT", bf16_dot)
    monkeypatch.setattr(gemv, "PREFILL_BLOCK_BYTES", 4 * 64 * 20)  # 20 rows per block: many blocks
    model = sluice.load(tiny_dir, dtype="bfloat16")
    n = mixed.use_fp32_compute(model)
    assert n == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) and n > 0
    assert mixed.activation_dtype(model) == torch.float32
    assert model.embed.weight.dtype == torch.bfloat16  # tables stay bf16
    assert all(p.dtype == torch.float32 for name, p in model.named_parameters() if "norm" in name)
    ref = rounded_fp32(tiny_dir, bf16_dot)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10, 12]])
    with torch.inference_mode():
        got, want = model(ids), ref(ids)  # prefill rows: fp32 GEMMs on blocks of W
        assert got.dtype == torch.float32
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        one, one_ref = model(ids[:, :1]), ref(ids[:, :1])  # a decode row: the kernel
        assert torch.allclose(one, one_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bf16_dot", NATIVE_DOTS)
def test_llm_compute_float32_generates_what_the_rounded_fp32_model_does(tiny_dir, monkeypatch, bf16_dot):
    monkeypatch.setattr(mixed, "BF16_DOT", bf16_dot)
    params = sluice.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    llm = sluice.LLM(tiny_dir, dtype="bfloat16", compute="float32")
    assert isinstance(llm.model.layers[0].mlp.up, mixed.Bf16WeightLinear)
    ref = sluice.LLM(tiny_dir, kernels=False)
    rounded_fp32(tiny_dir, bf16_dot, ref.model)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [o.token_ids for o in ref.generate(prompts, params)]
    # the fused head composes with this mode: "auto" takes it for filtered rows where the native batch
    # sampler is missing (with it, the plain head is the faster one: fused_head.params_want_fused)
    monkeypatch.setattr(sample, "kernel", lambda: None)
    sampled = llm.generate(prompts, sluice.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1))
    assert llm.last_stats.fused_head_steps > 0 and all(len(o.token_ids) > 0 for o in sampled)


def test_auto_picks_fp32_compute_only_without_bf16_instructions_and_past_the_size(tiny_dir, monkeypatch):
    monkeypatch.setattr(cpu_paths, "native_step_fits", lambda model, device: False)  # the GEMV rule alone
    monkeypatch.setattr(cpu_paths, "AUTO_KERNEL_BYTES", 0)
    monkeypatch.setattr(cpu_paths, "cpu_has_bf16", lambda: False)
    assert mixed.activation_dtype(sluice.LLM(tiny_dir, dtype="bfloat16").model) == torch.float32
    monkeypatch.setattr(cpu_paths, "cpu_has_bf16", lambda: True)  # AVX-512-bf16 / AMX: bf16 it is
    assert mixed.activation_dtype(sluice.LLM(tiny_dir, dtype="bfloat16").model) == torch.bfloat16
    monkeypatch.setattr(cpu_paths, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(cpu_paths, "AUTO_KERNEL_BYTES", 2**40)  # a small model keeps plain bf16
    assert mixed.activation_dtype(sluice.LLM(tiny_dir, dtype="bfloat16").model) == torch.bfloat16
    monkeypatch.setattr(cpu_paths, "AUTO_KERNEL_BYTES", 0)
    llm = sluice.LLM(tiny_dir, dtype="bfloat16", compute="bfloat16")
    assert not any(isinstance(m, mixed.Bf16WeightLinear) for m in llm.model.modules())
    assert mixed.activation_dtype(sluice.LLM(tiny_dir, dtype="bfloat16", kernels=False).model) == torch.bfloat16


def test_auto_picks_fp32_compute_where_the_native_step_runs_the_model(tiny_dir, monkeypatch):
    """Small or not, bf16 CPU or not: the native whole step (fp32 activations) beats the torch step."""
    monkeypatch.setattr(cpu_paths, "AUTO_KERNEL_BYTES", 2**40)
    monkeypatch.setattr(cpu_paths, "cpu_has_bf16", lambda: True)
    llm = sluice.LLM(tiny_dir, dtype="bfloat16")
    assert mixed.activation_dtype(llm.model) == torch.float32
    llm.generate("hello", sluice.SamplingParams(max_tokens=3, temperature=0))
    sched = llm.batch_engine().scheduler.forward
    assert sched.native and sched.native_reason is None and sched.fast is not None
    llm = sluice.LLM(tiny_dir, dtype="bfloat16", kernels=False)  # no native code at all: plain bf16
    assert mixed.activation_dtype(llm.model) == torch.bfloat16
    llm.generate("hello", sluice.SamplingParams(max_tokens=3, temperature=0))
    sched = llm.batch_engine().scheduler.forward
    assert sched.fast is None and sched.native_reason == "not asked for"


@pytest.mark.parametrize("kwargs,words", [
    (dict(compute="fp16"), "compute must be one of auto, float32, bfloat16, got 'fp16'"),
    (dict(compute="bfloat16"), "needs bf16 weights"),
    (dict(dtype="bfloat16", compute="float32", kernels=False), "needs sluice's CPU decode kernel"),
])
def test_bad_compute_requests_are_refused(tiny_dir, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        sluice.LLM(tiny_dir, **kwargs)


def test_bf16_instructions_are_read_from_the_cpu_flags(monkeypatch):
    for flags, has in (({"avx2", "fma"}, False), ({"avx2", "avx512_bf16"}, True), ({"amx_bf16"}, True)):
        monkeypatch.setattr(gemv, "cpu_flags", lambda flags=flags: flags)
        assert mixed.cpu_has_bf16() is has
