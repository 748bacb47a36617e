"""Training recipes: a TOML file with exactly the keys below, each validated, unknown keys refused."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .fields import (Betas, Bool, BoolOrAuto, Float, Int, RecipeError, RelativeGlob, Str, StrList, read_value,
                     spec)

MAX_RECIPE_BYTES = 1 << 20

__all__ = ["CorpusSpec", "ModelSpec", "Recipe", "RecipeError", "TokenizerSpec", "TrainSpec"]


@dataclass(frozen=True)
class CorpusSpec:
    source: str = spec("stdlib", Str())
    glob: str = spec("**/*.py", RelativeGlob())
    exclude_parts: tuple = spec(("test", "tests", "idle_test", "site-packages", "__pycache__"), StrList())
    # Path parts whose files only add training tokens: never held out, never read by the tokenizer's
    # BPE training. So the held-out split and a trained tokenizer are those of the corpus without them.
    train_only_parts: tuple = spec((), StrList())
    # 0 would leave nothing to evaluate on; 100 nothing to train on.
    heldout_percent: float = spec(3, Float(0, 100))


@dataclass(frozen=True)
class TokenizerSpec:
    # "train": a new byte-level BPE from the corpus; "bundled": the bundled model's tokenizer.json;
    # otherwise a tokenizer.json or a model directory holding one (relative to the recipe file).
    # A reused tokenizer is copied byte for byte, so a draft model can share its target's exactly.
    source: str = spec("train", Str())
    vocab_size: int = spec(8192, Int())
    special_tokens: tuple = spec(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), StrList(min_len=1))


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int = spec(256, Int())
    num_layers: int = spec(6, Int())
    num_heads: int = spec(4, Int())
    num_kv_heads: int = spec(2, Int())
    head_dim: int = spec(64, Int(2))
    intermediate_size: int = spec(768, Int())
    max_position_embeddings: int = spec(2048, Int())
    rope_theta: float = spec(10000.0, Float())
    norm_eps: float = spec(1e-6, Float(0, 1, hi_open=False))
    tie_word_embeddings: bool = spec(True, Bool())


@dataclass(frozen=True)
class TrainSpec:
    seed: int = spec(1234, Int(0, 2**63 - 1))
    seq_len: int = spec(512, Int())
    micro_batch: int = spec(8, Int())
    grad_accum: int = spec(2, Int())
    steps: int = spec(2000, Int())
    lr: float = spec(2e-3, Float())
    min_lr_ratio: float = spec(0.1, Float(0, 1, lo_open=False, hi_open=False))
    warmup_steps: int = spec(100, Int(0))
    weight_decay: float = spec(0.1, Float(0, lo_open=False))
    betas: tuple = spec((0.9, 0.95), Betas())
    grad_clip: float = spec(1.0, Float())
    init_std: float = spec(0.02, Float())
    eval_every: int = spec(250, Int())
    eval_tokens: int = spec(200_000, Int())
    checkpoint_every: int = spec(100, Int())
    autocast_bf16: bool | str = spec(True, BoolOrAuto())  # "auto": train.bf16_autocast decides
    compile: bool = spec(True, Bool())
    max_minutes: float = spec(0, Float(0, lo_open=False))  # 0 = no wall-clock limit


@dataclass(frozen=True)
class Recipe:
    corpus: CorpusSpec
    tokenizer: TokenizerSpec
    model: ModelSpec
    train: TrainSpec
    path: str = ""

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist")
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise RecipeError(f"recipe {path} is {path.stat().st_size:,} bytes; a recipe is a few dozen lines "
                              f"(at most {MAX_RECIPE_BYTES:,} bytes)")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise RecipeError(f"recipe {path} is not valid UTF-8 TOML: {e}") from None
        except OSError as e:
            raise RecipeError(f"recipe {path} cannot be read: {e.strerror or e}") from None
        return cls.from_dict(raw, source=str(path), base=path.parent)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "recipe", base: str | Path | None = None) -> "Recipe":
        """`base`: the directory a relative tokenizer.source is read from (the recipe file's; cwd if None)."""
        sections = {"corpus": CorpusSpec, "tokenizer": TokenizerSpec, "model": ModelSpec, "train": TrainSpec}
        if not isinstance(raw, dict):
            raise RecipeError(f"{source}: a recipe must be a table of sections, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(sections))
        if unknown:
            raise RecipeError(f"{source}: unknown section(s) {unknown}; expected {sorted(sections)}")
        parts = {name: _section(cls_, raw.get(name, {}), f"{source}: {name}")
                 for name, cls_ in sections.items()}
        tok_source = parts["tokenizer"].source
        if tok_source not in ("train", "bundled"):  # recorded resolved, so the run does not depend on cwd
            path = Path(tok_source).expanduser()
            path = path if path.is_absolute() else Path(base or ".") / path
            parts["tokenizer"] = replace(parts["tokenizer"], source=str(path.resolve()))
        recipe = cls(**parts, path=source)
        recipe.check()
        return recipe

    def check(self):
        """What no single field can say alone: the fields' rules already held on the way in."""
        t, m, tok = self.train, self.model, self.tokenizer

        def bad(key, value, why):
            raise RecipeError(f"{self.path}: {key} {why}, got {value!r}")

        if m.num_heads % m.num_kv_heads:
            bad("model.num_heads", m.num_heads, f"must be a multiple of model.num_kv_heads ({m.num_kv_heads})")
        if m.head_dim % 2:  # RoPE rotates pairs of channels
            bad("model.head_dim", m.head_dim, "must be even (RoPE rotates channel pairs)")
        if t.seq_len > m.max_position_embeddings:
            bad("train.seq_len", t.seq_len, f"must be <= model.max_position_embeddings ({m.max_position_embeddings})")
        if t.warmup_steps > t.steps:
            bad("train.warmup_steps", t.warmup_steps, f"must be <= train.steps ({t.steps})")
        if t.eval_tokens < t.seq_len:  # fewer than one window: the held-out loss would measure nothing
            bad("train.eval_tokens", t.eval_tokens, f"must be >= train.seq_len ({t.seq_len}), one evaluation window")
        # A reused tokenizer is checked against the recipe now (missing, unreadable, other vocab_size);
        # a byte-level BPE to train starts from all 256 bytes, then the special tokens, then merges.
        if tok.source != "train":
            reused_tokenizer(tok, self.path)
        elif tok.vocab_size < (least := 256 + len(tok.special_tokens)):
            bad("tokenizer.vocab_size", tok.vocab_size,
                f"must be >= {least} (256 byte tokens + {len(tok.special_tokens)} special tokens)")


def _section(spec_cls, values, where: str):
    if not isinstance(values, dict):
        raise RecipeError(f"{where} must be a table, got {values!r}")
    known = {f.name: f for f in fields(spec_cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    return spec_cls(**{k: read_value(known[k].metadata["rule"], v, where, k) for k, v in values.items()})


def tokenizer_file(spec: TokenizerSpec) -> Path:
    """The tokenizer.json a reused tokenizer.source names (not for source = "train")."""
    if spec.source == "bundled":
        from ..model.loading import bundled_model_dir  # training -> model; only when asked for
        return bundled_model_dir() / "tokenizer.json"
    path = Path(spec.source)
    return path / "tokenizer.json" if path.is_dir() else path


def reused_tokenizer(spec: TokenizerSpec, where: str = "recipe"):
    """The tokenizer tokenizer.source names, checked against the recipe: it must exist, load, have
    exactly tokenizer.vocab_size tokens (the model's vocabulary is sized from it) and hold the
    recipe's special tokens (the first separates files in the token stream)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = tokenizer_file(spec)
    if not path.is_file():
        raise RecipeError(f"{where}: tokenizer.source {spec.source!r}: {path} does not exist (expected "
                          f"\"train\", \"bundled\", a tokenizer.json or a model directory holding one)")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise RecipeError(f"{where}: tokenizer.source {path} is not a readable tokenizer.json ({e})") from None
    if tok.get_vocab_size() != spec.vocab_size:
        raise RecipeError(f"{where}: tokenizer.vocab_size is {spec.vocab_size} but the tokenizer {path} has "
                          f"{tok.get_vocab_size()} tokens; set tokenizer.vocab_size = {tok.get_vocab_size()}")
    added = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    missing = [t for t in spec.special_tokens if t not in added]
    if missing:
        raise RecipeError(f"{where}: tokenizer.special_tokens {missing} are not special tokens of {path} "
                          f"(it has {sorted(added)})")
    return tok
