import pytest

import sluice


@pytest.fixture(scope="module")
def static_llm(tiny_dir):
    """One sequence at a time (batching=False: max_num_seqs=1): the reference a batched request is
    compared with (test_scheduler.py)."""
    return sluice.LLM(str(tiny_dir), batching=False)
