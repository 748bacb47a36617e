"""docs/benchmarks.md's "Current results" table (bench/docs_results.py): per machine kind the newest
result of each setting, an undisturbed run before a disturbed one, disturbed runs marked, and the
batch-decode results (bench/batch_decode.py) beside the batch-1 ones. Made-up results files."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
CPU = {"model": "AMD EPYC", "logical_cpus": 2, "avx2": True, "avx512f": False}


@pytest.fixture
def dr(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("docs_results_under_test", BENCH / "docs_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    yield mod
    sys.modules.pop("docs_results_under_test", None)


Q06 = {"dir": "/tmp/q06", "params_read_per_token": 596e6, "layers": 28, "hidden": 1024, "vocab": 151936}


def _speed(path: Path, date: str, commit: str, tg: float, disturbed=None, cpu=CPU, prompt=512, model=Q06,
           isa_env=None) -> None:
    r = {"benchmark": "speed", "cpu": cpu, "torch_threads": 2, "date": date, "code": {"commit": commit},
         **({"isa_env": isa_env} if isa_env else {}),
         "settings": {"dtype": "bfloat16", "quantize": None, "compile": False, "prompt": prompt},
         "model": model,
         "rows": [{"engine": e, "test": t, "tok_s": {"mean": v}}
                  for e, k in (("sluice", 1.0), ("llama.cpp", 2.0))
                  for t, v in ((f"pp{prompt}", 100 * k), ("tg128", tg * k))]}
    if disturbed is not None:
        r["disturbed"] = disturbed
    path.write_text(json.dumps(r))


def test_newest_undisturbed_result_per_setting_and_marks(dr, tmp_path):
    _speed(tmp_path / "bench-speed-a.json", "2026-12-01 10:00:00 +0000", "aaaaaaa", 5.0)  # no flag: an old file
    _speed(tmp_path / "bench-speed-b.json", "2026-12-02 10:00:00 +0000", "bbbbbbb", 6.0, disturbed=False)
    _speed(tmp_path / "bench-speed-c.json", "2026-12-03 10:00:00 +0000", "ccccccc", 1.0, disturbed=True)
    table = dr.speed_table()
    assert "bbbbbbb" in table and "aaaaaaa" not in table and "ccccccc" not in table  # newer, and undisturbed
    assert "| Qwen3-0.6B shape (596 M), bf16 | tg128 | 6.00 | 12.0 |  | 0.50x | 2026-12-02, bbbbbbb |" in table
    assert table.index("tg128") < table.index("pp512")
    assert "disturbed" not in table
    for f in ("bench-speed-a.json", "bench-speed-b.json"):
        (tmp_path / f).unlink()
    dr.speed_current.cache_clear()
    table = dr.speed_table()  # only a disturbed run left: shown, and marked
    assert "2026-12-03, ccccccc, **disturbed** | [bench-speed-c.json](results/bench-speed-c.json) |" in table


def test_machine_kinds_get_tables_of_their_own(dr, tmp_path):
    _speed(tmp_path / "bench-speed-a.json", "2026-12-01 10:00:00 +0000", "aaaaaaa", 5.0)
    xeon = {"model": "Intel Xeon", "logical_cpus": 2, "avx2": True, "avx512f": True, "avx512_bf16": True}
    _speed(tmp_path / "bench-speed-x.json", "2026-11-01 10:00:00 +0000", "xxxxxxx", 9.0, cpu=xeon)
    table = dr.speed_table()
    assert "**AMD EPYC, 2 logical CPUs, avx2; torch 2 threads**" in table
    assert "**Intel Xeon, 2 logical CPUs, avx2 avx512f avx512_bf16; torch 2 threads**" in table
    assert "aaaaaaa" in table and "xxxxxxx" in table  # the older Xeon run is that kind's newest


def test_cpus_of_one_name_and_flags_are_told_apart_by_family(dr, tmp_path):
    """Two EPYC generations with the same model name and flags (a Zen 4 and a Zen 5 VM): the newer one's run
    gets a table of its own instead of replacing the other's rows; a file from before the family was recorded
    keeps the old label."""
    zen4 = {**CPU, "avx512f": True, "avx512_bf16": True}
    zen5 = {**zen4, "family": 26, "model_number": 2}
    _speed(tmp_path / "bench-speed-a.json", "2026-12-01 10:00:00 +0000", "aaaaaaa", 5.0, cpu=zen4)
    _speed(tmp_path / "bench-speed-b.json", "2026-12-04 10:00:00 +0000", "bbbbbbb", 7.0, cpu=zen5)
    table = dr.speed_table()
    assert "**AMD EPYC, 2 logical CPUs, avx2 avx512f avx512_bf16; torch 2 threads**" in table
    assert "**AMD EPYC (family 26 model 2), 2 logical CPUs, avx2 avx512f avx512_bf16; torch 2 threads**" in table
    assert "aaaaaaa" in table and "bbbbbbb" in table


def test_cpu_info_records_the_family_and_model_numbers():
    from sluice.benchmarks import common
    from sluice.engine.native import build
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
            "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n")
    info = build.cpu_info(text)
    assert info == {"model": "AMD EPYC", "logical_cpus": 2, "avx2": True, "avx512f": True, "avx512_bf16": True,
                    "amx_bf16": False, "family": 26, "model_number": 2}
    assert common.cpu_info is build.cpu_info  # the benchmarks record the same thing the profile does


def test_batch_decode_rows_join_the_table(dr, tmp_path):
    _speed(tmp_path / "bench-speed-a.json", "2026-12-01 10:00:00 +0000", "aaaaaaa", 5.0)
    r = {"benchmark": "batch_decode", "cpu": CPU, "torch_threads": 2, "date": "2026-12-02 10:00:00 +0000",
         "code": {"commit": "bbbbbbb"}, "disturbed": False,
         "settings": {"dtype": "bfloat16", "quantize": None},
         "model": Q06,
         "rows": [{"engine": e, "batch": b, "test": "tg128", "tok_s": {"mean": v}}
                  for b in (8, 1) for e, v in (("sluice", 10.0 * b), ("llama.cpp", 20.0 * b))]}
    (tmp_path / "bench-batch-q06.json").write_text(json.dumps(r))
    table = dr.speed_table()
    one = "| Qwen3-0.6B shape (596 M), bf16 | tg128, batch 1 | 10.0 | 20.0 |  | 0.50x | 2026-12-02, bbbbbbb |"
    eight = "| Qwen3-0.6B shape (596 M), bf16 | tg128, batch 8 | 80.0 | 160.0 |  | 0.50x | 2026-12-02, bbbbbbb |"
    assert one in table and eight in table and table.index(one) < table.index(eight)
    assert "| Qwen3-0.6B shape (596 M), bf16 | tg128 | 5.00 |" in table  # the batch-1 run stays
    values = dr.speed_values()
    assert values["speed.avx2.q06.bf16.tg"] == "5"  # the batch run adds no batch-1 value


def test_a_run_at_another_prompt_length_does_not_hide_one(dr, tmp_path):
    """pp512 and tg128-after-128 are two runs of one setting: the newer does not replace the other."""
    _speed(tmp_path / "bench-speed-a.json", "2026-12-01 10:00:00 +0000", "aaaaaaa", 5.0, prompt=128)
    _speed(tmp_path / "bench-speed-b.json", "2026-12-02 10:00:00 +0000", "bbbbbbb", 6.0, prompt=512)
    table = dr.speed_table()
    assert "| pp128 | 100.0 |" in table and "| pp512 | 100.0 |" in table
    assert "aaaaaaa" in table and "bbbbbbb" in table


def test_shapes_are_named_and_kept_apart(dr, tmp_path):
    """A Llama-3-8B-shaped run is its own row set, named so, with two decimals below 10 tok/s, and its
    numbers never stand in for the Qwen3-0.6B shape's in the docs' values."""
    _speed(tmp_path / "bench-speed-q.json", "2026-12-01 10:00:00 +0000", "aaaaaaa", 12.0)
    l8 = {"dir": "/tmp/l8", "params_read_per_token": 7504.9e6, "layers": 32, "hidden": 4096, "vocab": 128256}
    _speed(tmp_path / "bench-speed-l.json", "2026-12-02 10:00:00 +0000", "bbbbbbb", 1.12, model=l8)
    odd = dict(l8, layers=3)
    _speed(tmp_path / "bench-speed-o.json", "2026-12-03 10:00:00 +0000", "ccccccc", 50.0, model=odd)
    table = dr.speed_table()
    assert "| Llama-3-8B shape (7,505 M), bf16 | tg128 | 1.12 | 2.24 |  | 0.50x | 2026-12-02, bbbbbbb |" in table
    assert "| Qwen3-0.6B shape (596 M), bf16 | tg128 | 12.0 | 24.0 |" in table
    assert "| random checkpoint (7,505 M), bf16 | tg128 | 50.0 |" in table
    values = dr.speed_values()
    assert values["speed.avx2.q06.bf16.tg"] == "12" and values["speed.avx2.llama3-8b.bf16.tg"] == "1"


def test_a_run_with_narrowed_builds_is_a_machine_kind_of_its_own(dr, tmp_path):
    """sluice's AVX2 build on an AVX-512 CPU (SLUICE_KERNEL_FLAGS=-mno-avx512f): a newer such run must not stand
    for the CPU's own builds in its rows, nor in the prose values."""
    xeon = {"model": "Intel Xeon", "logical_cpus": 2, "avx2": True, "avx512f": True}
    _speed(tmp_path / "bench-speed-a.json", "2026-12-01", "aaa", 20.0, cpu=xeon)
    _speed(tmp_path / "bench-speed-b.json", "2026-12-03", "bbb", 12.0, cpu=xeon,
           isa_env={"SLUICE_KERNEL_FLAGS": "-mno-avx512f -mno-avxvnni", "ATEN_CPU_CAPABILITY": "avx2"})
    kinds = dr.speed_current()
    assert len(kinds) == 2
    own = [k for k in kinds if "AVX2 builds" not in k]
    assert len(own) == 1 and next(iter(kinds[own[0]].values()))["code"]["commit"] == "aaa"
    v = dr.speed_values()
    assert [x for k, x in v.items() if k.endswith(".tg")] == ["20"]
    table = dr.speed_table()
    assert "AVX2 builds (sluice and llama.cpp built as for an AVX2-only CPU)" in table and "bbb" in table
