"""What every test folder shares. tests/ mirrors src/sluice: tests/text, model, engine, observatory, parallel,
training, server, cli, and bench (the bench/ scripts and sluice.benchmarks); the bundled model's tests sit here
at the top. Helpers imported by bare name from any folder (pyproject: pythonpath = ["tests"]): ckpt.py (tiny
random checkpoints), tok_fixtures.py (tiny tokenizers), bounded.py (a child process with capped memory),
pool_checks.py (the KV block pool's invariants).

`pytest -m "not slow"` is the inner loop; the full suite (`pytest`) is what CI runs. A test is marked slow
(`@pytest.mark.slow`, or `pytestmark` for a whole file) when it takes ~8 s or more on a busy 2-core machine:
spawned ranks, server processes, benchmark scripts, torch.compile, longer training runs, most subprocess CLI
runs. No test asserts speed: a time limit in a test only stops a hang, at 10x+ what it waits on takes, and
says so.
"""

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
