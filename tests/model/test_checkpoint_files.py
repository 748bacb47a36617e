"""Hostile checkpoint files, paths and load() arguments: refused by name, quickly, in bounded memory."""

import json
import os
import struct

import pytest
import torch
from bounded import run_bounded

import sluice
from ckpt import build
from sluice import CheckpointError, ConfigError, ModelNotFoundError
from sluice.model.hub import resolve_model_dir
from sluice.model.safetensors_files import MAX_HEADER_BYTES


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good-llama")
    build(d, "llama")
    return d


@pytest.fixture
def ckpt(tmp_path, good):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((good / f).read_bytes())
    return tmp_path


def set_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def write_safetensors(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


# ---------------------------------------------------------------- the config against the headers
LOAD = """
import sys, time
sys.path.insert(0, {tests!r})
import sluice
import sluice.model.loading  # torch and the loader imported before the clock starts
t = time.time()
try:
    sluice.load({d!r})
except sluice.SluiceError as e:
    print(type(e).__name__, e)
print("seconds", time.time() - t)
"""


@pytest.mark.parametrize("layers, error", [(10 ** 9, "ConfigError"), (65536, "CheckpointError")])
def test_a_billion_layers_is_refused_quickly_in_bounded_memory(ckpt, layers, error):
    """Before the fix, 10^9 layers built a meta model for minutes and gigabytes. Now the ceiling
    (65536) refuses it as it is read, and any count the files do not hold fails on the headers,
    before a model is built."""
    set_config(ckpt, num_hidden_layers=layers)
    # timeout: a hang-stopper, 10x the quiet ~5 s with imports (the load itself: 0.01 s, in r.stdout)
    r = run_bounded(LOAD.format(tests=os.path.dirname(__file__), d=str(ckpt)), mem_mib=1500, timeout=120)
    assert not r.timed_out and r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(error) and "num_hidden_layers" in r.stdout, r.stdout
    # refused as read: no model built (test_headers_are_checked_before_a_model_is_built shows the order)
    assert r.peak_mib < 600, r.peak_mib  # what importing torch and sluice takes (measured 221 MiB)


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 2}, "number of layers .* is 2, but the checkpoint holds tensors for 3"),
    # (the first tensor in the file's order that disagrees is named)
    ({"hidden_size": 1 << 24}, r"tensor '[\w.]+' in model.safetensors has shape \(96, 64\), "
                               r"but the config implies \(96, 16777216\)"),
    ({"vocab_size": 100}, r"(embed_tokens|lm_head).weight' .*has shape \(96, 64\).*implies \(100, 64\)"),
    ({"intermediate_size": 10 ** 6}, r"mlp.\w+_proj.weight' .*implies \((1000000, 64|64, 1000000)\)"),
    ({"head_dim": 4096}, r"self_attn.[qkvo]_proj.weight' .*implies \((16384|8192), 64\)"),
    ({"tie_word_embeddings": True, "num_key_value_heads": 4}, r"k_proj.weight.*implies \(64, 64\)"),
])
def test_config_sizes_are_checked_against_the_headers(ckpt, changes, message):
    set_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=message):
        sluice.load(ckpt)


def test_headers_are_checked_before_a_model_is_built(ckpt, monkeypatch):
    import sluice.model.loading as loading
    built = []
    monkeypatch.setattr(loading, "Transformer", lambda cfg: built.append(cfg))
    set_config(ckpt, intermediate_size=113)
    with pytest.raises(CheckpointError, match="_proj.weight.*113"):
        sluice.load(ckpt)
    assert built == []


# ---------------------------------------------------------------- safetensors headers
@pytest.mark.parametrize("make, message", [
    (lambda p: write_safetensors(p, b"{}", length=2 ** 60), "header claims 1,152,921,504,606,846,976 bytes, more than"),
    (lambda p: write_safetensors(p, b"{}", length=MAX_HEADER_BYTES), "header claims .* but the file has"),
    (lambda p: p.write_bytes(b"\x01\x00"), "too short"),
    (lambda p: write_safetensors(p, b"[" * 200_000 + b"]" * 200_000), "not valid JSON"),
    (lambda p: write_safetensors(p, b"\xff\xfe"), "not valid JSON"),
    (lambda p: write_safetensors(p, ["a"]), "not a JSON object"),
    (lambda p: write_safetensors(p, {"model.norm.weight": {"dtype": "F32", "shape": [10 ** 12],
                                                           "data_offsets": [0, 4]}}, b"\0" * 4),
     "'model.norm.weight' is malformed or points past the file's 4 data bytes"),
    (lambda p: write_safetensors(p, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 2 ** 40]}}, b"\0" * 4),
     "points past"),
    (lambda p: write_safetensors(p, {"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
     "malformed"),
    (lambda p: write_safetensors(p, {"w": [1, 2]}), "malformed"),
])
def test_bad_headers_are_refused_before_safetensors_reads_them(ckpt, make, message):
    make(ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"model.safetensors: .*{message}"):
        sluice.load(ckpt)


def test_integer_dtype_is_refused_from_the_header(ckpt):
    from ckpt import add_tensors
    add_tensors(ckpt, {"model.norm.weight": torch.ones(64, dtype=torch.int8)})
    with pytest.raises(CheckpointError, match="'model.norm.weight' in model.safetensors has dtype torch.int8"):
        sluice.load(ckpt)


def test_fifo_is_not_read(ckpt):
    """A FIFO (or a device) named model.safetensors would block forever or never end."""
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="not a regular file"):
        sluice.load(ckpt)


# ---------------------------------------------------------------- model.safetensors.index.json
@pytest.fixture
def sharded(tmp_path):
    ref = build(tmp_path, "qwen3", max_shard_size="60KB")
    return tmp_path, ref


def set_index(d, weight_map):
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def shard_names(d):
    return sorted(p.name for p in d.glob("model-0*.safetensors"))


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/passwd", "sub/../../x.safetensors", "..\\x.safetensors",
                                 ""])
def test_shard_names_must_stay_inside_the_model_dir(sharded, bad):
    d, _ = sharded
    set_index(d, {"model.norm.weight": bad, "lm_head.weight": shard_names(d)[0]})
    with pytest.raises(CheckpointError, match="must be a file name inside"):
        sluice.load(d)


def test_shard_symlink_escaping_the_dir_is_refused(sharded, tmp_path_factory):
    d, _ = sharded
    outside = tmp_path_factory.mktemp("elsewhere")
    name = shard_names(d)[0]
    (d / name).rename(outside / name)
    (d / name).symlink_to(outside / name)
    with pytest.raises(CheckpointError, match=f"{name} .* is a link to .*outside the model directory"):
        sluice.load(d)


@pytest.mark.parametrize("weight_map, message", [
    (["model-00001-of-00002.safetensors"], "weight_map must be a JSON object"),
    ({"model.norm.weight": 1}, "weight_map must be a JSON object of tensor name -> shard file name"),
    ({"model.norm.weight": ["a.safetensors"]}, "weight_map must be"),
    ({}, "lists no shard files"),
    ({f"t{i}": f"s{i}.safetensors" for i in range(5000)}, "lists 5,000 shard files; sluice reads at most 4,096"),
])
def test_weight_map_types_are_refused_by_name(sharded, weight_map, message):
    d, _ = sharded
    set_index(d, weight_map)
    with pytest.raises(CheckpointError, match=message):
        sluice.load(d)


def test_index_that_is_not_an_object(sharded):
    d, _ = sharded
    (d / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="weight_map must be"):
        sluice.load(d)


def test_tensor_in_two_shards_is_refused(sharded):
    from safetensors.torch import load_file, save_file
    d, _ = sharded
    first, second = shard_names(d)[:2]
    tensors = load_file(d / second)
    tensors.update({k: v for k, v in load_file(d / first).items()})
    save_file(tensors, d / second, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"is in both {first} and {second}"):
        sluice.load(d)


def test_hf_cache_layout_with_symlinked_blobs_loads(tmp_path, monkeypatch):
    """A real hub snapshot holds symlinks into ../../blobs: inside the repo's cache folder, allowed."""
    repo = tmp_path / "hub" / "models--tiny--sharded"
    snap = repo / "snapshots" / "abc123"
    ref = build(snap, "qwen3", max_shard_size="60KB")
    (repo / "blobs").mkdir()
    for f in list(snap.iterdir()):
        f.rename(repo / "blobs" / f.name)
        f.symlink_to(os.path.relpath(repo / "blobs" / f.name, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ids = torch.arange(20)[None]
    with torch.no_grad():
        assert (sluice.load("tiny/sharded")(ids) - ref(ids).logits).abs().max() <= 1e-4


# ---------------------------------------------------------------- paths and load() arguments
@pytest.mark.parametrize("name, message", [
    ("m" * 5000, "cannot be used: File name too long"),
    ("/" + "m" * 5000, "cannot be used: File name too long"),
    ("org/" + "m" * 5000, "cannot be used: File name too long"),
    ("model\0dir", "contains a NUL byte"),
    ("", "is empty"),
    (5, "a directory path or a repo id"),
    (["model"], "a directory path or a repo id"),
])
def test_hostile_paths_give_model_not_found(name, message):
    with pytest.raises(ModelNotFoundError, match=message) as e:
        resolve_model_dir(name)
    assert len(str(e.value)) < 600  # a 5,000-character name is shortened in the message


def test_long_path_through_load(tmp_path):
    with pytest.raises(ModelNotFoundError, match="File name too long"):
        sluice.load(str(tmp_path / ("m" * 5000)))


def test_a_file_is_not_a_model_dir(ckpt):
    with pytest.raises(ModelNotFoundError, match="is a file, not a directory"):
        sluice.load(ckpt / "config.json")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_unreadable_dir(ckpt):
    ckpt.chmod(0)
    try:
        with pytest.raises(ModelNotFoundError, match="is not readable"):
            sluice.load(ckpt)
    finally:
        ckpt.chmod(0o755)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "float16x"}, "dtype must be one of .*got 'float16x'"),
    ({"dtype": None}, "dtype must be one of"),
    ({"dtype": ["float32"]}, "dtype must be one of"),
    ({"dtype": torch.float16}, "dtype must be one of .*torch.float16"),
    ({"dtype": "f" * 10_000}, r"dtype must be one of .*\(10002 characters\)"),
    ({"device": "meta"}, "device must be cpu, cuda, cuda:N or mps, got 'meta'"),
    ({"device": None}, "device must be"),
    ({"device": True}, "device must be .*got True"),
    ({"device": "cpu:1"}, "device must be .*got 'cpu:1'"),
    ({"device": 10 ** 30}, "device must be"),
    ({"device": "cuda:-1"}, "device must be"),
    ({"device": "d" * 10_000}, r"device must be .*\(10002 characters\)"),
    ({"quantize": "int3"}, "quantize must be one of int8, int4"),
    ({"quantize": True}, "quantize must be one of"),
    ({"quantize": 8}, "quantize must be one of"),
])
def test_bad_load_arguments_name_the_value(good, kwargs, message):
    with pytest.raises(ConfigError, match=message) as e:
        sluice.load(good, **kwargs)
    assert len(str(e.value)) < 600


def test_unreadable_dir_as_root_sees_it(ckpt, monkeypatch):
    """The same branch where root would read the directory anyway (CI often runs as root)."""
    import sluice.model.hub as hub
    monkeypatch.setattr(hub.os, "access", lambda path, mode: False)
    with pytest.raises(ModelNotFoundError, match="is not readable"):
        resolve_model_dir(ckpt)
