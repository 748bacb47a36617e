import pytest

import sluice


@pytest.fixture(scope="module")
def static_llm(tiny_dir):
    """The static one-request path (runner.py): its batch-wide budget checks (test_memory_budget.py) and its
    one-at-a-time rule (test_one_request_at_a_time.py); the continuous-batching engine's pool and
    interleaving are in test_scheduler.py."""
    return sluice.LLM(str(tiny_dir), batching=False)
