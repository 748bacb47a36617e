"""`sluice profile --path native` (observatory/profile_native.py): the native step times its own phases
(FastStep's counters, filled by step.cpp), the path the engine ships. The counters change no number, add
up across calls, and are checked; the profile's components add up to the step; the CLI picks the native
path where the model can take it and says why when it cannot. No timing asserts: only that each phase
was counted and the accounting holds."""

import json

import pytest
import torch

import sluice
from ckpt import build
from sluice.cli import main
from sluice.engine import cpu_paths, fast_step
from sluice.engine.fast_step import PHASES, FastStep
from sluice.engine.kv_cache import KVCache
from sluice.errors import ObservatoryError
from sluice.observatory.costs import COMPONENTS
from sluice.observatory.profile import profile
from test_profile import FAKE_MACHINE, fake_machine  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma2")
    build(d, "gemma2")  # sandwich norms, soft-caps, windows: every optional phase of step.cpp runs
    return d


def test_counters_count_every_phase_and_change_no_number(gemma2_dir):
    model = sluice.load(gemma2_dir)
    step, cfg = FastStep(model), model.config
    tokens, positions = torch.tensor([[3, 9, 4], [7, 1, 2]]), torch.tensor([[0, 1, 2], [5, 6, 7]])
    runs = []
    for counters in (None, FastStep.counters()):
        cache = KVCache(cfg, 2, 16)
        runs.append((step(tokens, positions, cache.k, cache.v, counters=counters), cache.k, counters))
    (plain, k_plain, _), (timed, k_timed, counters) = runs
    assert torch.equal(plain, timed) and torch.equal(k_plain, k_timed)
    assert counters.shape == (len(PHASES),) and (counters > 0).all(), dict(zip(PHASES, counters.tolist()))
    before = counters.clone()
    step(tokens[:, :1], positions[:, :1] + 3, KVCache(cfg, 2, 16).k, KVCache(cfg, 2, 16).v, hidden=True,
         counters=counters)
    grew = dict(zip(PHASES, (counters > before).tolist()))
    assert grew["final_norm"] and grew["mlp"] and not grew["lm_head"]  # hidden=True: no LM head ran


@pytest.mark.parametrize("bad", [torch.zeros(len(PHASES)), torch.zeros(3, dtype=torch.float64),
                                 torch.zeros(2 * len(PHASES), dtype=torch.float64)[::2]])
def test_bad_counters_are_refused(gemma2_dir, bad):
    model = sluice.load(gemma2_dir)
    cache = KVCache(model.config, 1, 8)
    with pytest.raises(RuntimeError, match="counters must be a contiguous CPU float64 tensor of 8"):
        FastStep(model)(torch.tensor([[1]]), torch.tensor([[0]]), cache.k, cache.v, counters=bad)


def test_the_native_profile_accounts_for_the_whole_step(gemma2_dir):
    model = sluice.load(gemma2_dir)
    data = profile(model, [16, 120], reps=3, min_sample_s=0.01, hardware=FAKE_MACHINE, path="native")
    assert data["settings"]["path"] == "native" and data["settings"]["mode"] == "native"
    for row in data["rows"]:
        comps = row["components"]
        assert set(comps) == set(COMPONENTS)
        assert all(comps[p]["ms"] > 0 for p in PHASES) and comps["sampling"]["ms"] > 0
        assert abs(row["components_sum_ms"] - row["step_ms"]) <= 1e-9 * row["step_ms"] + 1e-12
        assert set(row["passes_ms"]) == {"native"}


def test_a_model_the_native_step_cannot_run_is_refused_by_name(gemma2_dir):
    with pytest.raises(ObservatoryError, match="activations are torch.bfloat16"):
        profile(sluice.load(gemma2_dir, dtype="bfloat16"), [8], reps=1, hardware=FAKE_MACHINE, path="native")
    with pytest.raises(ObservatoryError, match="path must be one of torch, native"):
        profile(sluice.load(gemma2_dir), [8], reps=1, hardware=FAKE_MACHINE, path="fast")


def test_cli_picks_the_native_path_and_says_when_it_cannot(tiny_dir, capsys, fake_machine, monkeypatch):  # noqa: F811
    base = ["profile", "--model", str(tiny_dir), "--contexts", "8", "--reps", "1", "--json"]
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["path"] == "native"
    assert main(base + ["--path", "torch"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["path"] == "torch"
    # bf16 weights: what LLM(dtype="bfloat16") runs, fp32 activations over bf16 weights in the native step;
    # the bytes are the stored bf16 matrices and the fp32 KV cache
    assert main(base + ["--dtype", "bf16"]) == 0
    out = capsys.readouterr()
    r = json.loads(out.out)
    assert r["settings"]["path"] == "native" and "bf16 weights, fp32 activations" in out.err
    assert r["model"]["dtype"] == "bfloat16" and r["model"]["activation_dtype"] == "float32"
    hf = json.loads((tiny_dir / "config.json").read_text())
    comps = r["rows"][0]["components"]
    assert comps["mlp"]["read_bytes"] == hf["num_hidden_layers"] * 3 * hf["hidden_size"] * hf["intermediate_size"] * 2
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    assert r["model"]["kv_bytes_per_token"] == 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4
    # where the engine would keep bf16 activations (no kernel), the profile does too, and says why
    monkeypatch.setattr(cpu_paths, "set_compute", lambda *a, **k: False)
    assert main(base + ["--dtype", "bf16"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["settings"]["path"] == "torch" and "activations are torch.bfloat16" in out.err
    assert main(base + ["--dtype", "bf16", "--path", "native"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--path native: the native step cannot run this model" in err
    assert main(base + ["--path", "fastest"]) == 2
    assert "--path must be one of auto, torch, native" in capsys.readouterr().err
