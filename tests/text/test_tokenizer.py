"""sluice.text.tokenizer against transformers (the reference) on tiny Qwen3-like and Llama-3-like tokenizers."""

import json
import shutil
from datetime import datetime, timedelta

import pytest
from tok_fixtures import VOCAB_SIZE, build_tokenizer
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from sluice.errors import CheckpointError, ModelNotFoundError, RequestError, TemplateError
from sluice.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world! How are you today?", "", " ", "  leading and trailing  ", "line one\nline two\r\n\ttab",
         "日本語のテキスト、中文文本：你好，世界！", "Emoji 😀🎉👍🏽 and café naïve Zürich", "Привет, мир! Ελληνικά",
         "x = 3.14159 * 2024 - 7", "It's, isn't it ? Yes . No !",
         "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|><|eot_id|> raw specials", "<think>\nhm\n</think>\n\nok"]

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Japan? 日本 🗾"}]


def _load_pair(kind, tmp_path_factory):
    """(kind, model_dir, sluice Tokenizer, transformers tokenizer) over the same files."""
    path = tmp_path_factory.mktemp(kind)
    build_tokenizer(path, kind)
    return kind, path, Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _load_pair("qwen", tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _load_pair("llama", tmp_path_factory)


@pytest.fixture(params=["qwen", "llama"])
def pair(request):
    return request.getfixturevalue(request.param)


def _copy_with(src, dst, *, config=None, files=None):
    """Copy a tokenizer dir, then patch tokenizer_config.json keys and write extra files."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, text in (files or {}).items():
        (dst / name).write_text(text)
    return dst


def test_vocab_and_special_tokens_match_transformers(pair):
    kind, _, tok, ref = pair
    assert tok.vocab_size == len(ref) == VOCAB_SIZE
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert (tok.bos_token_id, tok.pad_token_id) == (ref.bos_token_id, ref.pad_token_id)
    assert tok.eos_token_ids == [ref.eos_token_id]  # no generation_config.json: the tokenizer's eos_token
    assert set(ref.all_special_ids) <= tok.all_special_ids
    if kind == "qwen":
        assert tok.bos_token_id is None and tok.token_to_id("<|im_end|>") == tok.eos_token_ids[0]
    else:
        assert tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert tok.token_to_id("definitely-not-a-token") is None


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens):
    kind, _, tok, ref = pair
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == ref.encode(text, add_special_tokens=add_special_tokens), text
        if kind == "llama" and add_special_tokens:  # exactly one BOS added, by the post-processor
            assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1 + text.count(tok.bos_token)
        if kind == "qwen":
            assert tok.bos_token_id not in ids


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(pair, skip):
    _, _, tok, ref = pair
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    every_id = list(range(VOCAB_SIZE))  # every token, special or not, in one sequence
    assert tok.decode(every_id, skip_special_tokens=skip) == ref.decode(every_id, skip_special_tokens=skip)


def test_decode_round_trips_and_accepts_tensors(pair):
    torch = pytest.importorskip("torch")
    _, _, tok, _ = pair
    for text in TEXTS:
        if "<|" not in text:
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = tok.encode("Hello world")
    assert tok.decode(torch.tensor(ids)) == tok.decode(ids)
    assert tok.decode(ids[-1]) == tok.decode(ids[-1:])


def test_add_bos_token_flag_does_not_override_post_processor(pair, tmp_path):
    # transformers (v5) lets tokenizer.json's post-processor alone decide; a stale add_bos_token is ignored.
    kind, src, _, _ = pair
    path = _copy_with(src, tmp_path / "t", config={"add_bos_token": True, "bos_token": "<|endoftext|>"}
                      if kind == "qwen" else {"add_bos_token": True})
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.save(str(path / "tokenizer.json"))
    tok, ref = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    assert tok.encode("Hello there") == ref.encode("Hello there")
    assert tok.bos_token_id not in tok.encode("Hello there")


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    kind, _, tok, ref = pair
    extra = {"date_string": "26 Jul 2024"} if kind == "llama" else {}
    kw = dict(add_generation_prompt=add_generation_prompt, **extra)
    text = tok.apply_chat_template(CHAT, **kw)
    assert text == ref.apply_chat_template(CHAT, tokenize=False, **kw)
    ids = tok.apply_chat_template(CHAT, tokenize=True, **kw)
    assert ids == ref.apply_chat_template(CHAT, tokenize=True, return_dict=False, **kw)
    assert ids == tok.encode(text, add_special_tokens=False)
    if kind == "llama":  # the template writes BOS itself; tokenizing must not add a second one
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert text.endswith(("<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n")) \
        == add_generation_prompt


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_qwen_enable_thinking_kwarg(qwen, enable_thinking):
    _, _, tok, ref = qwen
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, enable_thinking=enable_thinking)
    assert text == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=enable_thinking)
    assert text.endswith("<think>\n\n</think>\n\n") != enable_thinking


def test_qwen_tools_tool_calls_and_reasoning_match_transformers(qwen):
    _, _, tok, ref = qwen
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville <now>",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    chat = [{"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Zürich"}}}]},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21°C.", "reasoning": "Tool said 21."}]
    snapshot = json.dumps(chat)
    text = tok.apply_chat_template(chat, tools=tools, add_generation_prompt=True)
    assert text == ref.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"Météo d\'une ville <now>"' in text  # tojson neither escapes HTML nor non-ASCII
    assert "None" not in text and "<think>\nTool said 21.\n</think>" in text
    assert json.dumps(chat) == snapshot  # the caller's messages are untouched


def test_tojson_indent_generation_tag_and_named_templates(pair, tmp_path):
    _, src, _, _ = pair
    custom = ("{% for m in messages %}{% generation %}{% set x = m.content %}{{ m | tojson(indent=2) }}"
              "{% endgeneration %}{{ x }}|{% endfor %}{{ tools | tojson(separators=(',', ':')) }}")
    named = [{"name": "default", "template": custom}, {"name": "tool_use", "template": "TOOLS {{ tools|length }}"}]
    path = _copy_with(src, tmp_path / "t", config={"chat_template": named})
    tok, ref = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    assert tok.chat_template == custom
    for tools in (None, [{"a": "é", "b": [1, 2]}]):
        assert tok.apply_chat_template(CHAT[:2], tools=tools) == \
            ref.apply_chat_template(CHAT[:2], tools=tools, tokenize=False)
    assert tok.apply_chat_template(CHAT[:2], tools=[{}]) == "TOOLS 1"


def test_none_values_are_dropped_from_messages(pair, tmp_path):
    # OpenAI clients send content=None with tool_calls: the template must see the key as missing, not "None".
    _, src, _, _ = pair
    template = "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.content is defined }};{% endfor %}"
    path = _copy_with(src, tmp_path / "t", config={"chat_template": template})
    tok, ref = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert tok.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False) == \
        "user:hi|True;assistant:|False;"


def test_named_special_tokens_outside_added_vocab(pair, tmp_path):
    # A named special token that tokenizer.json doesn't mark special (or lacks entirely) is still special,
    # as transformers registers it: encoded atomically, skipped on decode, counted in vocab_size.
    kind, src, _, _ = pair
    extra = {"pad_token": "<think>"} if kind == "qwen" else {"pad_token": "ort", "unk_token": "<unk>"}
    path = _copy_with(src, tmp_path / "t", config=extra)
    tok, ref = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    assert tok.vocab_size == len(ref) > VOCAB_SIZE if kind == "llama" else tok.vocab_size == len(ref)
    assert tok.pad_token_id in tok.all_special_ids and tok.pad_token_id == ref.pad_token_id
    for text in ("a <think> b <unk> c", "sort ort port", "<|begin_of_text|>x<|eot_id|>"):
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_chat_template_file_overrides_config(pair, tmp_path):
    _, src, _, _ = pair
    path = _copy_with(src, tmp_path / "t", files={"chat_template.jinja": "{{ bos_token }}[{{ messages[0].content }}]"})
    tok, ref = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    assert tok.apply_chat_template(CHAT) == ref.apply_chat_template(CHAT, tokenize=False)
    assert tok.apply_chat_template(CHAT).endswith("[You are a helpful assistant.]")


def test_strftime_now_gives_todays_date(llama):
    _, _, tok, _ = llama
    days = {(datetime.now() + timedelta(days=d)).strftime("%d %b %Y") for d in (-1, 0, 1)}
    text = tok.apply_chat_template(CHAT)
    assert any(f"Today Date: {day}\n" in text for day in days)


def test_special_tokens_as_dicts_and_legacy_map(pair, tmp_path):
    kind, src, _, _ = pair
    eos = "<|im_end|>" if kind == "qwen" else "<|eot_id|>"
    path = _copy_with(src, tmp_path / "t", config={"eos_token": {"content": eos, "lstrip": False, "special": True}})
    assert Tokenizer.from_pretrained(path).eos_token == eos
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["eos_token"]  # old checkpoints keep special tokens in special_tokens_map.json only
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token == eos and tok.eos_token_ids == [tok.token_to_id(eos)]


@pytest.mark.parametrize("eos_field", [7, [7, 9, 7]])
def test_eos_ids_from_generation_config(pair, tmp_path, eos_field):
    _, src, _, _ = pair
    path = _copy_with(src, tmp_path / "t", files={"generation_config.json": json.dumps({"eos_token_id": eos_field})})
    assert Tokenizer.from_pretrained(path).eos_token_ids == ([7] if eos_field == 7 else [7, 9])


def test_template_raise_exception_becomes_template_error(llama):
    _, _, tok, _ = llama
    with pytest.raises(TemplateError, match="Only user and assistant roles are supported.*got tool"):
        tok.apply_chat_template(CHAT + [{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("template, match", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe attribute"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "unsafe attribute"),
    ("{{ messages.append(1) }}", "unsafe attribute"),
    ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", "failed to render: TypeError"),
    ("{{ undefined_thing.attr }}", "failed to render: UndefinedError"),
    ("{% if %}", "syntax error at line 1"),
])
def test_bad_templates_raise_template_error(pair, tmp_path, template, match):
    _, src, _, _ = pair
    tok = Tokenizer.from_pretrained(_copy_with(src, tmp_path / "t", config={"chat_template": template}))
    with pytest.raises(TemplateError, match=match):
        tok.apply_chat_template(CHAT)


def test_no_template_and_missing_files(pair, tmp_path):
    _, src, _, _ = pair
    path = _copy_with(src, tmp_path / "t", config={"chat_template": None})
    with pytest.raises(TemplateError, match="no chat template"):
        Tokenizer.from_pretrained(path).apply_chat_template(CHAT)
    named = _copy_with(src, tmp_path / "named", config={"chat_template": [{"name": "rag", "template": "x"}]})
    with pytest.raises(TemplateError, match=r"no chat template \(only ones named \['rag'\]\)"):
        Tokenizer.from_pretrained(named).apply_chat_template(CHAT)
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_pretrained(path)
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_bad_requests_raise_request_error(qwen):
    _, _, tok, _ = qwen
    with pytest.raises(RequestError, match="at least one message"):
        tok.apply_chat_template([])
    with pytest.raises(RequestError, match="must be dicts"):
        tok.apply_chat_template(["hi"])
    with pytest.raises(RequestError, match="JSON-schema dicts"):
        tok.apply_chat_template(CHAT, tools=[print])
    with pytest.raises(RequestError, match="expects a str"):
        tok.encode(None)
