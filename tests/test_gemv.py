"""sluice's batch-1 CPU kernel (engine/gemv.cpp) against F.linear, and the engine path that uses it."""

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice.engine import gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason=f"kernel unavailable: {gemv.why_unavailable()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("N,K", [(1, 16), (777, 1000), (64, 4099), (130, 7)])
def test_gemv_matches_fp32_reference(dtype, rows, N, K):
    g = torch.Generator().manual_seed(N * K + rows)
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())  # exact products of the stored values
    y = gemv.gemv(x, w, None, b)
    assert y.dtype == dtype and y.shape == (rows, N)
    # fp32 accumulation over K terms; bf16 output rounds to 8 bits of mantissa
    tol = 2e-4 * K ** 0.5 if dtype == torch.float32 else 1e-2 * ref.abs().max().item() + 1e-3 * K ** 0.5
    assert (y.double() - ref).abs().max().item() < tol
    y0 = gemv.gemv(x, w, None, None)
    assert torch.allclose(y0.double(), F.linear(x.double(), w.double()), atol=tol, rtol=0)


def test_gemv_int8_with_row_scales():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (300, 517), generator=g, dtype=torch.int8)
    s = torch.rand(300, generator=g) / 100
    x = torch.randn(2, 517, generator=g)
    ref = F.linear(x.double(), q.double() * s.double()[:, None])
    assert (gemv.gemv(x, q, s, None).double() - ref).abs().max().item() < 1e-4


def test_gemv_rejects_misuse():
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        gemv.gemv(torch.randn(9, 16), torch.randn(4, 16), None, None)
    with pytest.raises(RuntimeError, match="per-row scale"):
        gemv.gemv(torch.randn(1, 16), torch.zeros(4, 16, dtype=torch.int8), None, None)


def test_fast_linear_keeps_module_and_sends_prefill_to_f_linear(tiny_dir):
    model = sluice.load(tiny_dir)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10]])  # 11 tokens: prefill rows > MAX_ROWS
    with torch.inference_mode():
        before, before1 = model(ids), model(ids[:, :1])
    q = model.layers[0].attn.q
    n = gemv.use_fast_linears(model)
    assert n == sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear)) and n > 0
    assert model.layers[0].attn.q is q and isinstance(q, gemv.FastLinear)
    with torch.inference_mode():
        with torch.profiler.profile() as prof:
            assert torch.equal(model(ids), before)  # prefill: still F.linear, bit-identical
        assert not [e for e in prof.events() if e.name == "sluice::gemv"]
        with torch.profiler.profile() as prof:
            one = model(ids[:, :1])  # a decode step of 1 row: the kernel
            two = model(ids[0, :2].reshape(2, 1))  # and of 2 rows
        calls = [e for e in prof.events() if e.name == "sluice::gemv"]
    assert len(calls) == 2 * n
    ref = sluice.load(tiny_dir)
    with torch.inference_mode():
        assert torch.allclose(one, before1, atol=1e-4, rtol=0)
        assert torch.allclose(two, ref(ids[0, :2].reshape(2, 1)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("compile", [False, True])
def test_llm_with_kernels_matches_plain_greedy(tiny_dir, compile):
    """The engine's decode with the kernel (eager and torch.compile'd) picks the plain engine's tokens."""
    params = sluice.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    plain = sluice.LLM(tiny_dir, kernels=False).generate(prompts, params)
    fast_llm = sluice.LLM(tiny_dir, kernels=True, compile=compile)
    fast = fast_llm.generate(prompts, params)
    assert fast_llm.kernels_in_use > 0
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]


def test_auto_kernels_at_batch_1_only_past_the_size_threshold(tiny_dir, monkeypatch):
    """kernels="auto" on a model whose linear weights pass AUTO_KERNEL_BYTES (weights from DRAM): the
    first batch-1 request swaps the linears, and its tokens are the plain engine's."""
    from sluice.engine import cpu_paths
    params = sluice.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = sluice.LLM(tiny_dir)
    linear_bytes = sum(m.weight.nbytes for m in llm.model.modules() if type(m) is torch.nn.Linear)
    monkeypatch.setattr(cpu_paths, "AUTO_KERNEL_BYTES", linear_bytes + 1)
    llm.generate([[1, 2, 3]], params)
    assert llm.kernels_in_use == 0  # one byte short: F.linear stays
    monkeypatch.setattr(cpu_paths, "AUTO_KERNEL_BYTES", linear_bytes)
    out = llm.generate([[1, 2, 3]], params)
    assert llm.kernels_in_use > 0 and isinstance(llm.model.lm_head, gemv.FastLinear)
    plain = sluice.LLM(tiny_dir, kernels=False).generate([[1, 2, 3]], params)
    assert out[0].token_ids == plain[0].token_ids


def test_auto_kernels_wait_for_a_batch(tiny_dir):
    """kernels="auto" on a small model: batch-1 generation never swaps the linears (nothing built or
    loaded for it); the first batch of 2 rows does, and its tokens are the plain engine's."""
    params = sluice.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = sluice.LLM(tiny_dir)
    llm.generate([[1, 2, 3]], params)
    assert llm.kernels_in_use == 0 and type(llm.model.lm_head) is torch.nn.Linear
    out = llm.generate([[1, 2, 3], [4, 5]], params)
    assert llm.kernels_in_use > 0 and isinstance(llm.model.lm_head, gemv.FastLinear)
    plain = sluice.LLM(tiny_dir, kernels=False).generate([[1, 2, 3], [4, 5]], params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]


def test_decode_kernels_bench_quick(tmp_path):
    """bench/decode_kernels.py --quick runs end to end; its attention variants agree (no timing asserts)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "bench" / "decode_kernels.py"
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    kernels = {(x["kernel"], x["dtype"], x["rows"]) for x in r["linear"]}
    assert ("gemv", "int8", 2) in kernels and ("F.linear", "bfloat16", 1) in kernels
    assert all(x["GB_s"] > 0 for x in r["linear"])
    for x in r["attention"]:  # same answer as SDPA on the old layout, to bf16 / fp32 rounding
        assert x["max_abs_diff"] < (2e-2 if x["dtype"] == "bfloat16" else 1e-5)


def test_int8_linears_decode_through_the_kernel(tiny_dir, monkeypatch):
    """--quantize int8 models: decode rows go to gemv with the int8 weight and per-row scales, prefill
    to fp32 GEMMs on blocks of the dequantized weight; both the fp32 product with the dequantized weight."""
    monkeypatch.setattr(gemv, "PREFILL_BLOCK_BYTES", 4 * 64 * 24)  # ~24 rows per block: many blocks
    from sluice.model.quant import Int8Linear
    model = sluice.load(tiny_dir, quantize="int8")
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10]])
    with torch.inference_mode():
        before = model(ids)
    int8 = [m for m in model.modules() if type(m) is Int8Linear]
    assert int8 and gemv.use_fast_linears(model) >= len(int8)
    assert all(isinstance(m, gemv.FastInt8Linear) for m in int8)
    with torch.inference_mode():
        assert (model(ids) - before).abs().max() < 0.02 * before.abs().max()  # torch's op rounds x to bf16
        lin = int8[0]
        for rows in (3, 20):  # decode (the kernel) and prefill (blocks)
            x = torch.randn(rows, lin.in_features)
            want = x @ lin.dequantize().T + (0 if lin.bias is None else lin.bias)
            assert torch.allclose(lin(x), want, atol=1e-4, rtol=1e-4)
        with torch.profiler.profile() as prof:
            one = model(ids[:, :1])
        assert len([e for e in prof.events() if e.name == "sluice::gemv"]) >= len(int8)
        # close to torch's int8 kernel, which rounds x to bf16 first: the same model up to that rounding
        ref = sluice.load(tiny_dir, quantize="int8")(ids[:, :1])
        assert (one - ref).abs().max() < 0.02 * ref.abs().max()
