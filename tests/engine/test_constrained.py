"""Constrained decoding (engine/constraints.py, guide.py) on the bundled model, which was never trained
to write JSON: at temperature 1 the mask does all the work, so every output must still parse, match
or validate, on every engine path (one request, a mixed batch, speculative decoding)."""

import json
import re

import jsonschema
import pytest
import torch

import sluice
from sluice import Constraint, ConstraintError, SamplingParams
from sluice.model.loading import bundled_draft_dir

SEEDS = range(6)
PROMPTS = ["def main():\n    ", "The weather today is", "import os\n"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
# nested objects through $ref, a $ref inside a $ref, arrays of refs, an enum of mixed types
TREE = {
    "$defs": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                                   "y": {"type": "integer", "minimum": -99, "maximum": 99}},
                  "required": ["x", "y"], "additionalProperties": False},
        "segment": {"type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"},
                                                     "kind": {"enum": ["line", "arc", 3, None]}},
                    "required": ["a", "b", "kind"], "additionalProperties": False},
    },
    "type": "object",
    "properties": {"segments": {"type": "array", "items": {"$ref": "#/$defs/segment"}, "minItems": 1, "maxItems": 2},
                   "closed": {"type": "boolean"}},
    "required": ["segments", "closed"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,3})-[a-z]{2,6}(\.[a-z]{1,3})?"
# nested lists of small numbers: an independent check is json.loads, whose lists they are
LISTS = 'start: list\nlist: "[" (item ("," item)*)? "]"\nitem: NUMBER | list\nNUMBER: /[1-9][0-9]?/'


@pytest.fixture(scope="module")
def llm():
    return sluice.LLM()


def sampled(llm, constraint, max_tokens=160, seeds=SEEDS, **kw):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, constraint=constraint, **kw) for s in seeds]
    prompts = [PROMPTS[s % len(PROMPTS)] for s in seeds]
    return llm.generate(prompts, params)


@pytest.mark.parametrize("schema", [PERSON, TREE], ids=["object-array-enum", "nested-refs"])
def test_sampled_json_always_validates(llm, schema):
    for out in sampled(llm, Constraint("json_schema", schema)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_and_schema_as_text(llm):
    for out in sampled(llm, Constraint("json_object"), max_tokens=200, seeds=range(3)):
        if out.finish_reason == "stop":  # an open object may run to max_tokens: what is there must be a prefix
            assert isinstance(json.loads(out.text), dict)
    for out in sampled(llm, Constraint("json_schema", json.dumps(PERSON)), seeds=range(2)):
        jsonschema.validate(json.loads(out.text), PERSON)


def test_sampled_regex_always_matches(llm):
    for out in sampled(llm, Constraint("regex", REGEX), max_tokens=40):
        assert out.finish_reason == "stop"
        assert re.fullmatch(REGEX, out.text), out.text


def test_sampled_grammar_always_parses(llm):
    outs = sampled(llm, Constraint("grammar", LISTS), max_tokens=120)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= len(outs) // 2  # nesting may run long; most close
    for out in done:
        value = json.loads(out.text)
        assert isinstance(value, list) and re.fullmatch(r"[\[\],0-9]+", out.text)
    for out in outs:  # one still open is a prefix of the language: brackets never close more than opened
        depth = [out.text[: i + 1].count("[") - out.text[: i + 1].count("]") for i in range(len(out.text))]
        assert min(depth) >= 0 and (out.finish_reason != "stop" or depth[-1] == 0)


def test_batched_equals_one_at_a_time_and_free_rows_are_untouched(llm):
    c = Constraint("json_schema", PERSON)
    params = [SamplingParams(temperature=0, max_tokens=80, constraint=c), SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=1.0, seed=3, max_tokens=80, constraint=c),
              SamplingParams(temperature=1.0, seed=4, max_tokens=20),
              SamplingParams(temperature=0.7, seed=5, top_k=20, max_tokens=40, constraint=Constraint("regex", REGEX))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, q)[0] for p, q in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    free = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=20))[0]
    assert together[1].token_ids == free.token_ids


@pytest.mark.parametrize("speculative", ["draft", "prompt-lookup"])
def test_speculative_equals_plain_for_greedy_and_stays_legal_sampled(llm, speculative):
    kw = {"draft_model": str(bundled_draft_dir())} if speculative == "draft" else {"speculative": "prompt-lookup"}
    spec = sluice.LLM(**kw)
    for c in (Constraint("json_schema", TREE), Constraint("regex", REGEX), Constraint("grammar", LISTS)):
        params = [SamplingParams(temperature=0, max_tokens=120, constraint=c)]
        plain = llm.generate(PROMPTS, params * len(PROMPTS))
        fast = spec.generate(PROMPTS, params * len(PROMPTS))
        assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    for out in sampled(spec, Constraint("json_schema", TREE)):
        jsonschema.validate(json.loads(out.text), TREE)
    assert spec.last_stats.accepted > 0  # guesses were kept: the masked verify ran, not only the final draws


def test_logprobs_are_the_raw_logits(llm):
    """The top alternatives are the model's, disallowed tokens included; the chosen token is allowed."""
    out = llm.generate("The", SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                             constraint=Constraint("regex", "[0-9]{8}")))[0]
    assert re.fullmatch("[0-9]{8}", out.text)
    assert any(not re.fullmatch("[0-9]+", t.token or "x") for lp in out.logprobs for t in lp.top)
    plain = llm.generate("The", SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    assert [t.token_id for t in out.logprobs[0].top] == [t.token_id for t in plain.logprobs[0].top]
    ids = llm.tokenizer.encode("The") + out.token_ids
    with torch.no_grad():
        raw = torch.log_softmax(llm.model(torch.tensor([ids])).float()[0], -1)
    n = len(llm.tokenizer.encode("The"))
    want = [raw[n - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(want, abs=1e-4)


def test_ends_when_the_grammar_is_complete_even_without_eos(llm):
    out = llm.generate("x", SamplingParams(temperature=1.0, seed=0, max_tokens=50, ignore_eos=True,
                                           constraint=Constraint("regex", "(yes|no)")))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.parametrize("kind, spec, match", [
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "json schema.*missing"),
    ("json_schema", {"type": "nonsense"}, "json schema.*nonsense"),
    ("json_schema", "{not json", "json_schema spec is not valid JSON"),
    ("json_schema", [1, 2], "dict or its JSON text"),
    ("regex", "a(b", "(?s)invalid regex.*unclosed group"),
    ("grammar", "start: x\nx: \"a\" | y", "invalid grammar.*unknown name"),
    ("grammar", "", "non-empty str"),
    ("yaml", "a: 1", "kind must be one of"),
    ("json_object", {"type": "object"}, "takes no spec"),
])
def test_bad_constraint_refused_by_name(kind, spec, match):
    with pytest.raises(ConstraintError, match=match):
        Constraint(kind, spec)
    assert issubclass(ConstraintError, sluice.RequestError) and issubclass(ConstraintError, ValueError)


def test_constraint_field_type_checked():
    with pytest.raises(sluice.RequestError, match="constraint must be a sluice.Constraint"):
        SamplingParams(constraint={"type": "object"})


def test_a_grammar_past_the_librarys_limits_ends_with_a_constraint_error(llm):
    """(a{1000}){1000} compiles, then llguidance's lexer gives up at the first token: a clear error, no hang."""
    with pytest.raises(ConstraintError, match="constraint of prompt 0 failed.*too many expressions.*simplify it"):
        llm.generate("x", SamplingParams(max_tokens=5, constraint=Constraint("regex", "(a{1000}){1000}")))


def test_native_sampler_draws_from_the_masked_logits_and_the_fused_head_is_skipped(llm):
    """The mask goes before the native sampler kernel (sample.py), which then draws as it would: a kernel
    call per step, its tokens legal; an LLM with the fused LM head gives a constrained row the plain draw."""
    from sluice.engine import sample
    c = Constraint("json_schema", PERSON)
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=s, max_tokens=120, constraint=c) for s in range(3)]
    before = dict(sample.STATS)
    outs = llm.generate(PROMPTS, params)
    if sample.kernel() is not None:
        assert sample.STATS["calls"] - before["calls"] >= max(len(o.token_ids) for o in outs) - 1
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
    fused = sluice.LLM(fused_head=True)
    greedy = [SamplingParams(temperature=0, max_tokens=80, constraint=c)] * 2
    got = fused.generate(PROMPTS[:2], greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(PROMPTS[:2], greedy)]
    assert fused.last_stats.fused_head_steps == 0
