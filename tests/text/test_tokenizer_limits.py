"""Hostile or careless input to the tokenizer: chat templates that try to exhaust memory or time, prompts too
long to tokenize, strings that are not Unicode, inputs nested too deep (malformed tokenizer files:
test_tokenizer_files.py). The blow-ups run in a capped child (tests/bounded.py), so a regression fails the
test instead of taking the machine down."""

import json
import math

import pytest
from bounded import run_bounded
from tok_fixtures import build_tokenizer
from tok_fixtures import copy_tokenizer_dir as _copy
from tokenizers import Tokenizer as Backend
from tokenizers import models, normalizers, pre_tokenizers

from sluice.errors import RequestError
from sluice.text.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return Tokenizer.from_pretrained(qwen_dir)


# -- 1. chat templates are bounded ------------------------------------------------------------------------------

HOSTILE_TEMPLATES = {
    "repeat": ("{{ 'A' * 100000000 }}", "repetition"),
    "repeat_content": ("{{ messages[0].content * 10**8 }}", "repetition"),
    "nested_loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    "power": ("{{ 7 ** 100000000 }}", "bits"),
    "center_method": ("{{ 'a'.center(10**9) }}", r"\.center\(\)"),
    "center_filter": ("{{ 'a'|center(1000000000) }}", "center filter"),
    "getitem_method": ("{{ 'a'['ljust'](10**9) }}", r"\.ljust\(\)"),
    "format_width": ("{{ '{:>1000000000}'.format('') }}", r"\.format\(\)"),
    "percent_width": ("{{ '%*s' % (1000000000, 'a') }}", "%-formatted"),
    "replace": ("{% set a = 'x' * 1000000 %}{{ a.replace('x', a) }}", r"\.replace\(\)"),
    "shared_refs_print": ("{% set a = 'x' * 1000000 %}{{ [a] * 100000 }}", "printed value"),
    "shared_refs_tilde": ("{% set a = 'x' * 1000000 %}{{ ([a] * 100000) ~ '' }}", "~ concatenation"),
    "shared_refs_join": ("{% set a = 'x' * 1000000 %}{{ ([a] * 100000)|join(',') }}", "joined string"),
    "shared_refs_tojson": ("{% set a = 'x' * 1000000 %}{{ ([a] * 100000)|tojson }}", "tojson"),
    "doubling": ("{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                 "{% endfor %}", "concatenation"),
    "sum_lists": ("{{ ([[1] * 100000] * 100000)|sum(start=[])|length }}", "produced more than|concatenation"),
    "batch_fill": ("{{ [1]|batch(1000000000, 'x')|list }}", "batch filter"),
    "indent": ("{{ ('a\\n' * 1000000)|indent(1000) }}", "indent filter"),
    "expandtabs": ("{{ ('\\t' * 1000000).expandtabs(1000) }}", r"\.expandtabs\(\)"),
    "lipsum": ("{{ lipsum(100000000) }}", "lorem ipsum"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output passed"),
    "recursion": ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "RecursionError"),
}


@pytest.mark.slow
def test_hostile_templates_fail_fast_and_small(qwen_dir, tmp_path):
    # One capped child renders every hostile template and reports (error type, message, seconds) for each.
    dirs = {}
    for name, (template, _) in HOSTILE_TEMPLATES.items():
        dirs[name] = str(_copy(qwen_dir, tmp_path / name, config={"chat_template": template}))
    code = f"""
        import json, time
        from sluice.errors import SluiceError
        from sluice.text.tokenizer import Tokenizer
        out = {{}}
        for name, path in {dirs!r}.items():
            tok = Tokenizer.from_pretrained(path)
            start = time.monotonic()
            try:
                tok.apply_chat_template([{{"role": "user", "content": "hi"}}])
                out[name] = ["none", "", time.monotonic() - start]
            except SluiceError as err:
                out[name] = [type(err).__name__, str(err), time.monotonic() - start]
        print(json.dumps(out))
    """
    result = run_bounded(code, mem_mib=3000, timeout=240)  # a hang-stopper: 10x the quiet ~20 s
    print("hostile templates: peak MiB", result.peak_mib)
    assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for name, (_, match) in HOSTILE_TEMPLATES.items():
        kind, message, seconds = report[name]
        assert kind == "TemplateError", (name, kind, message)
        assert pytest.importorskip("re").search(match, message), (name, message)
    # Counted limits (steps, sizes) stop each template, so no clock is asserted: the times are shown, and the
    # child's timeout (above) only stops a hang.
    print("slowest:", max((seconds, name) for name, (_, _, seconds) in report.items()))
    assert result.peak_mib < 1500, result.peak_mib


def test_real_templates_are_far_from_the_limits(qwen):
    # A long conversation with reasoning still renders (and identically to an unbounded render's length).
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(400)]
    text = qwen.apply_chat_template(chat, add_generation_prompt=True)
    assert text.count("<|im_start|>") == 401 and "message 399" in text


# -- 2. prompts too long to tokenize are refused first --------------------------------------------------------

def test_huge_prompt_refused_before_tokenizing(qwen_dir):
    code = f"""
        import time
        from sluice.errors import RequestError
        from sluice.text.tokenizer import Tokenizer
        tok = Tokenizer.from_pretrained({str(qwen_dir)!r})
        text = "a" * 100_000_000
        for call in (lambda: tok.encode(text, max_tokens=512),
                     lambda: tok.apply_chat_template([{{"role": "user", "content": text}}], max_tokens=512),
                     lambda: tok.apply_chat_template([{{"role": "user", "content": "é" * 10_000_000}}],
                                                     tokenize=True, max_tokens=512)):
            start = time.monotonic()
            try:
                call()
                print("no error")
            except RequestError as err:
                print(f"{{time.monotonic() - start:.3f}}", err)
    """
    result = run_bounded(code, mem_mib=2500, timeout=120)  # a hang-stopper: 10x the quiet ~5 s
    print("huge prompts: peak MiB", result.peak_mib, result.stdout)
    assert result.returncode == 0 and not result.timed_out, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3 and "no error" not in result.stdout, result.stdout
    assert "the prompt has 100,000,000 bytes" in lines[0] and "at most 512 tokens x" in lines[0]
    assert "messages[0]['content'] has 100,000,000 bytes" in lines[1]
    assert "messages[0]['content'] has 20,000,000 bytes" in lines[2]
    # refused from the byte count: the peak holds the 100 MB text itself, not the ~11 GB of tokenizing it (the
    # seconds each took are printed above, not asserted)
    assert result.peak_mib < 800, result.peak_mib


def test_encode_is_bounded_without_max_tokens(qwen):
    """`Tokenizer.encode('a' * 10**8)` aborted the process inside the tokenizers library (SIGABRT under a 4 GB
    cap): without max_tokens it now has a default bound, refused from the byte count before tokenizing."""
    assert qwen.max_encode_bytes == 4 * 2**20
    with pytest.raises(RequestError, match=r"the prompt has 100,000,000 bytes of UTF-8, over the 4,194,304 that "
                                           r"one encode\(\) call takes .* set the tokenizer's max_encode_bytes"):
        qwen.encode("a" * 10**8)
    with pytest.raises(RequestError, match="over the 4,194,304"):
        qwen.encode("a" * (4 * 2**20 + 1), max_tokens=10**9)  # a generous max_tokens does not lift it


def test_max_encode_bytes_is_the_bound_and_can_be_raised(qwen, monkeypatch):
    monkeypatch.setattr(qwen, "max_encode_bytes", 10)
    assert qwen.encode("a" * 10) == qwen.encode("a" * 10, max_tokens=10)  # at the bound: encoded
    with pytest.raises(RequestError, match="has 11 bytes of UTF-8, over the 10"):
        qwen.encode("a" * 11)
    with pytest.raises(RequestError, match="has 12 bytes"):  # bytes, not characters
        qwen.encode("é" * 6)
    monkeypatch.setattr(qwen, "max_encode_bytes", None)
    assert len(qwen.encode("a" * 11)) >= 1


def _lossy_and_shrinking_tokenizers():
    """Backends whose normalizer shrinks text or whose pipeline drops it, to test the bound's assumptions."""
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3, "K": 4, "k": 5, "A": 6}
    word = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    nfkc = Backend(models.BPE({"A": 0, "K": 1, "[UNK]": 2}, [], unk_token="[UNK]"))
    nfkc.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    return {"wordlevel": word, "nfkc_lower": nfkc}


def test_max_token_bytes_is_a_lower_bound_on_token_counts(qwen, tmp_path):
    texts = ["Hello world! " * 50, "日本語のテキスト" * 30, "😀" * 200, " " * 500, "a" * 3000, "\u212a" * 300,
             "\U0001d400" * 300, "e\u0301" * 300, "<|im_start|><|im_end|>" * 20]
    build_tokenizer(tmp_path / "llama", "llama")
    tokenizers = {"qwen": qwen, "llama": Tokenizer.from_pretrained(tmp_path / "llama")}
    tokenizers.update({k: Tokenizer(b) for k, b in _lossy_and_shrinking_tokenizers().items()})
    for name, tok in tokenizers.items():
        for text in texts:
            n = len(tok.encode(text, add_special_tokens=False))
            lower = math.ceil(len(text.encode()) / tok.max_token_bytes)
            assert n >= lower or not tok.max_token_bytes_exact, (name, text[:20], n, lower)
            if n and tok.max_token_bytes_exact:  # a text that fits its own count is never refused by the bound
                tok.encode(text, add_special_tokens=False, max_tokens=n)
    assert tokenizers["qwen"].max_token_bytes_exact and not tokenizers["wordlevel"].max_token_bytes_exact
    # NFKC (4x) and Lowercase (3x) can each shrink the text before the model sees it.
    assert tokenizers["nfkc_lower"].max_token_bytes == 12 * len("[UNK]") and tokenizers["nfkc_lower"].max_token_bytes_exact


def test_max_tokens_argument_checked(qwen):
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(RequestError, match="max_tokens must be"):
            qwen.encode("hi", max_tokens=bad)
    assert qwen.encode("hi", max_tokens=10) == qwen.encode("hi")


# -- 3. strings that are not Unicode ------------------------------------------------------------------------

def test_lone_surrogates_refused_with_position(qwen):
    bad = b"ab\xffcd".decode("utf-8", "surrogateescape")
    with pytest.raises(RequestError, match=r"the prompt is not valid Unicode: character 2 is the lone surrogate U\+DCFF"):
        qwen.encode(bad)
    with pytest.raises(RequestError, match=r"messages\[1\]\['content'\] is not valid Unicode: character 2"):
        qwen.apply_chat_template([{"role": "system", "content": "ok"}, {"role": "user", "content": bad}])
    with pytest.raises(RequestError, match=r"tools\[0\]\['name'\] is not valid Unicode"):
        qwen.apply_chat_template(CHAT, tools=[{"name": bad}])


# -- 4. inputs nested too deep ------------------------------------------------------------------------------

def test_deeply_nested_inputs_refused(qwen):
    deep = "x"
    for _ in range(200):
        deep = [deep]
    with pytest.raises(RequestError, match="nests deeper than 100 levels"):
        qwen.apply_chat_template([{"role": "user", "content": "hi", "extra": deep}])
