import pytest
from tok_fixtures import build_tokenizer


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny Qwen3-like tokenizer directory (tok_fixtures.py), read-only: tests copy it to change a file."""
    path = tmp_path_factory.mktemp("qwen")
    build_tokenizer(path, "qwen")
    return path
