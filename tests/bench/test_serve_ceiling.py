"""bench/serve_ceiling.py: the engine-alone split of serve_load's load into prefill and decode, and what a target
C-over-1 ratio would take. The solver is checked by putting its answers back into the ratio; a tiny run on the
bundled model has the documented structure and every derived number follows from its samples. No timing asserts."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")  # serve_load's client side, imported with it

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def sc():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("serve_ceiling", BENCH / "serve_ceiling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_ceiling"] = mod
    spec.loader.exec_module(mod)
    return mod


def ratio(out_c, out_1, p_c, d_c, p_1, d_1):
    return (out_c / (p_c + d_c)) / (out_1 / (p_1 + d_1))


def test_the_speedups_it_names_reach_the_target(sc):
    parts = dict(out_c=900, out_1=450, p_c=0.8, d_c=1.2, p_1=0.45, d_1=2.6)
    r = sc.solve(4.0, **parts)
    assert r["ratio"] == pytest.approx(ratio(**parts))
    assert r["prefill_share_c"] == pytest.approx(0.4) and r["prefill_share_1"] == pytest.approx(0.45 / 3.05)
    assert r["ratio_without_prefill"] == pytest.approx((900 / 1.2) / (450 / 2.6))
    s = r["prefill_speedup_for_target"]
    assert s > 1 and ratio(900, 450, 0.8 / s, 1.2, 0.45 / s, 2.6) == pytest.approx(4.0)
    g = r["decode_c_speedup_for_target"]
    assert g > 1 and ratio(900, 450, 0.8, 1.2 / g, 0.45, 2.6) == pytest.approx(4.0)


def test_a_target_out_of_reach_says_none(sc):
    # decode alone gives 2x: no prefill speed-up reaches 4x; prefill alone takes more than the 1-run's whole time
    r = sc.solve(4.0, out_c=800, out_1=400, p_c=0.5, d_c=1.0, p_1=0.25, d_1=1.0)
    assert r["ratio_without_prefill"] == pytest.approx(2.0)
    assert r["prefill_speedup_for_target"] is None
    r = sc.solve(4.0, out_c=800, out_1=400, p_c=1.0, d_c=1.0, p_1=0.5, d_1=1.0)
    assert r["decode_c_speedup_for_target"] is None  # 2 * 1.5 / 4 < P_c: even free decode falls short


@pytest.mark.slow
def test_a_tiny_run_has_consistent_numbers(sc, tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    assert sc.main(["-c", "2", "-r", "2", "--serial", "3", "--reps", "2", "--prompt-tokens", "8:24",
                    "--max-tokens", "3:6", "--seed", "3", "--probe-mib", "16", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "serve_ceiling" and isinstance(r["disturbed"], bool) and r["cpu_flags"]
    assert r["code_at_save"] and isinstance(r["native_kernels"], list)  # (save_json's provenance)
    w = r["workload"]
    assert w["requests"] == 4 and w["serial"] == 3 and w["concurrency"] == 2 and r["load"]["disturbed"] == r["disturbed"]
    assert set(r["samples_s"]) == {"batch", "prefill_batch", "serial", "prefill_serial"}
    assert all(len(v) == 2 and min(v) > 0 for v in r["samples_s"].values())
    med = {k: statistics.median(v) for k, v in r["samples_s"].items()}
    assert r["seconds"]["prefill_c"] == med["prefill_batch"] and r["seconds"]["prefill_1"] == med["prefill_serial"]
    assert r["seconds"]["decode_c"] == pytest.approx(med["batch"] - med["prefill_batch"])
    assert r["seconds"]["decode_1"] == pytest.approx(med["serial"] - med["prefill_serial"])
    assert 4 * 3 <= r["out_tokens"]["c"] <= 4 * 6 and 3 * 3 <= r["out_tokens"]["1"] <= 3 * 6
    assert r["tok_s"]["c"] == pytest.approx(r["out_tokens"]["c"] / med["batch"])
    assert r["ceiling"]["ratio"] == pytest.approx(r["tok_s"]["c"] / r["tok_s"]["1"])
    d, params = r["decode"], 6 * (256 * (256 + 128 + 128 + 256) + 3 * 256 * 768) + 8192 * 256  # blocks + tied head
    read = params + 6 * (2 * 256 + 2 * 64) + 256 + 256  # + the norms (qk-norms too) and the embedding's one row
    assert d["weight_bytes_per_step"] == 4 * read and d["flops_per_token"] == 2 * params
    if r["seconds"]["decode_1"] > 0:
        assert d["weights_GB_s_1"] == pytest.approx(4 * read * r["out_tokens"]["1"] / r["seconds"]["decode_1"] / 1e9)
    assert (d["last_level_cache_bytes"] is None or d["last_level_cache_bytes"] > 0) and d["dram_read_GB_s"] > 0
    assert d["probe_bytes"] == 16 << 20
    g = r["gemm"]
    assert g["linear_flops_per_prompt_token"] == 2 * 6 * 256 * (256 + 128 + 128 + 256 + 3 * 768)  # the bundled model
    assert g["torch_mm_gflops"] > 0 and g["torch_mm_dtype"] == "float32"
    # the step profile: one native call per decode step, every decode row of the run counted once, the attention
    # reading exactly the slots up to each row's position (a request's first token comes from its prefill)
    specs = sc.fit_prompts(sc.make_specs(4, (8, 24), (3, 6), 0.5, 0.0, 3), sc.sluice_counter(None), 3)
    slot = 2 * 6 * 2 * 64 * 4  # k and v, 6 layers, 2 KV heads of 64, fp32
    pc, p1 = r["step_profile"]["c"], r["step_profile"]["1"]
    for prof, ss in ((pc, specs), (p1, specs[:3])):
        rows = sum(s.max_tokens - 1 for s in ss)
        slots = sum(s.prompt_tokens + j + 1 for s in ss for j in range(s.max_tokens - 1))
        assert prof["rows_per_call"] * prof["decode_calls"] == pytest.approx(rows)
        assert prof["kv_slot_bytes"] == slot and prof["kv_slots"] == slots
        assert prof["kv_bytes_per_call"] == pytest.approx(slot * slots / prof["decode_calls"])
        assert prof["outside_native_s"] == pytest.approx(prof["wall_s"] - prof["decode_call_s"] - prof["chunk_call_s"])
        assert prof["us_per_call"] == pytest.approx(1e6 * prof["decode_call_s"] / prof["decode_calls"])
        assert set(prof["phases_us_per_call"]) == {"embedding", "norms", "qkv_proj", "attention", "o_proj", "mlp",
                                                   "final_norm", "lm_head"}
        assert 0 < sum(prof["phases_us_per_call"].values()) <= prof["us_per_call"]
        assert prof["read_GB_s"] == pytest.approx((4 * read + prof["kv_bytes_per_call"]) / prof["us_per_call"] / 1e3)
    assert p1["rows_per_call"] == 1 and p1["decode_calls"] == sum(s.max_tokens - 1 for s in specs[:3])
    text = capsys.readouterr().out
    assert "out tok/s" in text and "a decode call of the native step" in text


def test_bad_arguments_are_refused(sc, capsys):
    with pytest.raises(SystemExit) as e:
        sc.main(["--target", "1"])
    assert e.value.code == 2 and "--target > 1" in capsys.readouterr().err
