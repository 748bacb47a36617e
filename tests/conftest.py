import os

import pytest

from ckpt import build_with_tokenizer

# The suite tests the native kernels, not the torch path that serves while they build in the background
# (engine/native/extension.py): a missing kernel is built before the first test that asks for it, saying
# so. Subprocesses the tests start inherit this.
os.environ.setdefault("SLUICE_KERNEL_BUILD", "wait")


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
