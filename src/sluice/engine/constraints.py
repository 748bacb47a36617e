"""What a constrained request asks its output to be: a JSON object, a JSON Schema, a regex or a grammar.

A Constraint is checked when it is made (a bad schema, regex or grammar is a ConstraintError naming
it and where it fails), so it reaches the engine only valid. Each kind compiles to one grammar of
llguidance (docs/constrained.md says why that library): the engine runs that grammar token by token
(guide.py) and masks the logits before every draw, so the output always matches.

Kinds and their spec:
- "json_object": None. Any JSON object (OpenAI's response_format json_object).
- "json_schema": a JSON Schema, as a dict or its JSON text ($ref / $defs, enum, arrays, nested objects;
  llguidance refuses the keywords it cannot enforce rather than ignore them).
- "regex": a regular expression (Rust regex syntax) the whole output must match.
- "grammar": a context-free grammar in llguidance's Lark dialect (https://github.com/guidance-ai/
  llguidance/blob/main/docs/syntax.md): rules `name: ...`, terminals `NAME: /regex/` or "text",
  `start` the first rule; a GBNF grammar converts with llguidance.gbnf_to_lark.
JSON output has no whitespace outside strings (key and item separators "," and ":"): an untrained
model's newlines could otherwise run to max_tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import ConstraintError

KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_SPEC_CHARS = 200_000  # a request's schema or grammar: far over any real one, and cheap to refuse
# llguidance's JSON compiler options: compact separators, no free whitespace (see the module docstring)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def llguidance():
    """The llguidance module (a dependency of sluice-llm); ConstraintError when the install lacks it."""
    try:
        import llguidance as llg
    except ImportError as e:  # a broken or partial install
        raise ConstraintError(f"constrained decoding needs the llguidance package ({e}); "
                              "reinstall sluice-llm (`pip install sluice-llm`)") from None
    return llg


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; spec: what the kind needs (the module docstring). Validated on creation."""
    kind: str
    spec: object = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_object":
            if self.spec is not None:
                raise ConstraintError(f"a json_object constraint takes no spec, got {type(self.spec).__name__}")
        elif self.kind == "json_schema":
            if not isinstance(self.spec, (dict, str)):
                raise ConstraintError(f"a json_schema constraint's spec must be a dict or its JSON text, "
                                      f"got {type(self.spec).__name__}")
        elif not isinstance(self.spec, str) or not self.spec:
            raise ConstraintError(f"a {self.kind} constraint's spec must be a non-empty str, got {self.spec!r:.80}")
        size = len(self.spec) if isinstance(self.spec, str) else len(json.dumps(self.spec)) if self.spec else 0
        if size > MAX_SPEC_CHARS:
            raise ConstraintError(f"the {self.kind} spec has {size} characters, over the limit of {MAX_SPEC_CHARS}")
        error = llguidance().LLMatcher.validate_grammar(self.llg_grammar())
        if error:
            raise ConstraintError(f"invalid {self.kind.replace('_', ' ')}: {error.strip()}")

    def __hash__(self) -> int:  # a schema dict is not hashable; its JSON text is
        return hash((self.kind, self.spec if not isinstance(self.spec, dict) else json.dumps(self.spec, sort_keys=True)))

    def llg_grammar(self) -> str:
        """This constraint as an llguidance grammar (its JSON text)."""
        matcher = llguidance().LLMatcher
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.spec)
        if self.kind == "grammar":
            return matcher.grammar_from_lark(self.spec)
        schema = {"type": "object"} if self.kind == "json_object" else self.spec
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"the json_schema spec is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON Schema must be a JSON object, got {type(schema).__name__}")
        return matcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
