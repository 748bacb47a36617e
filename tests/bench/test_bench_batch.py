"""`sluice bench batch` (bench/batch_decode.py): batched decode against llama-batched-bench. The
results have the documented structure and every derived number follows from the samples; the
peer's table is read from a captured run (fixtures/); bad input is one line naming the problem.
No timing asserts."""

import json
import math
import statistics
from pathlib import Path

import pytest

from sluice.benchmarks import batched_bench
from sluice.benchmarks.batched_bench import command, find_batched_bench, parse_table
from sluice.cli import main
from sluice.engine import mixed
from sluice.errors import BenchmarkError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
QUICK = ["--quick", "--probe-mib", "8"]


def _binary():
    try:
        return find_batched_bench(None)
    except BenchmarkError:
        return None


def check_result(r: dict, engines: list[str]) -> None:
    s = r["settings"]
    assert r["benchmark"] == "batch_decode" and r["torch_threads"] >= 1 and isinstance(r["cpu_flags"], list)
    assert isinstance(r["disturbed"], bool) and r["disturbed"] == r["load"]["disturbed"]
    assert len(r["load"]["loadavg_at_start"]) == 3 and r["loadavg_at_end"] == r["load"]["loadavg_at_end"]
    assert len(r["machine"]["read"]) == s["reps"] and r["read_GB_s"] > 0
    assert [(row["engine"], row["batch"]) for row in r["rows"]] == [(e, b) for b in s["batch"] for e in engines]
    rows = {(row["engine"], row["batch"]): row for row in r["rows"]}
    for (engine, b), row in rows.items():
        assert row["test"] == f"tg{s['gen']}"
        for key in ("tok_s", "pp_tok_s"):
            t = row[key]
            assert len(t["samples"]) == s["reps"] and all(x > 0 for x in t["samples"])
            assert math.isclose(t["mean"], statistics.fmean(t["samples"]))
        assert math.isclose(row["vs_sluice"], row["tok_s"]["mean"] / rows[("sluice", b)]["tok_s"]["mean"])
    assert r["sluice"]["max_num_batched_tokens"] == max(s["batch"]) * s["prompt"]  # one step prefills every row


def test_quick_sluice_alone(tiny_dir, tmp_path, capsys):
    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--model", str(tiny_dir), *QUICK, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| engine | precision | batch | test | decode t/s, all rows | vs sluice | prefill t/s |" in printed
    assert "| sluice | f32 | 4 | tg8 |" in printed
    r = json.loads(out.read_text())
    s = r["settings"]
    assert (s["prompt"], s["gen"], s["batch"], s["reps"]) == (16, 8, [1, 4], 1)
    assert s["bf16_dot"] is None  # fp32 weights: no bf16 products to name
    check_result(r, ["sluice"])
    assert r["llama.cpp"] is None


def test_bf16_records_its_products(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(mixed, "BF16_DOT", "fp32")  # the setting the run resolves (auto would follow the CPU)
    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--model", str(tiny_dir), *QUICK, "--dtype", "bfloat16", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["settings"]["bf16_dot"] == "fp32"
    check_result(r, ["sluice"])


def test_one_step_prefills_every_row(tiny_dir, monkeypatch):
    """The shape llama-batched-bench times: one step prefills all B prompts (each row's first token),
    then every step decodes all B rows, so a round of gen G is G + 1 steps whatever B is."""
    from sluice.llm import LLM
    steps = []
    real = LLM.step

    def counted(self, *a, **kw):
        steps.append(1)
        return real(self, *a, **kw)
    monkeypatch.setattr(LLM, "step", counted)
    # 4 prompts of 100 tokens: past the engine's default step budget of 256 tokens
    assert main(["bench", "batch", "--model", str(tiny_dir), *QUICK, "--prompt", "100", "--gen", "3",
                 "--probe-mib", "0"]) == 0
    # the warmup and the timed round (3 decode steps each), for B = 1 and then B = 4
    assert len(steps) == 4 * (1 + 3)


@pytest.mark.parametrize("args,named", [
    (["--batch", "eight"], "--batch eight"),
    (["--batch", "0"], "--batch"),
    (["--vs", "transformers"], "--vs transformers"),
    (["--gguf", "m.gguf"], "--gguf"),
    (["--quantize", "int3"], "--quantize int3"),
    (["--gen", "0"], "--gen"),
    (["--vs", "llama.cpp", "--batched-bench", "/nonexistent/llama-batched-bench"], "build_batched_bench.sh"),
    (["--prompt", "4000"], "context"),
])
def test_bad_input(tiny_dir, args, named, capsys):
    assert main(["bench", "batch", "--model", str(tiny_dir), *QUICK, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sluice bench: error:") and named in err and "\n" not in err


def test_a_missing_binary_says_how_to_build_it(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(batched_bench, "search_roots", lambda: [tmp_path])
    assert main(["bench", "batch", "--model", str(tiny_dir), *QUICK, "--vs", "llama.cpp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "llama-batched-bench" in err and "was not found" in err and "bash bench/build_batched_bench.sh" in err


def test_the_captured_table_is_read():
    """fixtures/llama-batched-bench.txt: what llama-batched-bench (built from llama-cpp-python 0.3.36's
    sdist by bench/build_batched_bench.sh) printed for the bundled model's f32 export with
    -t 2 -tb 2 -c 2048 -b 2048 -npp 128 -ntg 128 -npl 1,8, on a busy shared machine (the numbers
    mean nothing; the format is the point)."""
    text = (FIXTURES / "llama-batched-bench.txt").read_text()
    got = parse_table(text)
    rows = {(x["pp"], x["tg"], x["pl"]): x for x in got["rows"]}
    assert sorted(rows) == [(128, 128, 1), (128, 128, 8)]
    for (pp, tg, pl), x in rows.items():
        assert x["n_kv"] == pl * (pp + tg)  # prompts not shared
        # its speeds are its token counts over its times, to the 2 decimals it prints
        assert x["speed_tg"] == pytest.approx(pl * tg / x["t_tg"], rel=0.02)
        assert x["speed_pp"] == pytest.approx(pl * pp / x["t_pp"], rel=0.02)
        assert x["t"] == pytest.approx(x["t_pp"] + x["t_tg"], abs=2e-3)
    assert got["settings"] == {"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0,
                               "is_tg_separate": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2}


@pytest.mark.parametrize("text,named", [
    ("llama_model_load: error loading model\n", "no results table"),
    ("|    PP |     TG |    B | S_TG t/s |\n|---|---|---|---|\n|  1 | 2 | 3 | 4.0 |\n", "lacks the columns"),
])
def test_a_broken_output_is_one_clear_error(text, named):
    with pytest.raises(BenchmarkError, match=named):
        parse_table(text)


def _fake_peer(tmp_path: Path, full_from_run: int, status: int = 0) -> Path:
    """A stand-in for llama-batched-bench printing the captured table, its last row lost (as
    llama.cpp's undrained logger loses it at exit) on every run before `full_from_run`."""
    lines = (FIXTURES / "llama-batched-bench.txt").read_text().splitlines()
    last = max(i for i, ln in enumerate(lines) if ln.startswith("|"))
    (tmp_path / "full.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "cut.txt").write_text("\n".join(lines[:last]) + "\n")
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(f"#!/bin/sh\necho run >> {tmp_path}/runs\nn=$(wc -l < {tmp_path}/runs)\n"
                    f"if [ $n -ge {full_from_run} ]; then cat {tmp_path}/full.txt; else cat {tmp_path}/cut.txt; fi\n"
                    f"exit {status}\n")
    fake.chmod(0o755)
    return fake


WANT = [(128, 128, 1), (128, 128, 8)]


def test_a_lost_last_row_is_run_again(tmp_path):
    got = batched_bench.run_batched_bench([str(_fake_peer(tmp_path, full_from_run=2))], 60, WANT)
    assert got["runs"] == 2 and [(x["pp"], x["tg"], x["pl"]) for x in got["rows"]] == WANT


def test_a_row_never_printed_is_one_clear_error(tmp_path):
    with pytest.raises(BenchmarkError, match=r"no row for \(PP, TG, B\) = \(128, 128, 8\) in 3 runs"):
        batched_bench.run_batched_bench([str(_fake_peer(tmp_path, full_from_run=99))], 60, WANT)
    assert (tmp_path / "runs").read_text().count("run") == 3


def test_a_failing_peer_is_not_run_again(tmp_path):
    with pytest.raises(BenchmarkError, match=r"failed \(exit status 1\)"):
        batched_bench.run_batched_bench([str(_fake_peer(tmp_path, full_from_run=1, status=1))], 60, WANT)
    assert (tmp_path / "runs").read_text().count("run") == 1


def test_the_command_asks_for_the_same_shape():
    cmd = command(Path("/x/llama-batched-bench"), Path("/m.gguf"), 2, 128, 128, [1, 8])
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert args["-npp"] == "128" and args["-ntg"] == "128" and args["-npl"] == "1,8"
    assert args["-t"] == args["-tb"] == "2" and int(args["-c"]) >= 8 * (128 + 128) and "-pps" not in cmd


@pytest.mark.slow
def test_quick_against_llama_batched_bench(tiny_dir, tmp_path, monkeypatch):
    binary = _binary()
    if binary is None:
        pytest.skip("llama-batched-bench is not built (bash bench/build_batched_bench.sh)")
    pytest.importorskip("gguf")
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the exported GGUF's cache
    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--model", str(tiny_dir), *QUICK, "--vs", "llama.cpp", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    check_result(r, ["sluice", "llama.cpp"])
    lc = r["llama.cpp"]
    assert lc["precision"] == "f32" and lc["binary"] == str(binary) and len(lc["outputs"]) == len(lc["runs"]) == 1
    assert lc["settings"]["n_threads"] == r["torch_threads"]


def test_no_prompt_is_fed_twice(tiny_dir, monkeypatch):
    """sluice's prefix cache serves a prompt it has seen: every call (warmup and rounds, each batch size)
    gets prompts of its own, so pp times a prefill."""
    from sluice.benchmarks import batch_decode
    fed = []
    real = batch_decode._sluice_round

    def spy(llm, prompts, gen):
        fed.extend(tuple(p) for p in prompts)
        return real(llm, prompts, gen)
    monkeypatch.setattr(batch_decode, "_sluice_round", spy)
    assert main(["bench", "batch", "--model", str(tiny_dir), *QUICK, "--reps", "2", "--probe-mib", "0"]) == 0
    assert len(fed) == 2 * (1 + 4) + 1 + 4 and len(set(fed)) == len(fed)  # warmup + 2 rounds, B = 1 and 4
