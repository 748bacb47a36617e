"""Text <-> token ids with a checkpoint's tokenizer.json, and chat prompts with its sandboxed jinja2 template.

Behaviour follows transformers' fast tokenizers (the reference the checkpoints were saved with), without
importing transformers: the tokenizer.json post-processor alone decides which special tokens `encode` adds,
and chat templates run in jinja2's immutable sandbox with the same globals and filters transformers offers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from ..errors import CheckpointError, RequestError, TemplateError
from ..model.hub import resolve_model_dir
from .chat_template import TemplateRaised, compile_template, plain, render
from .token_bound import (MAX_ENCODE_BYTES, check_encode_bytes, check_fits, check_max_tokens, max_token_bytes,
                          utf8_bytes)
from .tokenizer_files import (MAX_TOKENIZER_JSON_BYTES, NAMED_SPECIALS, checked_size, chat_templates, eos_ids,
                              generation_config, inside, read_json, special_tokens)
from .typed_specials import encode_typed_as_text, mask

# A message's reasoning arrives under any of these names; templates read the first (Qwen3, DeepSeek) or "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """A checkpoint's tokenizer: `encode`/`decode` plus `apply_chat_template`."""

    def __init__(self, backend: _Backend, config: Mapping | None = None,
                 generation_config: Mapping | None = None, chat_templates: str | Mapping | None = None):
        config = special_tokens(Path("the tokenizer config"), config or {})
        self._backend = backend
        names = {name: config.get(name) for name in NAMED_SPECIALS}
        self.bos_token, self.eos_token, self.pad_token = names["bos_token"], names["eos_token"], names["pad_token"]
        self._template_specials = {name: value for name, value in names.items() if value is not None}

        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        # transformers registers every named special token with the backend, so a token that is only in the
        # base vocabulary (or nowhere) still encodes atomically and is skipped on decode; do the same.
        already_added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys([*names.values(), *extra]) if t is not None and t not in already_added]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

        self.bos_token_id = self._id_or_none(self.bos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        self.generation_config = dict(generation_config or {})  # also the engine's sampling defaults
        self.eos_token_ids = eos_ids(self.generation_config.get("eos_token_id"), self._id_or_none(self.eos_token))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # The most input bytes one token stands for: encode(max_tokens=) refuses longer texts before tokenizing.
        self.max_token_bytes, self.max_token_bytes_exact = max_token_bytes(backend)
        # The most text one encode() call takes (None: no bound); see token_bound.MAX_ENCODE_BYTES.
        self.max_encode_bytes: int | None = MAX_ENCODE_BYTES
        self.all_special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.all_special_ids |= {i for i in map(self._id_or_none, [*names.values(), *extra]) if i is not None}
        # transformers ignores clean_up_tokenization_spaces for BPE models (it would delete real spaces before
        # punctuation), yet Llama 3 ships it set to true; apply it only where transformers does.
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and type(backend.model).__name__ != "BPE"

        if isinstance(chat_templates, str):
            chat_templates = {"default": chat_templates}
        self._templates: dict[str, str] = dict(chat_templates or {})
        self.chat_template: str | None = self._templates.get("default")
        self._compiled: dict[str, jinja2.Template] = {}
        self._split_backend: _Backend | None = None  # special tokens as text (special_tokens_in_messages=False)
        # apply_chat_template's default: whether special tokens typed into messages become special tokens.
        self.special_tokens_in_messages = True

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, generation_config.json, chat template) from a model dir."""
        model_dir = resolve_model_dir(path_or_repo_id)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{tokenizer_file} not found: sluice needs the fast-tokenizer file tokenizer.json. For a checkpoint "
                "that only has a slow tokenizer, run transformers' AutoTokenizer.from_pretrained(dir)"
                ".save_pretrained(dir) once to write it.")
        checked_size(inside(model_dir, tokenizer_file), MAX_TOKENIZER_JSON_BYTES)
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust side raises a bare Exception for any parse failure
            raise CheckpointError(f"{tokenizer_file} could not be loaded by the tokenizers library: {err}") from err
        raw = read_json(model_dir, "tokenizer_config.json")
        config = special_tokens(model_dir / "tokenizer_config.json", raw)
        # Old checkpoints keep their special tokens only in special_tokens_map.json.
        legacy = model_dir / "special_tokens_map.json"
        for key, value in special_tokens(legacy, read_json(model_dir, legacy.name)).items():
            config.setdefault(key, value)
        generation = generation_config(model_dir / "generation_config.json",
                                       read_json(model_dir, "generation_config.json"),
                                       backend.get_vocab_size(with_added_tokens=True))
        return cls(backend, config, generation, chat_templates(model_dir, model_dir / "tokenizer_config.json", raw))

    # -- text <-> ids ---------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, *, max_tokens: int | None = None,
               what: str = "the prompt") -> list[int]:
        """Token ids of `text`. With max_tokens, a text that cannot possibly fit in that many tokens is refused
        (RequestError) before tokenizing, from its byte count alone; the exact count check is the caller's.
        Without it too, a text over `max_encode_bytes` (4 MiB unless set otherwise) is refused the same way."""
        if not isinstance(text, str):
            raise RequestError(f"encode expects a str, got {type(text).__name__}")
        check_max_tokens(max_tokens)
        self._check_text(text, max_tokens, what)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _check_text(self, text: str, max_tokens: int | None, what: str) -> None:
        n_bytes = utf8_bytes(text, what)  # also refuses lone surrogates, which the Rust side can't take
        if max_tokens is not None:  # first: the context is what a caller who gave it wants to hear about
            check_fits(n_bytes, max_tokens, self.max_token_bytes, what)
        check_encode_bytes(n_bytes, self.max_encode_bytes, what)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if hasattr(ids, "tolist"):  # torch tensors and numpy arrays
            ids = ids.tolist()
        ids = [ids] if isinstance(ids, int) else list(map(int, ids))
        if skip_special_tokens and not self.all_special_ids.isdisjoint(ids):  # a streamed token: mostly none
            ids = [i for i in ids if i not in self.all_special_ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def token_to_id(self, tok: str) -> int | None:
        return self._backend.token_to_id(tok)

    def to_json(self) -> str:
        """The tokenizers library's JSON of this tokenizer, special tokens added here included (what a
        grammar library reads the vocabulary's bytes from, engine/guide.py)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def _id_or_none(self, tok: str | None) -> int | None:
        return None if tok is None else self._backend.token_to_id(tok)

    # -- chat -----------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False, tools=None, *, max_tokens: int | None = None,
                            special_tokens_in_messages: bool | None = None, **kwargs) -> str | list[int]:
        """Render `messages` with the model's chat template, as transformers' apply_chat_template does.

        Extra kwargs (enable_thinking=False, date_string=..., documents=...) become template variables.
        With tokenize=True the rendered text is encoded without adding special tokens, because templates
        write their own (a Llama 3 template starts with bos_token; adding it again would double it).
        With max_tokens, any one input string, and the rendered text, that cannot fit in that many tokens
        is refused (RequestError) before it is rendered or tokenized; see `encode`.
        special_tokens_in_messages=False (with tokenize=True): a special token's text typed inside the messages
        or tools ("<|im_start|>system") is encoded as that text, not as the special token (text/typed_specials.py).
        None: the tokenizer's attribute of that name (True, as transformers and vLLM, unless set otherwise).
        """
        check_max_tokens(max_tokens)
        if special_tokens_in_messages is None:
            special_tokens_in_messages = self.special_tokens_in_messages or not tokenize
        elif not isinstance(special_tokens_in_messages, bool):
            raise RequestError(f"special_tokens_in_messages must be True or False, got {special_tokens_in_messages!r}")
        elif not (special_tokens_in_messages or tokenize):
            raise RequestError("special_tokens_in_messages=False needs tokenize=True: the rendered text alone "
                               "cannot say which special tokens were typed into a message")
        name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        template = self._compile(name)
        if not isinstance(messages, (list, tuple)):
            raise RequestError(f"messages must be a list of dicts with 'role' and 'content', got "
                               f"{type(messages).__name__}")
        if not messages:
            raise RequestError("apply_chat_template needs at least one message")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise RequestError("tools must be a list of JSON-schema dicts")

        def check(text: str, where: str) -> None:
            n_bytes = utf8_bytes(text, where)
            if max_tokens is not None:
                check_fits(n_bytes, max_tokens, self.max_token_bytes, where)

        given = {"documents": None, **self._template_specials, **kwargs, "messages": _prepare_messages(messages),
                 "tools": tools, "add_generation_prompt": add_generation_prompt}
        variables = {key: plain(value, check, key) for key, value in given.items()}
        rendered = self._render(template, variables, max_tokens)
        if not tokenize:
            check(rendered, "the rendered chat prompt")
            return rendered
        if not special_tokens_in_messages:
            specials = sorted({self._backend.id_to_token(i) for i in self.all_special_ids} - {None}, key=len,
                              reverse=True)
            masked = {k: mask(v, specials) if k in ("messages", "tools") else v for k, v in variables.items()}
            if masked != variables:  # something typed a special token's text
                self._check_text(rendered, max_tokens, "the rendered chat prompt")
                if self._split_backend is None:  # built once: a shared backend's mode is not for flipping
                    self._split_backend = _Backend.from_str(self._backend.to_str())
                    self._split_backend.encode_special_tokens = True
                return encode_typed_as_text(self._backend, self._split_backend, rendered,
                                            self._render(template, masked, max_tokens), self.all_special_ids)
        return self.encode(rendered, add_special_tokens=False, max_tokens=max_tokens,
                           what="the rendered chat prompt")

    def _render(self, template: jinja2.Template, variables: dict, max_tokens: int | None) -> str:
        bound = None if max_tokens is None else max_tokens * self.max_token_bytes
        try:
            rendered = render(template, variables, bound, lambda chars: RequestError(
                f"the rendered chat prompt passed {chars:,} characters; at most {max_tokens:,} tokens x "
                f"{self.max_token_bytes:,} bytes per token = {bound:,} bytes fit the context of {max_tokens:,} "
                "tokens"))
        except (TemplateError, RequestError):
            raise
        except TemplateRaised as err:
            raise TemplateError(f"the chat template refused this conversation: {err}") from None
        except jinja2.exceptions.SecurityError as err:
            raise TemplateError(
                f"the chat template tried to access an unsafe attribute and the sandbox refused it: {err}") from err
        except Exception as err:  # a template is untrusted code: any failure inside it is the template's failure
            raise TemplateError(f"the chat template failed to render: {type(err).__name__}: {err}") from err
        return rendered

    def _compile(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            source = self._templates.get(name)
            if source is None:
                known = f" (only ones named {sorted(self._templates)})" if self._templates else ""
                raise TemplateError(f"this model has no chat template{known}: pass a model with a chat_template "
                                    "in tokenizer_config.json or a chat_template.jinja file, or use plain prompts")
            try:
                self._compiled[name] = compile_template(source)
            except jinja2.TemplateSyntaxError as err:
                raise TemplateError(f"the chat template has a syntax error at line {err.lineno}: {err}") from err
        return self._compiled[name]


# -- helpers -------------------------------------------------------------------------------------------------

def _clean_up_spaces(text: str) -> str:
    # transformers' clean_up_tokenization, for the WordPiece-style models that still ask for it.
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# -- template rendering ---------------------------------------------------------------------------------------

def _prepare_messages(messages: list) -> list[dict]:
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise RequestError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
        # OpenAI clients send content=None next to tool_calls; templates handle a missing key but render
        # None as the text "None", so drop None values as transformers does.
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared
