"""Hostile or careless input to the tokenizer: chat templates that try to exhaust memory or time, prompts too
long to tokenize, strings that are not Unicode, and malformed tokenizer files. The blow-ups run in a capped
child (tests/bounded.py), so a regression fails the test instead of taking the machine down."""

import json
import math
import os
import shutil

import pytest
from bounded import run_bounded
from tok_fixtures import build_tokenizer
from tokenizers import Tokenizer as Backend
from tokenizers import models, normalizers, pre_tokenizers

from sluice.errors import CheckpointError, RequestError, TemplateError
from sluice.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    build_tokenizer(path, "qwen")
    return path


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return Tokenizer.from_pretrained(qwen_dir)


def _copy(src, dst, config=None, files=None):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, data in (files or {}).items():
        (dst / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return dst


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


def test_hostile_templates_fail_fast_and_small(qwen_dir, tmp_path):
    # One capped child renders every hostile template and reports (error type, message, seconds) for each.
    dirs = {}
    for name, (template, _) in HOSTILE_TEMPLATES.items():
        dirs[name] = str(_copy(qwen_dir, tmp_path / name, config={"chat_template": template}))
    code = f"""
        import json, time
        from sluice.errors import SluiceError
        from sluice.tokenizer import Tokenizer
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
    result = run_bounded(code, mem_mib=3000, timeout=240)
    print("hostile templates: peak MiB", result.peak_mib)
    assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for name, (_, match) in HOSTILE_TEMPLATES.items():
        kind, message, seconds = report[name]
        assert kind == "TemplateError", (name, kind, message)
        assert pytest.importorskip("re").search(match, message), (name, message)
        assert seconds < 15, (name, seconds)
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
        from sluice.tokenizer import Tokenizer
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
    result = run_bounded(code, mem_mib=2500, timeout=120)
    print("huge prompts: peak MiB", result.peak_mib, result.stdout)
    assert result.returncode == 0 and not result.timed_out, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3 and "no error" not in result.stdout, result.stdout
    assert "the prompt has 100,000,000 bytes" in lines[0] and "at most 512 tokens x" in lines[0]
    assert "messages[0]['content'] has 100,000,000 bytes" in lines[1]
    assert "messages[0]['content'] has 20,000,000 bytes" in lines[2]
    assert all(float(line.split()[0]) < 2 for line in lines), lines
    assert result.peak_mib < 800, result.peak_mib  # the 100 MB text itself, not the ~11 GB of tokenizing it


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


# -- 4. malformed tokenizer files ---------------------------------------------------------------------------

BAD_CONFIGS = [
    ({"additional_special_tokens": "abc"}, "additional_special_tokens must be a list"),
    ({"additional_special_tokens": ["<a>", 7]}, r"additional_special_tokens\[1\] must be a non-empty string"),
    ({"eos_token": ["<|im_end|>"]}, "eos_token must be a non-empty string or an AddedToken"),
    ({"eos_token": {"lstrip": True}}, "eos_token must be"),
    ({"pad_token": ""}, "pad_token must be a non-empty string"),
    ({"clean_up_tokenization_spaces": "yes"}, "clean_up_tokenization_spaces must be true or false"),
    ({"chat_template": 42}, "chat_template must be a string or a list"),
    ({"chat_template": [{"name": "default"}]}, r"chat_template\[0\]\['template'\] must be a string"),
    ({"chat_template": [{"template": "x"}]}, r"chat_template\[0\] must be an object with a non-empty string 'name'"),
    ({"chat_template": ["x"]}, r"chat_template\[0\] must be an object"),
]


@pytest.mark.parametrize("config, match", BAD_CONFIGS)
def test_bad_tokenizer_config_fields_named(qwen_dir, tmp_path, config, match):
    with pytest.raises(CheckpointError, match="tokenizer_config.json: " + match):
        Tokenizer.from_pretrained(_copy(qwen_dir, tmp_path / "t", config=config))


BAD_GENERATION = [
    ({"eos_token_id": True}, "eos_token_id must be a token id"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id must be a token id"),
    ({"eos_token_id": -1}, "eos_token_id must be"),
    ({"eos_token_id": 10**6}, r"eos_token_id must be a token id \(an integer in \[0, 512\)"),
    ({"pad_token_id": 2.0}, "pad_token_id must be"),
    ({"temperature": "0.7"}, "temperature must be a finite number >= 0, got '0.7'"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"top_p": 0}, r"top_p must be a number in \(0, 1\]"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"repetition_penalty": [1.1]}, "repetition_penalty must be"),
    ({"do_sample": "true"}, "do_sample must be true or false"),
]


@pytest.mark.parametrize("config, match", BAD_GENERATION)
def test_bad_generation_config_fields_named(qwen_dir, tmp_path, config, match):
    path = _copy(qwen_dir, tmp_path / "t", files={"generation_config.json": json.dumps(config)})
    with pytest.raises(CheckpointError, match="generation_config.json: " + match):
        Tokenizer.from_pretrained(path)


def test_good_generation_config_kept(qwen_dir, tmp_path):
    good = {"eos_token_id": [7, 9], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
            "pad_token_id": None, "max_new_tokens": None}
    tok = Tokenizer.from_pretrained(_copy(qwen_dir, tmp_path / "t", files={"generation_config.json": json.dumps(good)}))
    assert tok.eos_token_ids == [7, 9] and tok.generation_config["top_k"] == 20


def test_bad_legacy_special_tokens_map_named(qwen_dir, tmp_path):
    path = _copy(qwen_dir, tmp_path / "t", files={"special_tokens_map.json": json.dumps({"unk_token": 5})})
    with pytest.raises(CheckpointError, match="special_tokens_map.json: unk_token must be"):
        Tokenizer.from_pretrained(path)


def test_template_files_checked(qwen_dir, tmp_path):
    path = _copy(qwen_dir, tmp_path / "latin1", files={"chat_template.jinja": b"{{ '\xe9' }}"})
    with pytest.raises(CheckpointError, match=r"chat_template.jinja is not UTF-8 text \(byte 4"):
        Tokenizer.from_pretrained(path)
    (tmp_path / "outside.jinja").write_text("{{ 'stolen' }}")
    for name, target in (("chat_template.jinja", tmp_path / "outside.jinja"), ("chat_templates", tmp_path)):
        path = _copy(qwen_dir, tmp_path / f"link_{name}")
        os.symlink(target, path / name)
        with pytest.raises(CheckpointError, match="outside the model directory"):
            Tokenizer.from_pretrained(path)
    path = _copy(qwen_dir, tmp_path / "inside")  # a link that stays inside the directory is fine
    (path / "real.jinja").write_text("[{{ messages[0].content }}]")
    os.symlink(path / "real.jinja", path / "chat_template.jinja")
    assert Tokenizer.from_pretrained(path).apply_chat_template(CHAT) == "[hi]"


@pytest.mark.parametrize("name, size", [("tokenizer_config.json", 65 * 2**20), ("chat_template.jinja", 2**20 + 1),
                                        ("tokenizer.json", 2**30 + 1), ("generation_config.json", 65 * 2**20)])
def test_oversized_files_refused_before_reading(qwen_dir, tmp_path, name, size):
    path = _copy(qwen_dir, tmp_path / "t")
    with open(path / name, "ab") as f:  # sparse: no disk or memory is spent on the extra bytes
        f.truncate(size)
    with pytest.raises(CheckpointError, match=f"{name} is {size:,} bytes, over the limit"):
        Tokenizer.from_pretrained(path)


def test_oversized_template_in_config_refused(qwen_dir, tmp_path):
    path = _copy(qwen_dir, tmp_path / "t", config={"chat_template": "x" * (2**20 + 1)})
    with pytest.raises(TemplateError, match="chat_template has 1,048,577 characters, over the limit"):
        Tokenizer.from_pretrained(path)


def test_deeply_nested_inputs_refused(qwen):
    deep = "x"
    for _ in range(200):
        deep = [deep]
    with pytest.raises(RequestError, match="nests deeper than 100 levels"):
        qwen.apply_chat_template([{"role": "user", "content": "hi", "extra": deep}])
