"""Training recipes: a TOML file with exactly the keys below, each validated, unknown keys refused."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..errors import SluiceError


class RecipeError(SluiceError, ValueError):
    """The recipe file is missing, malformed, or has unknown or invalid keys."""


@dataclass(frozen=True)
class CorpusSpec:
    source: str = "stdlib"
    glob: str = "**/*.py"
    exclude_parts: tuple = ("test", "tests", "idle_test", "site-packages", "__pycache__")
    heldout_percent: float = 3


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int = 8192
    special_tokens: tuple = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = True


@dataclass(frozen=True)
class TrainSpec:
    seed: int = 1234
    seq_len: int = 512
    micro_batch: int = 8
    grad_accum: int = 2
    steps: int = 2000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    init_std: float = 0.02
    eval_every: int = 250
    eval_tokens: int = 200_000
    checkpoint_every: int = 100
    autocast_bf16: bool = True
    compile: bool = True
    max_minutes: float = 0  # 0 = no wall-clock limit


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
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise RecipeError(f"recipe {path} is not valid TOML: {e}") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "recipe") -> "Recipe":
        sections = {"corpus": CorpusSpec, "tokenizer": TokenizerSpec, "model": ModelSpec, "train": TrainSpec}
        unknown = sorted(set(raw) - set(sections))
        if unknown:
            raise RecipeError(f"{source}: unknown section(s) {unknown}; expected {sorted(sections)}")
        parts = {name: _section(spec, raw.get(name, {}), f"{source} [{name}]")
                 for name, spec in sections.items()}
        recipe = cls(**parts, path=source)
        recipe.check()
        return recipe

    def check(self):
        t, m = self.train, self.model
        positive = {"seq_len": t.seq_len, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
                    "steps": t.steps, "lr": t.lr, "eval_every": t.eval_every,
                    "checkpoint_every": t.checkpoint_every, "hidden_size": m.hidden_size,
                    "num_layers": m.num_layers, "vocab_size": self.tokenizer.vocab_size}
        for k, v in positive.items():
            if v <= 0:
                raise RecipeError(f"{self.path}: {k} must be > 0, got {v}")
        if m.num_heads % m.num_kv_heads:
            raise RecipeError(f"{self.path}: num_heads ({m.num_heads}) must be a multiple of "
                              f"num_kv_heads ({m.num_kv_heads})")
        if t.seq_len > m.max_position_embeddings:
            raise RecipeError(f"{self.path}: seq_len {t.seq_len} exceeds max_position_embeddings "
                              f"{m.max_position_embeddings}")
        if not 0 <= self.corpus.heldout_percent < 100:
            raise RecipeError(f"{self.path}: heldout_percent must be in [0, 100), got "
                              f"{self.corpus.heldout_percent}")


def _section(spec, values: dict, where: str):
    if not isinstance(values, dict):
        raise RecipeError(f"{where} must be a table")
    known = {f.name: f for f in fields(spec)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    out = {}
    for k, v in values.items():
        default = known[k].default
        if isinstance(default, tuple):
            if not isinstance(v, list):
                raise RecipeError(f"{where}: {k} must be a list, got {v!r}")
            v = tuple(v)
        elif isinstance(default, bool):
            if not isinstance(v, bool):
                raise RecipeError(f"{where}: {k} must be true or false, got {v!r}")
        elif isinstance(default, (int, float)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                    isinstance(default, int) and not isinstance(default, bool) and not isinstance(v, int)):
                raise RecipeError(f"{where}: {k} must be a {type(default).__name__}, got {v!r}")
        elif not isinstance(v, type(default)):
            raise RecipeError(f"{where}: {k} must be a {type(default).__name__}, got {v!r}")
        out[k] = v
    return spec(**out)
