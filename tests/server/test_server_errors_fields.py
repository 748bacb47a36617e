"""Every SamplingParams refusal reaching the server names its own request parameter (param), not the prompt."""

import dataclasses

import pytest

from sluice.engine.sampling_params import SamplingParams
from sluice.errors import RequestError
from sluice.server.errors import from_sluice

BAD = {"max_tokens": 0, "temperature": 3.0, "top_k": -5, "top_p": 0.0, "min_p": 2.0, "repetition_penalty": 0.0,
       "presence_penalty": 2.5, "frequency_penalty": -3.0, "seed": 1.5, "logprobs": 21, "prompt_logprobs": 21, "stop": [""],
       "stop_token_ids": [-1], "ignore_eos": "yes", "constraint": {"type": "object"}}


def test_the_table_covers_every_field():
    assert set(BAD) == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_refused_sampling_field_is_the_400s_param(name):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{name: BAD[name]})
    err = from_sluice(e.value, "prompt", aliases={"logprobs": "top_logprobs"})
    assert err.status == 400
    assert err.param == ("top_logprobs" if name == "logprobs" else name), str(e.value)
