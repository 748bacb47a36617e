"""`sluice roofline --tp N`: one rank's bytes and the step's collectives against hand-computed numbers
and against the shapes the real ranks build (parallel/loading.py); N=1 is the plain roofline; bad
--tp values and links are refused by name; the CLI path prints tables and JSON."""

import json

import pytest
import torch

from sluice.cli import main
from sluice.engine.kv_cache import KVCache
from sluice.errors import ConfigError, ObservatoryError
from sluice.model import ModelConfig
from sluice.observatory import roofline_tp
from sluice.observatory.costs import totals
from sluice.observatory.roofline import roofline
from sluice.parallel.loading import build_rank_model
from sluice.parallel.sharding import rank_config

# Tiny Llama: C=64, L=2, H=8, K=2 (fewer KV heads than 4 ranks: replicated), D=8, I=128, V=256, untied.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 128,
        "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu"}
# a link with round numbers: 1 GB/s = 1,000 bytes per us, 1 us per ring step, 10 us per collective
LINK = dict(interconnect="pcie", link_bandwidth=1.0, link_latency=1.0, collective_overhead=10.0)


@pytest.fixture
def cfg_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.fixture
def cfg(cfg_path):
    return ModelConfig.from_json_file(cfg_path)


def test_rank_bytes_by_hand(cfg):
    """tp=4, batch 2, context 16, bf16: every number below worked out on paper from TINY."""
    r = roofline(cfg, "h100", batch=2, context=16, dtype=torch.bfloat16, tp=4, **LINK)
    c = r["costs"]
    # per rank: 2 query heads, 1 KV head (replicated), I/4 = 32, V/4 = 64; 2 bytes per value; 2 layers
    assert c["qkv_proj"]["param_bytes"] == 2 * 64 * (2 * 8 + 2 * 1 * 8) * 2 == 8192
    assert c["o_proj"]["param_bytes"] == 2 * (2 * 8) * 64 * 2 == 4096
    assert c["mlp"]["param_bytes"] == 2 * 3 * 64 * 32 * 2 == 24576
    assert c["norms"]["param_bytes"] == 2 * 2 * 64 * 2 == 512  # replicated whole
    assert c["final_norm"]["param_bytes"] == 64 * 2
    assert c["embedding"]["param_bytes"] == c["lm_head"]["param_bytes"] == 64 * 64 * 2 == 8192
    # KV: 1 of the 2 heads, so half the cache (not a quarter); K and V, 2 layers, B=2, S=16, D=8
    assert c["attention"]["read_bytes"] == 2 * 2 * 2 * 16 * 1 * 8 * 2 == 2048
    p = r["parallel"]["per_token"]
    assert p["kv_bytes"] == 2048
    assert p["logits_bytes"] == 2 * 64 * 4  # the fp32 logits of this rank's 64 ids
    assert p["weights_bytes"] == 8192 + 4096 + 24576 + 512 + 128 + 2 * 64 * 2 + 8192 == 45952  # 2 embedding rows
    assert totals(c)["param_bytes"] == 53888
    assert r["parallel"]["rank_resident_bytes"] == 53888 + 2048
    # collectives: 2L+1 = 5 all-reduces of (2, 64) bf16 = 256 bytes; ring over 4: 6 steps, 2*3/4*256 = 384 sent
    act = [x for x in r["parallel"]["collectives"] if "(B, hidden)" in x["what"]]
    assert sum(x["count"] for x in act) == 5
    assert all(x["bytes"] == 256 and x["steps"] == 6 and x["sent_bytes_each"] == 384 for x in act)
    assert all(x["us_each"] == pytest.approx(10 + 6 + 0.384) for x in act)
    # sampler: 2 all-reduces of 8 bytes (sent 12 each), 1 all-gather of 32 bytes (3 steps, sent 96)
    assert p["communication_bytes"] == 5 * 384 + 2 * 12 + 96 == 2040
    assert p["collectives"] == 8
    assert p["communication_ms"] * 1e3 == pytest.approx(5 * 16.384 + 2 * 16.012 + 13.096)
    bw = 3350e9  # h100
    assert p["weights_ms"] == pytest.approx(45952 / bw * 1e3)
    assert p["step_ms"] == pytest.approx(max(p["memory_ms"], p["compute_ms"]) + p["communication_ms"])
    assert any("replicated" in n for n in r["notes"])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_bytes_are_the_rank_models_bytes(cfg, tp):
    """What the roofline says a rank holds is what parallel/loading.py builds for every rank."""
    costs = roofline_tp.rank_costs(cfg, tp, 3, 20, torch.bfloat16)
    for rank in range(tp):
        model = build_rank_model(cfg, rank, tp)  # meta device: shapes only
        assert totals(costs)["param_bytes"] == sum(p.numel() * 2 for p in model.parameters())
    assert costs["attention"]["read_bytes"] == KVCache.nbytes_for(rank_config(cfg, tp), 3, 20, torch.bfloat16)


@pytest.mark.parametrize("hardware", ["h200", "a100"])
def test_tp1_is_the_plain_roofline(cfg, hardware):
    plain = roofline(cfg, hardware, batch=3, context=50)
    assert "parallel" not in plain
    assert roofline(cfg, hardware, batch=3, context=50, tp=1) == plain
    one = roofline(cfg, hardware, batch=3, context=50, tp=1, interconnect="ethernet")
    assert {k: v for k, v in one.items() if k != "parallel"} == plain
    p = one["parallel"]["per_token"]
    assert p["communication_ms"] == 0 and p["communication_bytes"] == 0
    assert p["step_ms"] == plain["predicted"]["step_ms"]  # exactly
    assert one["parallel"]["speedup_vs_one_gpu"] == 1.0


def test_more_ranks_less_per_rank_more_talk(cfg):
    r2, r4 = (roofline(cfg, "h200", tp=n, interconnect="nvlink") for n in (2, 4))
    assert r4["parallel"]["per_token"]["weights_bytes"] < r2["parallel"]["per_token"]["weights_bytes"]
    assert r4["parallel"]["per_token"]["communication_ms"] > r2["parallel"]["per_token"]["communication_ms"]
    slow = roofline(cfg, "h200", tp=4, interconnect="nvlink", link_latency=5.0)
    assert slow["parallel"]["per_token"]["communication_ms"] > r4["parallel"]["per_token"]["communication_ms"]
    assert "--link-latency 5" in slow["parallel"]["interconnect"]["source"]


@pytest.mark.parametrize("tp, error, words", [
    (0, ObservatoryError, "--tp must be a positive integer"),
    (-2, ObservatoryError, "--tp must be a positive integer"),
    (True, ObservatoryError, "--tp must be a positive integer"),
    (3, ConfigError, "num_attention_heads (8) to be a multiple of 3"),
    (16, ConfigError, "num_attention_heads (8) to be a multiple of 16"),
])
def test_bad_tp(cfg, tp, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        roofline(cfg, "h200", tp=tp)


def test_bad_kv_split(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY, num_attention_heads=12, num_key_value_heads=3, head_dim=8)))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        roofline(ModelConfig.from_json_file(path), "h200", tp=2)


@pytest.mark.parametrize("kw, words", [
    ({"interconnect": "carrier-pigeon"}, "--interconnect must be one of nvlink"),
    ({"link_bandwidth": 0.0}, "--link-bandwidth must be above 0"),
    ({"link_latency": -1.0}, "--link-latency must be a finite number >= 0"),
    ({"collective_overhead": float("nan")}, "--collective-overhead must be a finite number >= 0"),
])
def test_bad_link(cfg, kw, words):
    with pytest.raises(ObservatoryError, match=words):
        roofline(cfg, "h200", tp=2, **kw)


def test_cli_tables_json_and_report(cfg_path, tmp_path, capsys):
    assert main(["roofline", "--config", str(cfg_path), "--hardware", "h200", "--tp", "4", "--interconnect", "pcie",
                 "--link-latency", "2.5"]) == 0
    text = capsys.readouterr().out
    assert "Tensor parallel over 4 ranks" in text and "collectives of one decode step" in text
    assert "per-token latency of one rank" in text and "MLP down all-reduce" in text
    assert main(["roofline", "--config", str(cfg_path), "--hardware", "h200", "--tp", "2", "--json",
                 "--out", str(tmp_path / "rf")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["parallel"]["tp"] == 2 and d["parallel"]["interconnect"]["name"] == "nvlink"  # the default link
    assert d["parallel"]["per_token"]["collectives"] == 2 * 2 + 1 + 3
    assert (tmp_path / "rf" / "roofline.html").is_file()
    page = (tmp_path / "rf" / "roofline.html").read_text()
    assert "Tensor parallel over 2 ranks" in page
    # the report has the per-token latency and the collectives, not only the one-rank tables
    assert "per-token latency of one rank" in page and "MLP down all-reduce" in page and "communication:" in page


@pytest.mark.parametrize("argv, words", [
    (["--tp", "0"], "--tp takes positive integers, got '0'"),
    (["--tp", "two"], "--tp takes positive integers"),
    (["--tp", "3"], "num_attention_heads (8) to be a multiple of 3"),
    (["--tp", "2", "--interconnect", "wifi"], "--interconnect must be one of"),
    (["--tp", "2", "--link-bandwidth", "fast"], "--link-bandwidth takes a number"),
    (["--tp", "2", "--link-latency", "-3"], "--link-latency must be a finite number >= 0"),
])
def test_cli_refusals(cfg_path, capsys, argv, words):
    assert main(["roofline", "--config", str(cfg_path), "--hardware", "h200", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.count("\n") == 1


def test_each_component_is_labelled_by_the_roof_it_sits_under():
    """predict(): a component whose FLOPs take longer than its bytes is compute-bound, the others
    memory-bound, and its time is the longer of the two (hand numbers: 1 GB/s, 1 GFLOP/s)."""
    from sluice.observatory.costs import COMPONENTS
    from sluice.observatory.roofline import predict

    costs = {k: {"param_bytes": 0, "read_bytes": 10, "flops": 1} for k in COMPONENTS}  # memory: 10 ns vs 1 ns
    costs["mlp"] = {"param_bytes": 0, "read_bytes": 5, "flops": 40}  # compute: 40 ns vs 5 ns
    costs["attention"] = {"param_bytes": 0, "read_bytes": 30, "flops": 29}  # memory, by a little
    out = predict(costs, bandwidth=1e9, flops=1e9, batch=1)
    labels = {k: c["bound"] for k, c in out["components"].items()}
    assert labels == {**{k: "memory" for k in COMPONENTS}, "mlp": "compute"}
    assert out["components"]["mlp"]["ms"] == pytest.approx(40e-6)
    assert out["components"]["attention"]["ms"] == pytest.approx(30e-6)
    assert out["bound"] == "memory"  # the step as a whole: 115 bytes vs 101 FLOPs
    costs["mlp"]["flops"] = 400
    assert predict(costs, 1e9, 1e9, 1)["bound"] == "compute"


def test_a_component_with_negligible_work_sits_under_no_roof():
    """'other' at a few thousand FLOPs and no bytes is not 'compute-bound' (issue 31)."""
    from sluice.observatory.costs import COMPONENTS
    from sluice.observatory.roofline import predict

    costs = {k: {"param_bytes": 0, "read_bytes": 1e6, "flops": 1e6} for k in COMPONENTS}
    costs["other"] = {"param_bytes": 0, "read_bytes": 0, "flops": 3e3}
    out = predict(costs, bandwidth=1e9, flops=1e12, batch=1)
    assert out["components"]["other"]["bound"] == "negligible"
    assert out["components"]["other"]["ms"] == pytest.approx(3e-6)
    assert {c["bound"] for k, c in out["components"].items() if k != "other"} == {"memory"}
    costs["other"]["flops"] = 1e9  # real work: labelled again
    assert predict(costs, 1e9, 1e12, 1)["components"]["other"]["bound"] == "compute"
