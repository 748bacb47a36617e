"""Reading a model directory's tokenizer files: bounded in size, kept inside the directory, and checked field by
field, so a careless or hostile file is refused by name (file, field, value) instead of being coerced or
crashing later (`additional_special_tokens: "abc"` used to become three one-letter special tokens,
`eos_token_id: true` the id 1).

Size limits, checked before a byte is read: tokenizer.json 1 GiB (real ones are 2-35 MB), the JSON config
files 64 MiB (a tokenizer_config.json that lists a quarter million added tokens is ~30 MB), a chat template
1 MiB (real ones are 1-20 KB).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, TemplateError
from ..model.hub import is_inside

MAX_TOKENIZER_JSON_BYTES = 2**30
MAX_CONFIG_JSON_BYTES = 64 * 2**20
MAX_TEMPLATE_BYTES = 2**20

NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(path: Path, field: str, rule: str, value: Any) -> CheckpointError:
    return CheckpointError(f"{path}: {field} must be {rule}, got {_show(value)}")


def inside(model_dir: Path, path: Path) -> Path:
    """`path` resolved, refused unless it stays in the model directory (or, for a Hugging Face cache snapshot,
    whose files are links to ../../blobs/<hash>, in that repository's blobs folder)."""
    real, root = path.resolve(), model_dir.resolve()
    if not is_inside(model_dir, real):
        raise CheckpointError(f"{path} resolves to {real}, outside the model directory {root}; "
                              "sluice reads a model's files only from inside its directory")
    return real


def checked_size(path: Path, limit: int) -> int:
    size = path.stat().st_size
    if size > limit:
        raise CheckpointError(f"{path} is {size:,} bytes, over the limit of {limit:,} for this file")
    return size


def read_json(model_dir: Path, name: str) -> dict:
    path = model_dir / name
    if not path.is_file():
        return {}
    checked_size(inside(model_dir, path), MAX_CONFIG_JSON_BYTES)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {type(err).__name__}: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} should hold a JSON object, found {type(data).__name__}")
    return data


def token_content(path: Path, field: str, value: Any) -> str | None:
    """Special tokens are saved as plain strings or as AddedToken dicts ({"content": ..., "lstrip": ...})."""
    content = value.get("content") if isinstance(value, Mapping) else value
    if value is None:
        return None
    if not isinstance(content, str) or not content:
        raise _bad(path, field, "a non-empty string or an AddedToken object with a non-empty string 'content'",
                   value)
    return content


def special_tokens(path: Path, config: Mapping) -> dict[str, Any]:
    """The special-token fields of tokenizer_config.json or special_tokens_map.json, checked: named ones as
    str | None, the extra ones as a list of str."""
    out: dict[str, Any] = {n: token_content(path, n, config[n]) for n in NAMED_SPECIALS if n in config}
    for field in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(field)
        if value is None:
            continue
        if isinstance(value, Mapping):  # transformers v5 names them: {"image_token": "<image>", ...}
            items = [(f"{field}[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{field}[{i}]", v) for i, v in enumerate(value)]
        else:
            raise _bad(path, field, "a list of tokens (strings or AddedToken objects)", value)
        out[field] = [token_content(path, where, v) for where, v in items]
    if "clean_up_tokenization_spaces" in config:
        flag = config["clean_up_tokenization_spaces"]
        if flag is not None and not isinstance(flag, bool):
            raise _bad(path, "clean_up_tokenization_spaces", "true or false", flag)
        out["clean_up_tokenization_spaces"] = bool(flag)
    return out


def _template_text(where: str, text: Any) -> str:
    if not isinstance(text, str):
        raise CheckpointError(f"{where} must be a string (a jinja template), got {_show(text)}")
    if len(text) > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"{where} has {len(text):,} characters, over the limit of {MAX_TEMPLATE_BYTES:,} "
                            "for a chat template")
    return text


def chat_templates(model_dir: Path, config_path: Path, config: Mapping) -> dict[str, str]:
    # Same precedence as transformers: template files (newer layout) override the tokenizer_config entry.
    files = {"default": model_dir / "chat_template.jinja"}
    if (model_dir / "chat_templates").is_dir():
        files.update({p.stem: p for p in sorted((model_dir / "chat_templates").glob("*.jinja"))})
    from_files = {}
    for name, path in files.items():
        if not path.is_file():
            continue
        checked_size(inside(model_dir, path), MAX_TEMPLATE_BYTES)
        try:
            from_files[name] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise CheckpointError(f"{path} is not UTF-8 text (byte {err.start:,}: {err.reason})") from None
    if from_files:
        return from_files
    entry = config.get("chat_template")
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {"default": _template_text(f"{config_path}: chat_template", entry)}
    if not isinstance(entry, list):
        raise _bad(config_path, "chat_template", "a string or a list of {\"name\": ..., \"template\": ...}", entry)
    named = {}
    for i, item in enumerate(entry):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        where = f"{config_path}: chat_template[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not item["name"]:
            raise CheckpointError(f"{where} must be an object with a non-empty string 'name' and a string "
                                  f"'template', got {_show(item)}")
        named[item["name"]] = _template_text(f"{where}['template']", item.get("template"))
    return named


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# generation_config.json field -> (what it must be, check): the engine's sampling defaults come from these.
_GENERATION_RULES = {
    "temperature": ("a finite number >= 0", lambda v: _is_number(v) and v >= 0),
    "top_p": ("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1),
    "top_k": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "min_p": ("a number in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1),
    "repetition_penalty": ("a finite number > 0", lambda v: _is_number(v) and v > 0),
    "max_new_tokens": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "max_length": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "do_sample": ("true or false", lambda v: isinstance(v, bool)),
}


def generation_config(path: Path, config: dict, vocab_size: int) -> dict:
    """Check the fields sluice uses, by name; null means unset, as in transformers."""
    for field, (rule, ok) in _GENERATION_RULES.items():
        if config.get(field) is not None and not ok(config[field]):
            raise _bad(path, field, rule, config[field])
    id_rule = f"a token id (an integer in [0, {vocab_size}), the tokenizer's vocabulary)"
    for field in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = config.get(field)
        ids = value if field == "eos_token_id" and isinstance(value, list) else [value]
        for token_id in ids:
            if value is not None and not (_is_int(token_id) and 0 <= token_id < vocab_size):
                rule = id_rule + (" or a list of them" if field == "eos_token_id" else "")
                raise _bad(path, field, rule, value)
    return config


def eos_ids(from_generation_config: Any, from_tokenizer: int | None) -> list[int]:
    # generation_config.json is what transformers' generate() stops on, and instruct models list several ids
    # there (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>), so it wins over the tokenizer's single eos_token.
    if _is_int(from_generation_config):
        return [from_generation_config]
    if isinstance(from_generation_config, list) and from_generation_config:
        return list(dict.fromkeys(from_generation_config))
    return [] if from_tokenizer is None else [from_tokenizer]
