import pytest

from ckpt import build_with_tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint with a tokenizer, shared read-only by engine and CLI tests."""
    d = tmp_path_factory.mktemp("tiny-qwen3")
    build_with_tokenizer(d, "qwen3", max_position_embeddings=512)
    return d


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    import sluice
    return sluice.LLM(str(tiny_dir))
