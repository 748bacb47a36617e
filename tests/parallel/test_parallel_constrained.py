"""Constrained decoding under tensor parallelism (2 gloo ranks): every rank runs the same grammar over
the same tokens and masks its own vocabulary shard, so the outputs equal the single process's, token
for token, greedy and seeded sampled, and every rank returns them."""

from __future__ import annotations

import json

import pytest

from test_parallel_spawn import ok, run_ranks

pytestmark = pytest.mark.slow  # gloo ranks spawned

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["a", "bb", "ccc"]},
                                           "pts": {"type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 2}},
          "required": ["id", "kind", "pts"], "additionalProperties": False,
          "$defs": {"p": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                          "minItems": 2, "maxItems": 2}}}
PROMPTS = ["def main():\n", "The answer is", "x = "]


def _outputs(llm):
    from sluice import Constraint, SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=60, constraint=Constraint("json_schema", SCHEMA)),
              SamplingParams(temperature=1.0, seed=7, max_tokens=60, constraint=Constraint("json_schema", SCHEMA)),
              SamplingParams(temperature=0.8, seed=3, top_k=30, max_tokens=20, constraint=Constraint("regex", "[a-f]{3,8}!")),
              SamplingParams(temperature=1.0, seed=5, max_tokens=12)]  # a free row in the same batch
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(PROMPTS + PROMPTS[:1], params)]


def _generate(ranks):
    import sluice
    return _outputs(sluice.LLM(tensor_parallel=ranks.world))


def test_constrained_generation_equals_single_process(tmp_path):
    import sluice
    ref = _outputs(sluice.LLM())
    for text, reason in [(o[1], o[2]) for o in ref[:2]]:
        assert reason == "stop" and isinstance(json.loads(text), dict)
    for res in ok(run_ranks(tmp_path, 2, _generate, timeout_s=120)):
        assert res == ref
