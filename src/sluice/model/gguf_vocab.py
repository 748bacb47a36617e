"""The JSON side of a GGUF file: a checkpoint's tokenizer and generation defaults as llama.cpp reads them.

llama.cpp runs byte-level BPE tokenizers itself ("gpt2" model): it needs the token strings in id
order, a type per token, the merges, the special-token ids, and the name of the pre-tokenizer
(the regex that splits text before BPE), which it implements natively under fixed names. Only
JSON is read; the chat template is stored as text and never rendered here.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError

# The pre-tokenizer splits llama.cpp implements, keyed by how tokenizer.json spells them.
# llama.cpp's converter recognises them by hashing the token ids of a test string, which only
# works for the exact vocabularies it knows; the regex itself identifies the split for any vocabulary.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_BY_SPLIT = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}

# gguf.TokenType values (kept as ints so that this module needs no gguf import to be read).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def pre_tokenizer_name(tokenizer: dict) -> str | None:
    """llama.cpp's name for the tokenizer's pre-tokenizer split, or None if it has no such name."""
    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # ByteLevel's built-in regex is GPT-2's
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True):
        return None
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    return _PRE_BY_SPLIT.get((split.get("pattern") or {}).get("Regex"))


def _looks_special(token: str) -> bool:
    # Added tokens spelled <|...|> are control tokens even when a checkpoint forgets to mark them
    # special (llama.cpp's converter applies the same rule).
    return token.startswith("<|") and token.endswith("|>")


def why_not_written(tok: dict | None, path: Path) -> str | None:
    """None if llama.cpp can run this tokenizer itself, else why its vocabulary is left out."""
    if tok is None:
        return f"{path} not found"
    model = tok.get("model") or {}
    if model.get("byte_fallback"):
        return "its tokenizer.json is a SentencePiece-style BPE (byte_fallback), not byte-level BPE"
    if model.get("type") != "BPE":
        return f"its tokenizer.json model is {model.get('type')!r}, not byte-level BPE"
    if not model.get("merges"):
        return "its tokenizer.json has no BPE merges"
    return None


def read_vocab(tok: dict, vocab_size: int, path: Path) -> tuple[list[str], list[int], str | None]:
    """(tokens in id order padded to vocab_size, their types, pre-tokenizer name or None) from the
    parsed byte-level BPE tokenizer.json `tok` (read from `path`, named in errors)."""
    model = tok["model"]
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise ConfigError(f"{path}: model.vocab must map token strings to ids")
    by_id: dict[int, tuple[str, int]] = {int(i): (t, NORMAL) for t, i in vocab.items()}
    for added in tok.get("added_tokens") or []:
        content, i = added.get("content"), added.get("id")
        if not isinstance(content, str) or not isinstance(i, int):
            raise ConfigError(f"{path}: malformed added token {added!r}")
        special = added.get("special") or _looks_special(content)
        by_id[i] = (content, CONTROL if special else USER_DEFINED)
    too_big = [i for i in by_id if not 0 <= i < vocab_size]
    if too_big:
        raise ConfigError(f"{path}: token id {max(too_big)} does not fit the model's vocab_size {vocab_size}")
    # Rows of the embedding no token uses (vocabularies padded to a multiple of 64 and so on).
    tokens = [by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(vocab_size)]
    return [t for t, _ in tokens], [k for _, k in tokens], pre_tokenizer_name(tok)


def add_tokenizer(writer, model_dir: Path, vocab_size: int) -> dict:
    """Write the tokenizer keys (tokenizer.ggml.*, tokenizer.chat_template) into a GGUFWriter.

    A tokenizer llama.cpp cannot run (none at all, word-level, SentencePiece-style) is left out:
    the file then says tokenizer model "none" and llama.cpp runs it on token ids only, which is
    what benchmarks of random checkpoints need. The returned "skipped" says why."""
    import gguf

    path = model_dir / "tokenizer.json"
    tok = _read_json(path) if path.is_file() else None
    why = why_not_written(tok, path)
    if why is not None:
        writer.add_tokenizer_model("none")
        return {"tokens": 0, "merges": 0, "pre": None, "chat_template": False, "skipped": why}
    tokens, types, pre = read_vocab(tok, vocab_size, path)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        # Without the key llama.cpp falls back to its default split (and says so); an unknown name
        # would make it refuse the file, so none is written rather than a guess.
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # gguf's SpecialVocab is what llama.cpp's converter uses for merges, bos/eos/pad ids, the
    # add_bos/add_eos flags and the chat template; it only parses the JSON files.
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    post = tok.get("post_processor") or {}
    if any(p.get("type") == "ByteLevel" for p in post.get("processors", [post])):
        # A ByteLevel post-processor adds no tokens unless a template says so: state it, as
        # llama.cpp's current converter does (the gguf release on PyPI predates that rule).
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(writer, quiet=True)
    return {"tokens": len(tokens), "merges": len(special.merges), "pre": pre,
            "chat_template": special.chat_template is not None, "skipped": None}


# generation_config.json key -> the GGUFWriter method llama.cpp's converter stores it with.
_SAMPLING = {"temperature": "add_sampling_temp", "top_k": "add_sampling_top_k", "top_p": "add_sampling_top_p",
             "min_p": "add_sampling_min_p", "repetition_penalty": "add_sampling_penalty_repeat"}


def add_generation_defaults(writer, model_dir: Path) -> None:
    """general.sampling.*: the checkpoint's default sampling values, which llama.cpp applies when
    its caller sets none (as sluice uses generation_config.json)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return
    gen = _read_json(path)
    for key, method in _SAMPLING.items():
        value = gen.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            getattr(writer, method)(int(value) if key == "top_k" else float(value))
