"""`sluice bench` (the speed table against peers) and bench/speed.py: they run, the JSON has the
documented structure, and every derived number (tokens/s, ratios, GB/s) follows from the recorded
samples. No timing asserts: the numbers live in docs/benchmarks.md."""

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sluice.benchmarks import speed_engines
from sluice.benchmarks.speed_engines import find_llama_python
from sluice.cli import main
from sluice.engine.gemv import cpu_flags
from sluice.errors import BenchmarkError

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "speed.py"
TINY = ["--prompt", "12", "--gen", "5", "--reps", "2", "--probe-mib", "16"]


def check_result(r: dict, engines: list[str]) -> None:
    s = r["settings"]
    P, G = s["prompt"], s["gen"]
    assert r["benchmark"] == "speed" and r["versions"]["torch"] and r["torch_threads"] >= 1
    assert isinstance(r["cpu_flags"], list) and "model" in r["cpu"]
    # rotated rounds: a probe after each round of all engines; --sequential: after every engine's round
    rounds = s["reps"] * s["passes"]
    assert len(r["machine"]["read"]) == rounds * (len(engines) if s["sequential"] else 1) and r["read_GB_s"] > 0
    assert r["read_GB_s"] == statistics.median(p["GB_s"] for p in r["machine"]["read"])
    assert [(row["engine"], row["test"]) for row in r["rows"]] == [
        (e, t) for e in engines for t in (f"pp{P}", f"tg{G}")]
    rows = {(row["engine"], row["test"]): row for row in r["rows"]}
    for (engine, test), row in rows.items():
        t = row["tok_s"]
        assert len(t["samples"]) == rounds and all(x > 0 for x in t["samples"])
        assert math.isclose(t["mean"], statistics.fmean(t["samples"]))
        assert math.isclose(t["std"], statistics.stdev(t["samples"]))
        assert math.isclose(row["vs_sluice"], t["mean"] / rows[("sluice", test)]["tok_s"]["mean"])
        info = r["engines"][engine]
        assert row["precision"] == info["precision"]
        if test.startswith("tg"):
            bytes_per_token = (info["weight_bytes"]
                               + 2 * r["model"]["layers"] * r["model"]["kv_per_layer"] * info["kv_itemsize"]
                               * (P + (G + 1) / 2))
            assert math.isclose(info["decode_bytes_per_token"], bytes_per_token)
            assert math.isclose(row["GB_s"], bytes_per_token * t["mean"] / 1e9)
            assert math.isclose(row["bandwidth_share"], row["GB_s"] / r["read_GB_s"])
        else:
            assert "GB_s" not in row
        assert len(info["tokens"]) == min(G + 1, 32) and 0 <= info["tokens_agree_with_sluice"] <= G + 1
    assert rows[("sluice", f"tg{G}")]["vs_sluice"] == 1.0
    assert r["engines"]["sluice"]["tokens_agree_with_sluice"] == G + 1
    hp = r["engines"]["sluice"]["huge_pages"]  # the tiny model's tensors are under the 2 MiB floor: none moved
    assert hp["moved_bytes"] == 0 and hp["tensors"] == 0
    # the machine's load: both load averages, and whether anything else competed (disturbance.py)
    load = r["load"]
    assert len(r["loadavg_at_start"]) == len(r["loadavg_at_end"]) == 3 and r["loadavg_at_end"] == load["loadavg_at_end"]
    assert isinstance(r["disturbed"], bool) and r["disturbed"] == load["disturbed"] == bool(load["disturbed_reasons"])
    assert load["cores"] >= 1 and load["run_seconds"] > 0 and isinstance(load["busy_during_run"], list)


def test_cli_vs_transformers(tiny_dir, tmp_path, capsys):
    out = tmp_path / "sub" / "speed.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--vs", "transformers", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| engine | precision | test | t/s | vs sluice | GB/s | of read bw |" in printed
    assert "| transformers | f32 | tg5 |" in printed and "| sluice | f32 | pp12 |" in printed
    r = json.loads(out.read_text())
    check_result(r, ["sluice", "transformers"])
    # fp32 random tiny model: both engines pick the same greedy tokens
    assert r["engines"]["transformers"]["tokens_agree_with_sluice"] == 6
    # sluice's weights as stored, transformers' from the config: the same bytes in fp32
    n = r["model"]["params_read_per_token"]
    assert r["engines"]["sluice"]["weight_bytes"] == r["engines"]["transformers"]["weight_bytes"] == 4 * n


def test_vs_transformers_without_transformers_names_the_extra(tiny_dir, monkeypatch):
    """transformers is no dependency of sluice: --vs transformers without it says which extra brings it."""
    from sluice.benchmarks.speed_engines import TransformersEngine
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(BenchmarkError, match=r"needs the transformers package.*pip install 'sluice-llm\[peers\]'"):
        TransformersEngine(tiny_dir, "float32", 0)


def test_script_bf16(tiny_dir, tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_dir), *TINY, "--dtype", "bfloat16",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, check=False)  # hang-stopper
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    check_result(r, ["sluice"])
    # bf16 weights with fp32 activations on the native step (compute="auto"): the KV pool is fp32
    assert r["engines"]["sluice"]["precision"] == "bf16" and r["engines"]["sluice"]["kv_itemsize"] == 4


@pytest.fixture
def llm_kwargs(monkeypatch) -> list[dict]:
    """The keyword arguments of every LLM the bench builds, in order (the LLM is built as usual)."""
    import sluice.llm as engine_llm
    seen = []

    class Spy(engine_llm.LLM):
        def __init__(self, *a, **kw):
            seen.append(kw)
            super().__init__(*a, **kw)

    monkeypatch.setattr(engine_llm, "LLM", Spy)
    return seen


@pytest.mark.parametrize("flags, kv, itemsize", [([], None, 4), (["--kv-cache-dtype", "bfloat16"], "bfloat16", 2)])
def test_kv_cache_dtype_reaches_sluice_and_the_byte_count(tiny_dir, tmp_path, llm_kwargs, flags, kv, itemsize):
    seen = llm_kwargs
    out = tmp_path / "speed.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, *flags, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(seen) == 1 and seen[0].get("kv_cache_dtype") == kv
    assert r["settings"]["kv_cache_dtype"] == (kv or "auto") and r["engines"]["sluice"]["kv_itemsize"] == itemsize


@pytest.mark.parametrize("args,named", [
    (["--vs", "vllm"], "--vs vllm"),
    (["--dtype", "float16"], "--dtype float16"),
    (["--gen", "0"], "--gen"),
    (["--reps", "-1"], "--reps"),
    (["--quantize", "int3"], "--quantize int3"),
    (["--gguf", "x.gguf"], "--gguf"),
    (["--vs", "llama.cpp", "--llama-python", "/nonexistent/python"], "/nonexistent/python"),
    (["--vs", "llama.cpp", "--gguf", "/nonexistent/m.gguf", "--llama-python", sys.executable], "m.gguf"),
    (["--prompt", "4000"], "context"),
])
def test_bad_input(tiny_dir, args, named, capsys):
    assert main(["bench", "--model", str(tiny_dir), *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sluice bench: error:") and named in err and "\n" not in err


def test_llama_cpp_missing(tiny_dir, tmp_path, capsys):
    """A python that cannot import llama_cpp (here: site-packages off) -> exit 2, how to install it."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--vs", "llama.cpp", "--gguf", str(gguf),
                 "--llama-python", str(fake)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot import llama_cpp" in err and "pip install llama-cpp-python" in err and "\n" not in err


def test_llama_cpp_killed_by_a_signal(tiny_dir, tmp_path, capsys, monkeypatch):
    """A llama.cpp that dies of a signal while loading (as llama.cpp's AMX kernels do on some AMX Xeons) -> exit 2,
    naming the signal; on a CPU with AMX, also the likely cause and the way out."""
    worker = tmp_path / "worker.py"
    worker.write_text("import json, os, signal, sys\n"
                      "print(json.dumps({'ok': True, 'python': sys.executable}), flush=True)\n"
                      "sys.stdin.readline()\n"
                      "os.kill(os.getpid(), signal.SIGSEGV)\n")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {worker}\n")  # ignores the worker it is given: runs ours
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for flags, hinted in (({"avx2"}, False), ({"avx2", "avx512f", "amx_tile"}, True)):
        monkeypatch.setattr(speed_engines, "cpu_flags", lambda: flags)
        assert main(["bench", "--model", str(tiny_dir), *TINY, "--vs", "llama.cpp", "--gguf", str(gguf),
                     "--llama-python", str(fake)]) == 2
        err = capsys.readouterr().err.strip()
        assert "ended unexpectedly (killed by SIGSEGV" in err and "\n" not in err
        assert ("AMX" in err) == hinted


def test_quantize_int8(tiny_dir, tmp_path):
    """sluice's own int8 weights: the row says int8 and the bytes per token are the stored ones."""
    import inspect

    from sluice import LLM
    if "quantize" not in inspect.signature(LLM).parameters:
        pytest.skip("this sluice has no LLM(quantize=...) yet")
    out = tmp_path / "speed.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--quantize", "int8", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    check_result(r, ["sluice"])
    sl = r["engines"]["sluice"]
    assert sl["precision"] == "int8" and r["rows"][1]["precision"] == "int8"
    assert sl["weight_bytes"] < 2 * r["model"]["params_read_per_token"]  # int8 + scales, not fp32


def _llama_python():
    try:
        return find_llama_python(None)
    except BenchmarkError:
        return None


def _gguf(model_dir: Path, out: Path) -> Path | None:
    try:
        from sluice.model.gguf_export import export_gguf
    except ImportError:
        return None
    export_gguf(model_dir, out, "f32")
    return out


@pytest.mark.parametrize("gguf_from", ["flag", "export"])
def test_vs_llama_cpp(tiny_dir, tmp_path, monkeypatch, gguf_from):
    """--gguf FILE, or (no flag) the GGUF sluice exports itself into a cache under the temp dir."""
    python = _llama_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed (see ../shared/peers/README.md)")
    args = []
    if gguf_from == "flag":
        gguf = os.environ.get("SLUICE_TEST_GGUF") or _gguf(tiny_dir, tmp_path / "tiny-f32.gguf")
        if gguf is None:
            pytest.skip("no GGUF of the tiny model: sluice.model.gguf_export is missing and SLUICE_TEST_GGUF unset")
        args = ["--gguf", str(gguf)]
    else:
        pytest.importorskip("sluice.model.gguf_export")
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "speed.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--vs", "llama.cpp", *args,
                 "--llama-python", python, "--json", str(out)]) == 0
    if gguf_from == "export":
        assert [p.name[-9:] for p in (tmp_path / "sluice-bench-gguf").iterdir()] == ["-f32.gguf"]
    r = json.loads(out.read_text())
    check_result(r, ["sluice", "llama.cpp"])
    lc = r["engines"]["llama.cpp"]
    assert lc["precision"] == "f32" and lc["kv_itemsize"] == 2 and lc["info"]["n_threads"] == r["torch_threads"]
    assert lc["tokens_agree_with_sluice"] >= 3  # the same fp32 model, greedy
    assert lc["weight_bytes"] == r["engines"]["sluice"]["weight_bytes"]  # tied: every tensor, once
    assert len(lc["perf"]) == r["settings"]["reps"]


def test_int4_vs_llama_cpp_q4_0(tiny_dir, tmp_path, monkeypatch):
    """--quantize int4 --vs llama.cpp: llama.cpp gets sluice's q4_0 export of the checkpoint."""
    python = _llama_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed (see ../shared/peers/README.md)")
    if "amx_tile" in cpu_flags():
        # llama.cpp as vendored by llama-cpp-python dies on its first AMX Q4_0/Q8_0 product (docs/benchmarks.md):
        # on such a CPU the peer is the build without AMX (bench/build_llama_cpp_no_amx.sh), as the benchmarks use
        python = str(Path(__file__).resolve().parents[2] / ".peers" / "lcpp-noamx-venv" / "bin" / "python")
        if not Path(python).is_file():
            pytest.skip("this CPU has AMX, whose llama.cpp Q4_0 kernels crash; bench/build_llama_cpp_no_amx.sh "
                        "builds the peer without them")
    pytest.importorskip("sluice.model.gguf_export")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "speed.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--quantize", "int4", "--vs", "llama.cpp",
                 "--llama-python", python, "--json", str(out)]) == 0
    assert [p.name[-10:] for p in (tmp_path / "sluice-bench-gguf").iterdir()] == ["-q4_0.gguf"]
    r = json.loads(out.read_text())
    check_result(r, ["sluice", "llama.cpp"])
    assert r["engines"]["sluice"]["precision"] == "int4" and r["engines"]["llama.cpp"]["precision"] == "q4_0"


@pytest.mark.parametrize("flags,mode,k", [
    (["--draft-model", "SELF", "--speculative-tokens", "3"], "draft", 3),
    (["--prompt-lookup", "--speculative-tokens", "auto"], "prompt-lookup", "auto"),
])
def test_speculation_flags(tiny_dir, tmp_path, llm_kwargs, capsys, flags, mode, k):
    """--draft-model / --prompt-lookup / --speculative-tokens reach sluice's LLM (and only it), and the
    acceptance rate and tokens per target forward land under the table and in the JSON."""
    seen = llm_kwargs
    flags = [str(tiny_dir) if f == "SELF" else f for f in flags]
    out = tmp_path / "speed.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, *flags, "--json", str(out)]) == 0
    draft = str(tiny_dir) if mode == "draft" else None
    assert len(seen) == 1 and seen[0]["speculative"] == mode and seen[0]["num_speculative_tokens"] == k
    assert seen[0]["draft_model"] == draft
    r = json.loads(out.read_text())
    check_result(r, ["sluice"])
    sp = r["speculation"]
    assert sp["mode"] == mode and sp["draft_model"] == draft
    # every timed round's decode tokens: gen per round, over the target forwards it took
    assert sp["decode_tokens"] == r["settings"]["gen"] * r["settings"]["reps"]
    assert 0 < sp["target_forwards"] <= sp["decode_tokens"]
    assert math.isclose(sp["tokens_per_forward"], sp["decode_tokens"] / sp["target_forwards"])
    assert sp["acceptance_rate"] == (sp["accepted"] / sp["proposed"] if sp["proposed"] else 0.0)
    if mode == "draft":
        # the target as its own draft, greedy: every guess is kept, so a round emits up to k + 1 tokens
        assert sp["k"] == 3 and sp["proposed"] > 0 and sp["accepted"] == sp["proposed"]
        assert sp["tokens_per_forward"] > 1
    printed = capsys.readouterr().out
    assert f"sluice speculates ({mode}" in printed
    assert f"acceptance rate {sp['acceptance_rate']:.3f}" in printed
    assert f"{sp['tokens_per_forward']:.2f} tokens per target forward" in printed


def test_no_speculation_by_default(tiny_dir, tmp_path):
    out = tmp_path / "speed.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["speculation"] is None and r["settings"]["speculation"] is None


@pytest.mark.parametrize("args,named", [
    (["--speculative-tokens", "3"], "--speculative-tokens needs a proposer"),
    (["--prompt-lookup", "--draft-model", "bundled"], "choose one"),
    (["--prompt-lookup", "--speculative-tokens", "three"], "--speculative-tokens three"),
    (["--prompt-lookup", "--speculative-tokens", "99"], "num_speculative_tokens"),
])
def test_bad_speculation_flags(tiny_dir, args, named, capsys):
    assert main(["bench", "--model", str(tiny_dir), *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sluice bench: error:") and named in err and "\n" not in err


def test_each_round_prefills_a_new_prompt(tiny_dir, tmp_path, monkeypatch):
    """sluice keeps prompts in its prefix cache: a round that repeated an earlier prompt would time a
    cache hit, not a prefill. Every round (and the warmup) gets its own prompt, the same for every
    engine in the round."""
    from sluice.benchmarks import speed_engines
    seen = []
    real_round = speed_engines.SluiceEngine.round

    written = []  # blocks of the KV pool handed out so far, after each round

    def spy(self, prompt, gen):
        seen.append(tuple(prompt))
        out = real_round(self, prompt, gen)
        pool = self.llm.batch_engine().pool
        written.append(pool.num_blocks - len(pool._fresh))
        return out
    monkeypatch.setattr(speed_engines.SluiceEngine, "round", spy)
    assert main(["bench", "--model", str(tiny_dir), "--prompt", "40", "--gen", "3", "--reps", "3",
                 "--probe-mib", "16", "--vs", "transformers", "--json", str(tmp_path / "r.json")]) == 0
    prompts = seen
    assert len(prompts) == 4 and len(set(prompts)) == 4  # the warmup's and three rounds'
    # no prefix to find, so each round drops the last ones' and takes their (written) blocks again: 43 tokens in
    # blocks of 16, the same 3 blocks every round, where keeping the prefixes took 3 never-used blocks a round
    assert written == [3, 3, 3, 3]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["prompt_head"] == list(prompts[-1][:16])


def test_sequential_holds_one_engine_at_a_time(tiny_dir, tmp_path, monkeypatch, capsys):
    """--sequential: each engine loads, warms up, runs all its rounds and closes before the next loads, so
    a checkpoint too big to hold twice (Llama-3-8B in bf16 on 24 GiB) can still be compared."""
    from sluice.benchmarks import speed_engines
    live, most = set(), []
    for cls in (speed_engines.SluiceEngine, speed_engines.TransformersEngine):
        real_init, real_close = cls.__init__, cls.close

        def init(self, *a, _real=real_init, **k):
            _real(self, *a, **k)
            live.add(self.name)
            most.append(len(live))

        def close(self, _real=real_close):
            live.discard(self.name)
            _real(self)
        monkeypatch.setattr(cls, "__init__", init)
        monkeypatch.setattr(cls, "close", close)
    out = tmp_path / "seq.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--vs", "transformers", "--sequential",
                 "--json", str(out)]) == 0
    assert max(most) == 1 and not live
    assert "one engine in memory at a time" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["settings"]["sequential"] is True
    check_result(r, ["sluice", "transformers"])
    assert r["engines"]["transformers"]["tokens_agree_with_sluice"] == 6  # the same prompts reached both


def test_sequential_passes_reverse_the_order_every_other_pass(tiny_dir, tmp_path, monkeypatch, capsys):
    """--passes 2: sluice's block, the peer's, then the peer's again and sluice's, each loaded anew, with a
    prompt per round of its pass (the same for both engines) and a probe after every round."""
    from sluice.benchmarks import speed_engines
    order, loads = [], []
    for cls in (speed_engines.SluiceEngine, speed_engines.TransformersEngine):
        real_init, real_round = cls.__init__, cls.round

        def init(self, *a, _real=real_init, **k):
            _real(self, *a, **k)
            loads.append(self.name)

        def round_(self, prompt, gen, _real=real_round):
            order.append((self.name, tuple(prompt)))
            return _real(self, prompt, gen)
        monkeypatch.setattr(cls, "__init__", init)
        monkeypatch.setattr(cls, "round", round_)
    out = tmp_path / "passes.json"
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--vs", "transformers", "--sequential",
                 "--passes", "2", "--json", str(out)]) == 0
    reps = TINY[TINY.index("--reps") + 1]
    r = json.loads(out.read_text())
    assert r["settings"]["passes"] == 2 and len(r["machine"]["read"]) == 2 * 2 * int(reps)
    assert loads == ["sluice", "transformers", "transformers", "sluice"]
    per = 1 + int(reps)  # a warmup round, then the timed ones
    assert [n for n, _ in order[::per]] == loads
    prompts = [[p for _, p in order[i * per + 1:(i + 1) * per]] for i in range(4)]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and not set(prompts[0]) & set(prompts[2])
    check_result(r, ["sluice", "transformers"])
    assert "2 passes" in capsys.readouterr().out


def test_passes_need_sequential(tiny_dir, capsys):
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--vs", "transformers", "--passes", "2"]) == 2
    assert "--passes is for --sequential" in capsys.readouterr().err


def test_engines_that_do_not_fit_side_by_side_are_refused(tiny_dir, monkeypatch, capsys):
    """Before anything loads: rotated rounds need every engine in memory at once."""
    from sluice.benchmarks import speed, speed_engines
    monkeypatch.setattr(speed, "mem_available", lambda: 1000)
    monkeypatch.setattr(speed_engines.SluiceEngine, "__init__", lambda *a, **k: pytest.fail("loaded"))
    assert main(["bench", "--model", str(tiny_dir), *TINY, "--vs", "transformers"]) == 2
    err = capsys.readouterr().err.strip()
    assert "need about" in err and "add --sequential" in err and "\n" not in err
