"""/metrics' text (server/metrics.py), rendered from a Metrics object alone: no server needed."""

from __future__ import annotations

import math

from sluice.server.metrics import TTFT_BUCKETS, Metrics, render

STATE = dict(ready=True, draining=False, running=1, waiting=2, max_queue=64)


def samples(text: str, prefix: str) -> dict[str, float]:
    """{le: value} of one histogram's bucket lines."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def test_histogram_buckets_are_cumulative():
    """Prometheus' buckets count the observations <= le, so each one includes the ones before it and
    +Inf equals _count: three observations, one per region of the buckets."""
    m = Metrics()
    for ttft in (0.02, 0.3, 100.0):  # in le=0.025, in le=0.5, past the last bucket (60)
        m.record("stop", prompt_tokens=3, generated=4, ttft=ttft)
    text = render(m.snapshot(**STATE), "tiny")
    got = samples(text, "sluice_time_to_first_token_seconds")
    assert list(got) == [repr(float(b)) for b in TTFT_BUCKETS] + ["+Inf"]
    want = {repr(float(b)): sum(1 for v in (0.02, 0.3, 100.0) if v <= b) for b in TTFT_BUCKETS}
    assert got == {**want, "+Inf": 3}
    assert got["0.01"] == 0 and got["0.025"] == 1 and got["0.5"] == 2 and got["60.0"] == 2
    assert 'sluice_time_to_first_token_seconds_count{model_name="tiny"} 3' in text
    total = [line for line in text.splitlines() if line.startswith("sluice_time_to_first_token_seconds_sum")]
    assert math.isclose(float(total[0].rsplit(" ", 1)[1]), 100.32)
    assert set(samples(text, "sluice_time_per_output_token_seconds").values()) == {0}  # none observed


def test_an_observation_on_a_bucket_edge_counts_in_that_bucket():
    m = Metrics()
    m.record("length", tpot=0.005)
    got = samples(render(m.snapshot(**STATE), "tiny"), "sluice_time_per_output_token_seconds")
    assert got["0.0025"] == 0 and got["0.005"] == 1 and got["+Inf"] == 1
