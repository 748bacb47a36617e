"""sluice's batch-1 CPU kernel (engine/native/gemv.cpp) against F.linear, and the engine path that uses it."""

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice.engine import gemv
from sluice.errors import ConfigError

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


def _w8a8_close(y, ref):
    """Kernel vs w8a8_reference: the same codes and exact integer dots; only the fp32 sum over blocks
    (and its order) differs from the float64 reference."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert (y.double() - ref.double()).abs().max().item() <= 1e-5 * ref.double().abs().max().item() + 1e-30


@pytest.mark.parametrize("xblock", [32, 128, 0])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("N,K,Kx", [(300, 517, 517), (64, 104, 100), (130, 1000, 999), (5, 8, 7), (70, 4096, 4096)])
def test_w8a8_matches_reference(xblock, rows, N, K, Kx):
    """Integer kernel == plain torch quantize-x-then-integer-dot, for 1..8 rows, odd K (a tail past the
    last whole 32), and x narrower than the weight (the padded columns, read as zero inputs)."""
    g = torch.Generator().manual_seed(N * K + rows + xblock)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, generator=g) / 100
    b = torch.randn(N, generator=g)
    x = torch.randn(rows, Kx, generator=g)
    _w8a8_close(gemv.gemv_w8a8(x, q, s, b, xblock), gemv.w8a8_reference(x, q, s, b, xblock))
    _w8a8_close(gemv.gemv_w8a8(x, q, s, None, xblock), gemv.w8a8_reference(x, q, s, None, xblock))
    # and it is an approximation of the exact product: x's codes carry 8 bits per block
    exact = F.linear(x.double(), F.pad(q.double() * s.double()[:, None], (0, 0))[:, :Kx], b.double())
    rel = (gemv.gemv_w8a8(x, q, s, b, xblock).double() - exact).norm() / (exact - b.double()).norm()
    assert rel < (0.01 if xblock else 0.02), rel


def test_w8a8_outlier_zero_block_and_saturation_edge():
    g = torch.Generator().manual_seed(7)
    N, K = 96, 256
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, generator=g)
    x = torch.randn(3, K, generator=g)
    x[0, 5] = 1000.0  # an outlier: its block's other codes round to ~0, the other blocks are untouched
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, no division by zero
    x[2] = 0.0  # an all-zero row
    for xblock in (32, 0):
        y, ref = gemv.gemv_w8a8(x, q, s, None, xblock), gemv.w8a8_reference(x, q, s, None, xblock)
        _w8a8_close(y, ref)
        assert torch.isfinite(y).all() and (y[2] == 0).all()
    codes, d = gemv.quantize_x(x, K, 32)
    assert codes[0, 0, 5] == 127 and (codes[1, 1] == 0).all() and d[1, 1] == 0 and codes.abs().max() <= 127
    # saturation edge: every pair of maddubs at its largest, |w| in {127, 128} times |x| = 127 with
    # signs aligned (and opposed): int16 pair sums of 2 * 128 * 127 = 32512 must not clip
    w = torch.tensor([[-128, 127] * 64, [127, -128] * 64, [-127] * 128, [127] * 128], dtype=torch.int8)
    xs = torch.tensor([[-1.0, 1.0] * 64, [1.0, -1.0] * 64, [-1.0, 1.0] * 64])  # codes exactly +-127
    y = gemv.gemv_w8a8(xs, w, torch.ones(4), None, 32)
    want = (xs.double() * 127) @ w.double().T / 127  # e.g. row 0 of w: 64 * (128 + 127) * 127 / 127
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=0)


def test_w8a8_keeps_non_finite_inputs_visible():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    y = gemv.gemv_w8a8(x, torch.ones(4, 64, dtype=torch.int8), torch.ones(4), None, 32)
    assert not torch.isfinite(y).any()


def test_w8a8_rejects_misuse():
    w, s = torch.zeros(4, 64, dtype=torch.int8), torch.ones(4)
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        gemv.gemv_w8a8(torch.randn(9, 64), w, s, None, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        gemv.gemv_w8a8(torch.randn(1, 64), w, s, None, 48)
    with pytest.raises(RuntimeError, match="shapes"):
        gemv.gemv_w8a8(torch.randn(1, 65), w, s, None, 32)
    with pytest.raises(RuntimeError, match="int8"):
        gemv.gemv_w8a8(torch.randn(1, 64), w.float(), s, None, 32)


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


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: torch.compile
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


@pytest.mark.slow
def test_decode_kernels_bench_quick(tmp_path):
    """bench/decode_kernels.py --quick runs end to end; its attention variants agree (no timing asserts)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "bench" / "decode_kernels.py"
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)  # a hang-stopper: 10x+ the ~25 s this takes here under load
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    kernels = {(x["kernel"], x["dtype"], x["rows"]) for x in r["linear"]}
    assert ("gemv", "int8", 2) in kernels and ("F.linear", "bfloat16", 1) in kernels
    assert all(x["GB_s"] > 0 for x in r["linear"])
    for x in r["attention"]:  # same answer as SDPA on the old layout, to bf16 / fp32 rounding
        assert x["max_abs_diff"] < (2e-2 if x["dtype"] == "bfloat16" else 1e-5)


def test_int8_linears_decode_through_the_kernel(tiny_dir, monkeypatch):
    """--quantize int8 models: decode rows go to gemv_w8a8 (x quantized to int8) with INT8_X = "int8",
    or with INT8_X = "fp32" to gemv with the int8 weight and per-row scales; prefill to fp32 GEMMs on
    blocks of the dequantized weight."""
    monkeypatch.setattr(gemv, "PREFILL_BLOCK_BYTES", 4 * 64 * 24)  # ~24 rows per block: many blocks
    # x unrounded: the integer-dot mode's own rounding of x (INT8_DOT "int8") is test_fast_step_int8_dot's
    monkeypatch.setattr(gemv, "INT8_DOT", "fp32")
    from sluice.model.quant import Int8Linear
    model = sluice.load(tiny_dir, quantize="int8")
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10]])
    with torch.inference_mode():
        before = model(ids)
    int8 = [m for m in model.modules() if type(m) is Int8Linear]
    assert gemv.INT8_X in gemv.INT8_X_CHOICES and gemv.X_BLOCK == 32  # docs/quantization.md
    monkeypatch.setattr(gemv, "INT8_X", "int8")
    assert int8 and gemv.use_fast_linears(model) >= len(int8)
    assert all(isinstance(m, gemv.FastInt8Linear) for m in int8)
    with torch.inference_mode():
        assert (model(ids) - before).abs().max() < 0.02 * before.abs().max()  # torch's op rounds x to bf16
        lin = int8[0]
        x = torch.randn(20, lin.in_features)  # prefill (blocks): the fp32 product with the dequantized weight
        want = x @ lin.dequantize().T + (0 if lin.bias is None else lin.bias)
        assert torch.allclose(lin(x), want, atol=1e-4, rtol=1e-4)
        x = x[:3]  # decode: w8a8 with INT8_X = "int8", the exact fp32 product with INT8_X = "fp32"
        _w8a8_close(lin(x), gemv.w8a8_reference(x, lin.qweight, lin.scales32, lin.bias, 32))
        monkeypatch.setattr(gemv, "X_BLOCK", 0)
        _w8a8_close(lin(x), gemv.w8a8_reference(x, lin.qweight, lin.scales32, lin.bias, 0))
        monkeypatch.setattr(gemv, "INT8_X", "fp32")
        assert torch.allclose(lin(x), x @ lin.dequantize().T + (0 if lin.bias is None else lin.bias), atol=1e-4,
                              rtol=1e-4)
        for path, op in (("fp32", "sluice::gemv"), ("int8", "sluice::gemv_w8a8")):
            monkeypatch.setattr(gemv, "INT8_X", path)
            with torch.profiler.profile() as prof:
                one = model(ids[:, :1])
            assert len([e for e in prof.events() if e.name == op]) >= len(int8)
            # close to torch's int8 kernel, which rounds x to bf16 first: the same model up to rounding
            ref = sluice.load(tiny_dir, quantize="int8")(ids[:, :1])
            assert (one - ref).abs().max() < 0.02 * ref.abs().max()


def test_int8_x_choice_is_checked(tiny_dir, monkeypatch):
    model = sluice.load(tiny_dir, quantize="int8")
    monkeypatch.setattr(gemv, "INT8_X", "int4")
    with pytest.raises(ConfigError, match="SLUICE_INT8_X.*int4"):
        gemv.use_fast_linears(model)
    monkeypatch.setattr(gemv, "INT8_X", "int8")
    monkeypatch.setattr(gemv, "X_BLOCK", 48)
    with pytest.raises(ConfigError, match="X_BLOCK.*48"):
        gemv.use_fast_linears(model)


@pytest.mark.slow
def test_int8_x_env_var(tiny_dir):
    """SLUICE_INT8_X picks the decode path per process; a bad value is a ConfigError that names it."""
    import os
    import subprocess
    import sys
    code = ("import sys, sluice\nfrom sluice.engine import gemv\nprint(gemv.INT8_X)\n"
            "try:\n    sluice.LLM(sys.argv[1], quantize='int8', kernels=True)\n"
            "except sluice.errors.ConfigError as e:\n    print('ConfigError:', e)\n")
    for val, want in (("fp32", "fp32"), ("int8", "int8"), ("fp16", "ConfigError: SLUICE_INT8_X must be one of")):
        r = subprocess.run([sys.executable, "-c", code, str(tiny_dir)], env={**os.environ, "SLUICE_INT8_X": val},
                           capture_output=True, text=True, timeout=120)  # a hang-stopper: 10x+ ~12 s
        assert r.returncode == 0 and r.stdout.splitlines()[0] == val, r.stderr
        assert want in r.stdout.splitlines()[-1], r.stdout
