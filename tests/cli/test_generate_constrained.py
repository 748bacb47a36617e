"""`sluice generate --json-object / --json-schema FILE|JSON / --regex R / --grammar FILE`: the output matches,
and a bad constraint is refused by name before the model loads."""

import json
import re

import jsonschema
import pytest

from sluice.cli import main

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def generate(capsys, *args):
    assert main(["generate", "--json", "--temperature", "1", "--seed", "2", "--max-tokens", "40", *args, "Hi"]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_flag_constrains_the_output(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMA))
    for given in (str(path), json.dumps(SCHEMA)):
        jsonschema.validate(json.loads(generate(capsys, "--json-schema", given)["text"]), SCHEMA)
    assert re.fullmatch("[a-c]{4}", generate(capsys, "--regex", "[a-c]{4}")["text"])
    grammar = tmp_path / "sum.lark"
    grammar.write_text('start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/\n')
    out = generate(capsys, "--grammar", str(grammar))
    assert out["finish_reason"] == "stop" and re.fullmatch(r"\([0-9](\+[0-9])*\)", out["text"])
    out = generate(capsys, "--json-object", "--max-tokens", "200")
    assert out["finish_reason"] == "length" or isinstance(json.loads(out["text"]), dict)


@pytest.mark.parametrize("args, match", [
    (["--regex", "a("], "invalid regex"),
    (["--json-schema", "/no/such.json"], "--json-schema '/no/such.json': no such file"),
    (["--json-schema", '{"type": "nonsense"}'], "invalid json schema.*nonsense"),
    (["--grammar", "/no/such.lark"], "--grammar '/no/such.lark': no such file"),
])
def test_bad_constraint_refused_before_the_load(monkeypatch, capsys, args, match):
    import sluice.llm as llm_module

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the constraint was checked")
    monkeypatch.setattr(llm_module, "LLM", no_load)
    assert main(["generate", *args, "hi"]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--regex", "a", "--json-object", "hi"])
    assert "not allowed with" in capsys.readouterr().err
