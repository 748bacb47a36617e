"""Malformed tokenizer files: bad fields in tokenizer_config.json, generation_config.json and
special_tokens_map.json are named; template files that are not UTF-8, that link outside the model
directory, or that are too big are refused before they are read."""

import json
import os

import pytest
from tok_fixtures import copy_tokenizer_dir as _copy

from sluice.errors import CheckpointError, TemplateError
from sluice.text.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "hi"}]


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
