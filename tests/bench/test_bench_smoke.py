"""The benchmark scripts run end to end (--quick) and write the JSON the docs describe.

No timing asserts (speed is recorded in docs/benchmarks.md, never tested). The torch.compile rows
are skipped here: compiling costs tens of seconds on a small CPU, longer than everything else.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark script

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(script: str, *args: str, env: dict | None = None) -> None:
    # A hang-stopper, not a speed limit: 10x+ the 1-3 minutes a quick run takes on a quiet machine
    # (decode_speed.py went past the old 300 s on a busy one, and failed for it).
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", *args],
                          capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert any(h in proc.stdout for h in ("| engine |", "| config |", "| row |", "| family |"))  # the markdown table


def test_decode_speed_quick(tmp_path):
    out = tmp_path / "decode.json"
    _run("decode_speed.py", "--no-compile", "--workdir", str(tmp_path / "work"), "--json", str(out))
    r = json.loads(out.read_text())
    assert r["quick"] and r["errors"] == {}
    assert r["memcpy_GB_s"] > 0
    for dtype in ("float32", "bfloat16"):
        assert r["weight_bytes_per_token"][dtype] > 0 and r["decode_bound_tok_s"][dtype] > 0
    rows = {(row["engine"], row["dtype"]): row for row in r["rows"]}
    assert set(rows) == {(e, d) for e in ("sluice", "transformers") for d in ("float32", "bfloat16")}
    for row in rows.values():
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
        assert row["prefill_vs_transformers"] > 0 and row["decode_vs_transformers"] > 0
    # fp32 weights are twice the bytes of bf16 ones, but for the norm gains, which the engine's "bf16
    # weights, fp32 compute" mode (the default where the native step runs) keeps in fp32.
    assert r["weight_bytes_per_token"]["float32"] == pytest.approx(2 * r["weight_bytes_per_token"]["bfloat16"], rel=0.01)


def test_train_speed_quick(tmp_path):
    out = tmp_path / "train.json"
    configs = "transformers fp32,transformers bf16-autocast,sluice fp32,sluice bf16-autocast"
    _run("train_speed.py", "--configs", configs, "--json", str(out))
    r = json.loads(out.read_text())
    assert r["quick"] and r["errors"] == {}
    assert r["tokens_per_step"] == r["micro_batch"] * r["seq_len"] > 0
    rows = {row["config"]: row for row in r["rows"]}
    assert set(rows) == set(configs.split(","))
    for row in rows.values():
        assert row["tok_s"] > 0 and row["step_seconds"] > 0 and row["vs_transformers_fp32"] > 0
        assert row["params"] > 0 and row["first_loss"] > 0


def test_probe_overhead_quick(tmp_path):
    out = tmp_path / "probe.json"
    _run("probe_overhead.py", "--no-compile", "--ablate", "--workdir", str(tmp_path / "work"), "--json", str(out))
    r = json.loads(out.read_text())
    assert r["quick"] and r["errors"] == {}
    rows = {(row["row"], row["variant"]): row for row in r["rows"]}
    variants = ("plain", "probed", "timed hooks", "no-op hooks")
    assert set(rows) == {(row, v) for row in ("fp32 eager", "bf16 eager") for v in variants}  # --no-compile
    assert r["hooks"]["begin"] == 1 and sum(r["hooks"].values()) > 1
    assert r["hooks"]["attention"] >= 2  # observe()'s per-head valves: their pre-hook and one per layer
    for (_, variant), row in rows.items():
        assert row["step_ms"] > 0 and row["prefill_s"] > 0 and row["step_ratio"] > 0
        if variant == "plain":  # the hooks were out: the probe's buffers saw nothing
            assert row["step_ratio"] == 1.0 and row["probe_buffers_untouched"]
        else:  # with the probe (or stand-ins for its hooks) not a single logit changes
            assert row["logits_identical"]
        if variant == "probed":
            assert row["hooks_ran_every_step"]
        if variant == "timed hooks":
            assert set(row["inside_hooks_ms"]) == set(r["hooks"]) and sum(row["inside_hooks_ms"].values()) > 0


def test_fused_head_quick(tmp_path):
    out = tmp_path / "fused.json"
    _run("fused_head.py", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["quick"] and r["cpu"] and r["chunk"] > 0 and r["candidates"] > 0
    rows = {(x["batch"], x["dtype"], x["mode"]): x for x in r["rows"]}
    assert set(rows) == {(b, d, m) for b in (1, 4) for d in ("float32", "bfloat16") for m in ("greedy", "top_p")}
    for x in rows.values():
        assert x["plain_ms"] > 0 and x["fused_ms"] > 0 and x["speedup_paired"] > 0
        assert x["plain_peak_bytes"] > 0 and x["fused_peak_bytes"] > 0
        assert 0 <= x["fallback_fraction"] <= 1
        if x["mode"] == "greedy":  # the same tokens as the plain path, never a fallback
            assert x["same_tokens"] and x["fallback_fraction"] == 0


def test_fused_head_engine_quick(tmp_path):
    out = tmp_path / "engine.json"
    _run("fused_head.py", "--engine", "--json", str(out))
    r = json.loads(out.read_text())
    modes = ("greedy", "top_p", "model defaults")
    assert r["quick"] and {(x["batch"], x["mode"]) for x in r["rows"]} == {(b, m) for b in (1, 2) for m in modes}
    for x in r["rows"]:
        assert x["plain_tok_s"] > 0 and x["fused_tok_s"] > 0 and x["auto_tok_s"] > 0
        assert 0 <= x["fallback_fraction"] <= 1 and 0 <= x["auto_fused_fraction"] <= 1


def test_speculative_quick(tmp_path):
    out = tmp_path / "spec.json"
    _run("speculative.py", "--q06", "", "--json", str(out))
    r = json.loads(out.read_text())
    rows = {(x["set"], x["temperature"], x["config"]): x for x in r["bundled"]}
    configs = ("plain", "draft k=2", "draft k=4", "draft k=auto", "prompt-lookup k=4", "prompt-lookup k=auto")
    assert set(rows) == {(s, t, c) for s in ("code", "edit") for t in (0.0, 0.8) for c in configs}
    for (_, temp, config), x in rows.items():
        assert x["tok_s"] > 0
        if temp == 0.0:  # speculation keeps the target's greedy tokens, whatever was guessed
            assert x["greedy_identical_to_plain"]
        if config != "plain":
            assert 0 <= x["acceptance_rate"] <= 1 and x["tokens_per_forward"] >= 1
        if config.startswith("draft k=") and config != "draft k=auto":  # set_k reached each configuration
            k = int(config.split("=")[1])
            assert x["guesses_per_forward"] <= k
            assert x["guesses_per_forward"] > (2 if k == 4 else 1)
    cost = r["bundled_cost"]
    assert cost["t_step_ms"] > 0 and [p["k"] for p in cost["per_k"]] == [1, 2, 4, 8]
    assert all(0 <= p["break_even_acceptance"] <= 1 for p in cost["per_k"] if p["break_even_acceptance"] is not None)


def test_family_speed_quick(tmp_path):
    out = tmp_path / "family.json"
    _run("family_speed.py", "--families", "llama,gemma2,gpt2", "--workdir", str(tmp_path / "work"), "--json", str(out))
    r = json.loads(out.read_text())
    assert r["quick"] and [row["family"] for row in r["rows"]] == ["llama", "gemma2", "gpt2"]
    for row in r["rows"]:
        assert row["tok_s"] > 0 and row["weight_bytes"] > 0 and row["path"] == "native step"
    assert r["rows"][0]["tok_s_vs_llama"] == 1.0


def test_int8_step_quick(tmp_path):
    out = tmp_path / "int8.json"
    _run("int8_step.py", "--batch", "1,2", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["quick"] and r["weight_bytes_per_step"] > 0 and set(r["rows"]) == {"decode B=1", "decode B=2"}
    for row in r["rows"].values():
        assert row["native"]["tok_s_median"] > 0 and row["torch"]["tok_s_median"] > 0
        assert row["native_over_torch_median"] > 0 and len(row["native_over_torch_per_round"]) == row["rounds"]


def test_int4_dot_quick(tmp_path):
    out = tmp_path / "int4.json"
    _run("int4_dot.py", "--batch", "1,2", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["quick"] and set(r["rows"]) == {"decode B=1", "decode B=2", "prefill 16"}
    for key in ("decode B=1", "decode B=2"):
        row = r["rows"][key]
        assert row["int8"]["tok_s_median"] > 0 and row["fp32"]["tok_s_median"] > 0
        assert len(row["int8_over_fp32_per_round"]) == row["rounds"]
    pre = r["rows"]["prefill 16"]
    assert pre["torch"]["tok_s_median"] > 0 and pre["int8_over_torch_median"] > 0 and pre["int8_over_fp32_median"] > 0


def test_batch_decode_quick(tiny_dir, tmp_path):
    """bench/batch_decode.py --quick; against llama-batched-bench too where it is built (CI: not)."""
    from sluice.benchmarks.batched_bench import find_batched_bench
    from sluice.errors import BenchmarkError
    try:
        peer = ["--vs", "llama.cpp", "--batched-bench", str(find_batched_bench(None))]
    except BenchmarkError:
        peer = []
    out = tmp_path / "batch.json"
    # TMPDIR: the GGUF the benchmark exports for llama.cpp is cached under the temp directory
    _run("batch_decode.py", "--model", str(tiny_dir), *peer, "--json", str(out), env={**os.environ, "TMPDIR": str(tmp_path)})
    r = json.loads(out.read_text())
    engines = ["sluice", "llama.cpp"] if peer else ["sluice"]
    assert r["settings"]["quick"] and r["settings"]["batch"] == [1, 4] and isinstance(r["disturbed"], bool)
    assert {(x["engine"], x["batch"]) for x in r["rows"]} == {(e, b) for e in engines for b in (1, 4)}
    assert all(x["tok_s"]["mean"] > 0 and x["pp_tok_s"]["mean"] > 0 for x in r["rows"])


def test_sampler_quick(tmp_path):
    out = tmp_path / "sampler.json"
    _run("sampler.py", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["quick"] and r["env"]["cpu"] is not None
    mixes = {x["mix"] for x in r["rows"]}
    sizes = {(x["rows"], x["vocab"]) for x in r["rows"]}
    assert len(mixes) == 6 and sizes == {(b, v) for b in (1, 8) for v in (8192, 151936)}
    for x in r["rows"]:
        assert x["native_us"] > 0 and x["torch_us"] > 0 and 0 <= x["fallback_fraction"] <= 1


def test_decode_order_compares_the_two_orders_on_one_model(tmp_path):
    """bench/decode_order.py: both of fast_step.DECODE_ORDERS run, give the same logits, and the JSON records each
    order's speed, the paired ratio and the CPU."""
    from ckpt import build
    from sluice.engine import fast_step
    if fast_step.kernel() is None:
        pytest.skip("needs sluice's whole-step CPU kernel")
    model_dir, out = tmp_path / "m", tmp_path / "order.json"
    build(model_dir, "qwen3")
    proc = subprocess.run([sys.executable, str(BENCH / "decode_order.py"), "--model", str(model_dir), "--prompt", "8",
                           "--steps", "2", "--rounds", "2", "--json", str(out)], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["same_logits"] is True and set(r["orders"]) == set(fast_step.DECODE_ORDERS)
    for o in r["orders"].values():
        assert o["tok_s"] > 0 and len(o["rounds"]) == 2 and o["lm_head"] > 0
    assert r["paired_ratio_tok_s"] > 0 and r["cpu"]["logical_cpus"] == os.cpu_count() and "disturbed" in r
    assert "rows / interleaved" in proc.stdout
