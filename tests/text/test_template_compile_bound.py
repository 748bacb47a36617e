"""What compiling a chat template may cost: jinja's parser, its code generator and Python's compile() grow with
the template (about 2-4 KiB of memory per token), so a template is counted token by token before any of them
runs, and one that nests too deeply for them is a template error, not a crash. Rendering's own bounds:
test_tokenizer_limits.py."""

import tracemalloc

import jinja2
import pytest
from tok_fixtures import LLAMA3_TEMPLATE, QWEN3_TEMPLATE
from tok_fixtures import copy_tokenizer_dir as _copy

from sluice.errors import TemplateError
from sluice.text import template_limits as lim
from sluice.text.chat_template import compile_template
from sluice.text.tokenizer import Tokenizer

# The two shapes the issue measured: 2.3 GB to compile, and minutes.
TOKEN_HEAVY = {"prints": "{{x}}" * 209_000, "loops": "{% for i in x %}{% endfor %}" * 20_000}


@pytest.mark.parametrize("name", sorted(TOKEN_HEAVY))
def test_token_heavy_templates_are_refused_before_compiling(name):
    source = TOKEN_HEAVY[name]
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError, match=r"more than 32,768 tokens \(passed at line 1\)"):
            compile_template(source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Counting streams the lexer's tokens; compiling even the first 32k would have taken ~100 MiB.
    assert peak < 8 * 2**20, peak


def test_the_refusal_reaches_apply_chat_template(qwen_dir, tmp_path):
    tok = Tokenizer.from_pretrained(_copy(qwen_dir, tmp_path / "t", config={"chat_template": TOKEN_HEAVY["prints"]}))
    with pytest.raises(TemplateError, match="more than 32,768 tokens"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_bound_counts_every_token(monkeypatch):
    monkeypatch.setattr(lim, "MAX_TEMPLATE_TOKENS", 30)
    compile_template("{{x}}" * 10)  # 3 tokens each: exactly at the bound
    with pytest.raises(TemplateError, match="more than 30 tokens"):
        compile_template("{{x}}" * 10 + "a")


def test_real_templates_are_far_from_the_bound():
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    for source in (QWEN3_TEMPLATE, LLAMA3_TEMPLATE):
        assert sum(1 for _ in env.lex(source)) * 8 < lim.MAX_TEMPLATE_TOKENS
        compile_template(source)


@pytest.mark.parametrize("source", [
    "{{ " + "(" * 5000 + "x" + ")" * 5000 + " }}",          # jinja's parser recursing
    "{{ " + "[" * 3000 + "]" * 3000 + " }}",
    "{% if a %}" * 200 + "x" + "{% endif %}" * 200,         # Python: too many levels of indentation
    "{% for a in b %}" * 30 + "x" + "{% endfor %}" * 30,    # Python: too many statically nested blocks
], ids=["parens", "lists", "ifs", "fors"])
def test_nesting_too_deep_to_compile_is_a_template_error(source):
    with pytest.raises(TemplateError, match="nests blocks or expressions too deeply to compile"):
        compile_template(source)
