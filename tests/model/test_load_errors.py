"""Bad checkpoints are refused with a message that names the problem."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import sluice
from sluice import CheckpointError, ConfigError, ModelNotFoundError
from ckpt import build


@pytest.fixture
def ckpt(tmp_path):
    build(tmp_path, "qwen3")
    return tmp_path


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d, fn):
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def test_unknown_architecture(ckpt):
    edit_config(ckpt, architectures=["GPTBigCodeForCausalLM"])
    with pytest.raises(ConfigError, match="GPTBigCodeForCausalLM.*not supported"):
        sluice.load(ckpt)


def test_unsupported_rope_type(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ConfigError, match="'yarn'"):
        sluice.load(ckpt)


def test_qwen_sliding_window_refused(ckpt):
    edit_config(ckpt, use_sliding_window=True, sliding_window=16)
    with pytest.raises(ConfigError, match="use_sliding_window"):
        sluice.load(ckpt)


def test_unsupported_activation(ckpt):
    edit_config(ckpt, hidden_act="quick_gelu")
    with pytest.raises(ConfigError, match="quick_gelu"):
        sluice.load(ckpt)


def test_old_config_spelling(ckpt):
    """rope_theta / rope_scaling / torch_dtype (older transformers) read like rope_parameters."""
    cfg = json.loads((ckpt / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.pop("dtype", None)
    cfg.update(rope_theta=theta, rope_scaling={"type": "linear", "factor": 2.0}, torch_dtype="bfloat16")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    c = sluice.ModelConfig.from_hf(ckpt)
    assert c.rope_theta == theta and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.torch_dtype == "bfloat16"


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: 'model.layers.1.mlp.up_proj.weight' \(112, 64\)"):
        sluice.load(ckpt)


def test_wrong_shape(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(24, 64)
    edit_tensors(ckpt, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj.weight.*shape \(24, 64\).*implies \(48, 64\)"):
        sluice.load(ckpt)


def test_unexpected_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias", torch.zeros(64)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
        sluice.load(ckpt)


def test_integer_tensor_refused(ckpt):
    def quantize(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int8)
    edit_tensors(ckpt, quantize)
    with pytest.raises(CheckpointError, match="model.norm.weight.*torch.int8"):
        sluice.load(ckpt)


def test_pickle_checkpoint_refused(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*arbitrary code.*safetensors"):
        sluice.load(ckpt)
    assert (ckpt / "pytorch_model.bin").read_bytes() == b"not loaded"  # untouched


def test_missing_shard(tmp_path):
    build(tmp_path, "qwen3", max_shard_size="60KB")
    shard = sorted(tmp_path.glob("model-0000*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        sluice.load(tmp_path)


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        sluice.load(ckpt)


def test_bad_dtype(ckpt):
    with pytest.raises(ConfigError, match="float16x"):
        sluice.load(ckpt, dtype="float16x")


def test_repo_id_not_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match=r"Qwen/Qwen3-0\.6B") as e:
        sluice.load("Qwen/Qwen3-0.6B")
    assert str(tmp_path / "hub") in str(e.value)


def test_repo_id_resolves_in_cache(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--tiny--qwen3" / "snapshots" / "abc123"
    ref = build(snap, "qwen3")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert (sluice.load("tiny/qwen3")(ids) - ref(ids).logits).abs().max() <= 1e-4


def test_unimplemented_valve_values_are_refused(ckpt):
    cfg = sluice.ModelConfig.from_hf(ckpt)
    with pytest.raises(ConfigError, match="norm_placement='peri' is not implemented"):
        cfg.replace(norm_placement="peri")
    with pytest.raises(ConfigError, match="qk_norm='channel'"):
        cfg.replace(qk_norm="channel")
    with pytest.raises(ConfigError, match="parallel_residual"):
        cfg.replace(norm_placement="sandwich", parallel_residual=True)
    with pytest.raises(ConfigError, match="rotary dimension 7"):
        cfg.replace(rotary_dim=7)
    with pytest.raises(ConfigError, match="final_softcap must be a positive number"):
        cfg.replace(final_softcap=0.0)
    with pytest.raises(ConfigError, match="layer_types"):
        cfg.replace(layer_types=("full", "local", "full"))
