"""sluice.model.hub: local directories and offline lookups in a fake Hugging Face cache."""

import socket

import pytest
from tok_fixtures import build_tokenizer

from sluice.errors import ModelNotFoundError
from sluice.model.hub import hf_cache_dir, resolve_model_dir
from sluice.text.tokenizer import Tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CACHE_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def fake_cache(cache_dir, repo_id="org/tiny-model", commit=COMMIT):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("sluice.hub tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)


def test_local_directory_wins(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    assert resolve_model_dir(tmp_path / "model") == (tmp_path / "model").resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("model") == (tmp_path / "model").resolve()
    assert resolve_model_dir("./model") == (tmp_path / "model").resolve()


@pytest.mark.parametrize("name", ["./missing", "/definitely/not/here", "~/no-such-model-dir"])
def test_missing_local_path_is_not_treated_as_repo_id(name):
    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        resolve_model_dir(name)
    assert name in str(info.value)


def test_file_is_not_a_model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="is a file, not a directory"):
        resolve_model_dir(tmp_path / "config.json")


def test_repo_id_from_hf_hub_cache(tmp_path, monkeypatch):
    snapshot = fake_cache(tmp_path / "hubcache")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE takes precedence
    assert resolve_model_dir("org/tiny-model") == snapshot.resolve()


def test_repo_id_from_hf_home(tmp_path, monkeypatch):
    snapshot = fake_cache(tmp_path / "hfhome" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hf_cache_dir() == tmp_path / "hfhome" / "hub"
    assert resolve_model_dir("org/tiny-model") == snapshot.resolve()


def test_default_cache_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    snapshot = fake_cache(tmp_path / ".cache" / "huggingface" / "hub")
    assert resolve_model_dir("org/tiny-model") == snapshot.resolve()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"


@pytest.mark.parametrize("repo_id", ["org/not-downloaded", "Qwen/Qwen3-0.6B", "not a valid id!"])
def test_repo_not_in_cache_explains_where_it_looked(tmp_path, monkeypatch, repo_id):
    fake_cache(tmp_path / "hubcache")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir(repo_id)
    message = str(info.value)
    assert repr(repo_id) in message and str(tmp_path / "hubcache") in message
    assert f"huggingface-cli download {repo_id}" in message and "local model directory" in message


def test_ref_pointing_at_missing_snapshot(tmp_path, monkeypatch):
    snapshot = fake_cache(tmp_path / "hubcache")
    (snapshot / "config.json").unlink()
    snapshot.rmdir()  # an interrupted download: refs/main names a commit that never landed
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    with pytest.raises(ModelNotFoundError, match="org/tiny-model"):
        resolve_model_dir("org/tiny-model")


def test_tokenizer_loads_by_repo_id(tmp_path, monkeypatch):
    snapshot = fake_cache(tmp_path / "hfhome" / "hub", repo_id="Qwen/Qwen3-Tiny")
    build_tokenizer(snapshot, "qwen")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    tok = Tokenizer.from_pretrained("Qwen/Qwen3-Tiny")
    assert tok.decode(tok.encode("hello world")) == "hello world"
