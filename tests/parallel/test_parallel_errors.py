"""Tensor parallelism's clear errors: sizes that do not split (every family splits otherwise, fused
q|k|v and full-width qk-norm included), ranks that disagree on the checkpoint, and a rank that dies
or hangs (the others raise, within the timeout)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from sluice.errors import ConfigError
from sluice.model.config import ModelConfig
from test_parallel_spawn import run_ranks

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                  num_kv_heads=4, head_dim=8, max_position_embeddings=64)


@pytest.mark.parametrize("changes, world, says", [
    (dict(), 3, "num_attention_heads (8) to be a multiple of 3"),
    (dict(intermediate_size=100), 8, "intermediate_size (100) to be a multiple of 8"),
    (dict(vocab_size=98), 4, "vocab_size (98) to be a multiple of 4"),
    (dict(num_heads=12, num_kv_heads=6, intermediate_size=96), 4, "num_key_value_heads (6) to be a multiple of 4"),
    (dict(num_heads=12, num_kv_heads=4, intermediate_size=96), 6, "num_key_value_heads (4) to divide 6"),
    (dict(qk_norm="full", architecture="Olmo2ForCausalLM", num_heads=12, num_kv_heads=12, intermediate_size=96),
     8, "num_attention_heads (12) to be a multiple of 8"),
    (dict(architecture="GPT2LMHeadModel", num_heads=6, num_kv_heads=6, intermediate_size=96), 4,
     "num_attention_heads (6) to be a multiple of 4"),
    (dict(), 0, "positive integer"),
])
def test_sizes_that_do_not_split_are_refused(changes, world, says):
    from sluice.parallel import rank_config
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        rank_config(CFG.replace(**changes), world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("changes", [
    dict(qk_norm="full", architecture="Olmo2ForCausalLM", num_kv_heads=2),  # was refused: full-width qk-norm
    dict(architecture="GPT2LMHeadModel", num_kv_heads=8),  # was refused: fused q|k|v
    dict(architecture="GPTNeoXForCausalLM", num_kv_heads=8, rotary_dim=4),
])
def test_fused_qkv_and_full_width_qk_norm_split(changes, world):
    """Once refused, now split (test_parallel_families.py checks their logits)."""
    from sluice.parallel.sharding import rank_config, slice_of
    cfg = CFG.replace(**changes)
    local = rank_config(cfg, world)
    assert local.num_heads == 8 // world and local.intermediate_size == 128 // world
    if cfg.qk_norm == "full":  # the gains are sliced like q's and k's rows
        D = cfg.head_dim
        assert slice_of(cfg, 1, world, "layers.0.attn.q_norm.weight") == (slice(8 // world * D, 2 * 8 // world * D),)
        assert slice_of(cfg, 1, world, "layers.0.attn.k_norm.weight") == slice_of(cfg, 1, world, "layers.0.attn.k.weight")


def test_gqa_replication_gives_each_rank_the_kv_head_of_its_queries():
    from sluice.parallel.sharding import kv_heads_of, rank_config
    two = CFG.replace(num_kv_heads=2)  # 8 query heads, groups of 4; 4 ranks of 2 query heads
    assert [list(kv_heads_of(two, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    assert rank_config(two, 4).num_kv_heads == 1 and rank_config(two, 4).num_heads == 2
    assert [list(kv_heads_of(CFG, r, 2)) for r in range(2)] == [[0, 1], [2, 3]]


def test_init_without_torchrun_environment_says_so(monkeypatch):
    from sluice import parallel as P
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        P.init()
    with pytest.raises(ConfigError, match="rank 2 is outside a group of 2"):
        P.init(2, 2, "file:///nonexistent")


@pytest.mark.parametrize("env, says", [
    ({"WORLD_SIZE": "2", "RANK": "abc"}, "RANK='abc' must be an integer >= 0"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' must be an integer >= 1"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1' must be an integer >= 0"),
])
def test_a_torchrun_variable_that_is_not_an_integer_is_one_line_exit_2(monkeypatch, capsys, env, says):
    from sluice.cli import main
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["generate", "--tp", "2", "x"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.startswith("sluice generate: error:") and len(err.strip().splitlines()) == 1


def test_init_refuses_a_rank_that_is_not_an_integer(monkeypatch):
    from sluice import parallel as P
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK='abc': torchrun sets these to integers"):
        P.init()


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    from ckpt import build
    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4)
    a, b = tmp_path_factory.mktemp("tp-a"), tmp_path_factory.mktemp("tp-b")
    build(a, "llama", **sizes)
    build(b, "llama", **{**sizes, "intermediate_size": 192})
    return str(a), str(b)


def _disagree(ranks, dirs):
    from sluice import parallel as P
    P.load_rank(dirs[ranks.rank], ranks)


def test_ranks_that_disagree_on_the_checkpoint_are_refused(tmp_path, llama_dirs):
    results = run_ranks(tmp_path, 2, _disagree, llama_dirs, timeout_s=30)
    for kind, (name, message, _) in results:
        assert kind == "error" and name == "CheckpointError", message
        assert "disagree on the checkpoint" in message and llama_dirs[0] in message and llama_dirs[1] in message


def _huge(ranks, d):
    """load_rank twice on this rank: file-backed (SLUICE_HUGE_PAGES=off), then moved with the size floor lowered so
    a tiny model's slices move; what moved, whether each moved tensor starts on a 2 MiB boundary, and whether the
    two give the same logits (the forward's collectives run on both)."""
    from sluice import parallel as P
    from sluice.model import hugepages
    os.environ["SLUICE_HUGE_PAGES"] = "off"
    base = P.load_rank(d, ranks)
    del os.environ["SLUICE_HUGE_PAGES"]
    hugepages.MIN_BYTES, hugepages.thp_mode = 1024, lambda: "madvise"
    moved = P.load_rank(d, ranks)
    big = {n: t for n, t in moved.state_dict().items() if t.nbytes >= 1024}
    prompt = torch.tensor([[3, 17, 42, 5]])
    # memory for this rank's slices alone but not for both ranks' (they share this machine): nothing moves
    hugepages.mem_available = lambda: int(1.5 * moved.huge_pages["moved_bytes"] / hugepages.FIT_FRACTION)
    tight = P.load_rank(d, ranks).huge_pages
    return dict(tight=tight, base=base.huge_pages, moved=moved.huge_pages, big=len({t.data_ptr() for t in big.values()}),
                aligned=all(t.data_ptr() % hugepages.HUGE == 0 for t in big.values()),
                same=torch.equal(moved(prompt), base(prompt)))


def test_each_rank_moves_its_slices_into_huge_pages(tmp_path, llama_dirs):
    for kind, r in run_ranks(tmp_path, 2, _huge, llama_dirs[0], timeout_s=30):
        assert kind == "ok", r
        assert r["base"] == {"moved_bytes": 0, "tensors": 0, "reason": "SLUICE_HUGE_PAGES=off"}
        assert r["moved"]["reason"] is None and r["moved"]["tensors"] == r["big"] > 0 and r["moved"]["moved_bytes"] > 0
        assert r["aligned"] and r["same"]
        assert r["tight"]["tensors"] == 0 and "the other ranks here move" in r["tight"]["reason"], r["tight"]


def _dies(ranks, d, how, flags):
    from test_parallel_spawn import raised, stay_silent

    from sluice import parallel as P
    m = P.load_rank(d, ranks)
    prompt = torch.tensor([[3, 17, 42, 5]])
    m(prompt)  # one step together
    if ranks.rank == 1:
        if how == "exit":
            os._exit(0)  # no goodbye: the process is gone mid-run
        stay_silent(flags, ranks.timeout_s)  # alive but silent
        return None
    start = time.monotonic()
    try:
        for _ in range(1000):
            m(prompt)
    except P.ParallelError as e:
        return time.monotonic() - start, str(e), raised(flags)
    return None


@pytest.mark.parametrize("how", ["exit", pytest.param("hang", marks=pytest.mark.slow)])
def test_a_rank_that_dies_or_hangs_makes_the_others_raise_within_the_timeout(tmp_path, llama_dirs, how):
    timeout = 8.0
    flags = tmp_path / "flags"
    flags.mkdir()
    # wait_s stops a hang: 10x the ~25 s (spawn, load, the 8 s timeout) this takes on a quiet machine
    results = run_ranks(tmp_path, 2, _dies, llama_dirs[0], how, str(flags), timeout_s=timeout, wait_s=300)
    kind, value = results[0]
    assert kind == "ok" and value is not None, value
    elapsed, message, after_the_other_left = value
    print(f"{how}: rank 0 raised after {elapsed:.1f} s: {message}")
    # quiet, at most the timeout; 10x that still tells the timeout given from the default (300 s)
    assert elapsed < 10 * timeout
    assert not after_the_other_left  # a silent rank is caught by the timeout, not by its leaving
    assert "rank 0: all_reduce failed: another rank exited or did not answer" in message


def test_backend_and_device_follow_the_model_device(monkeypatch):
    """gloo for a CPU model even where CUDA exists (NCCL cannot move CPU tensors); NCCL for a CUDA one;
    "cuda" without an index is this rank's own GPU, torchrun's LOCAL_RANK, made current for NCCL."""
    import torch

    from sluice.parallel import group
    seen = {}
    monkeypatch.setattr(group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(group.dist, "init_process_group", lambda backend, **kw: seen.setdefault("backends", []).append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    group.init(0, 2, "file:///nonexistent", device="cpu")
    group.init(0, 2, "file:///nonexistent")
    group.init(0, 2, "file:///nonexistent", device="cuda")
    assert seen["backends"] == ["gloo", "gloo", "nccl"]
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    ranks = group.Ranks(rank=11, world=16, timeout_s=5.0)
    assert group.rank_device("cuda", ranks) == torch.device("cuda", 3) and current == [torch.device("cuda", 3)]
    assert group.rank_device("cuda:1", ranks) == torch.device("cuda", 1)
    assert group.rank_device("cpu", ranks) == torch.device("cpu") and len(current) == 1
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert group.rank_device("cuda", ranks) == torch.device("cuda", 3)  # 11 % 8
