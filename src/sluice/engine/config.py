"""EngineConfig: every option of an `LLM`, checked in one place before anything loads.

`LLM(model, dtype=..., ...)` builds one from its keyword arguments, `LLM(config=EngineConfig(...))`
takes one whole, and the CLI builds one from its flags (cli/common.py), so a bad option reads the
same wherever it comes from, except for its name: errors name an option the way the caller spelled
it, a keyword argument (`max_num_seqs`) or a flag (`--max-num-seqs`), through a `Naming`.

What needs the model (its context length, the draft's tokenizer) or the machine (the device, a
quantization scheme's kernels) is checked where that is known: `fit_context` after the config.json
is read, loading.load for the rest.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Mapping

from ..errors import ConfigError
from .batching import DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from .cpu_paths import COMPUTE_CHOICES
from .kv_cache import KV_CACHE_DTYPES, parse_size
from .speculative import check_num_tokens, resolve_mode

# Why tensor parallelism refuses an option (parallel/engine.py runs the plain torch forward per rank).
_TP_FORWARD = "tensor parallelism runs the continuous-batching engine's plain torch forward"
_TP_REFUSED = (  # (option, the value that is refused, or a test of it; why)
    ("compile", True, _TP_FORWARD),
    ("quantize", lambda v: v is not None, _TP_FORWARD),
    ("fused_head", True, "the fused head samples from one process's whole vocabulary"),
    ("kernels", True, "it is single-process code"),
    ("compute", "float32", "it needs sluice's single-process CPU kernel"),
    ("speculative", lambda v: v != "off", _TP_FORWARD),
)


@dataclass(frozen=True)
class Naming:
    """How error messages name the options: as keyword arguments (the default) or as the flags that
    set them. `flags` maps an option to its flag, or to {value: flag} where each value has its own
    (speculative: --draft-model, --prompt-lookup)."""
    flags: Mapping[str, object] = field(default_factory=dict)
    tensor_parallel: str = "tensor parallelism"
    leave: str = "leave it at its default"

    def of(self, option: str) -> str:
        flag = self.flags.get(option, option)
        return flag if isinstance(flag, str) else option

    def setting(self, option: str, value) -> str:
        """`option=value` as a keyword, or the flag that sets that value."""
        flag = self.flags.get(option)
        if isinstance(flag, Mapping):
            flag = flag.get(value)
        return flag if isinstance(flag, str) else f"{option}={value!r}"


KEYWORDS = Naming()


@dataclass(frozen=True)
class EngineConfig:
    """The LLM's options (see LLM.__init__ for what each does). Checked when built; a few are
    normalised then: kv_cache_memory to bytes, speculative to its mode ("off", "draft" or
    "prompt-lookup") with draft_model and num_speculative_tokens filled for it."""
    model: str | Path | None = None
    dtype: str = "float32"
    max_model_len: int | None = None
    compile: bool = False
    fused_head: bool | str = "auto"
    device: object = "cpu"
    quantize: str | None = None
    kernels: bool | str = "auto"
    kv_cache_memory: int | str | None = None
    compute: str = "auto"
    speculative: str | None = None
    draft_model: str | Path | None = None
    num_speculative_tokens: int | str | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    batching: bool = True
    tensor_parallel: int = 1
    kv_cache_dtype: str = "auto"
    naming: InitVar[Naming | None] = None

    def __post_init__(self, naming: Naming | None) -> None:
        names = naming or KEYWORDS
        if self.kv_cache_memory is not None:
            self._set("kv_cache_memory", parse_size(self.kv_cache_memory, names.of("kv_cache_memory")))
        for option in ("fused_head", "kernels"):
            if getattr(self, option) not in (True, False, "auto"):
                raise ConfigError(f"{names.of(option)} must be True, False or 'auto', got {getattr(self, option)!r}")
        for option in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, option)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{names.of(option)} must be an integer >= 1, got {v!r}")
        for option in ("batching", "compile"):
            if not isinstance(getattr(self, option), bool):
                raise ConfigError(f"{names.of(option)} must be True or False, got {getattr(self, option)!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"{names.of('kv_cache_dtype')} must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.compute not in COMPUTE_CHOICES:
            raise ConfigError(f"{names.of('compute')} must be one of {', '.join(COMPUTE_CHOICES)}, "
                              f"got {self.compute!r}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool) or not (
                isinstance(self.max_model_len, int) and self.max_model_len > 0)):
            raise ConfigError(f"{names.of('max_model_len')} must be an integer >= 1 (at most the model's "
                              f"max_position_embeddings), got {self.max_model_len!r}")
        k = self.num_speculative_tokens
        mode, draft, default_k = resolve_mode(self.speculative, self.draft_model, None, self.model is None)
        if mode == "off" and k is not None:
            resolve_mode(self.speculative, self.draft_model, k, self.model is None)  # says it needs a mode
        if mode != "off":  # k checked here rather than in resolve_mode, to name it as the caller did
            k = check_num_tokens(default_k if k is None else k, names.of("num_speculative_tokens"))
        self._set("speculative", mode)
        self._set("draft_model", draft)
        self._set("num_speculative_tokens", k)
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"{names.of('tensor_parallel')} must be an integer >= 1, got {tp!r}")
        if tp > 1:
            self._check_parallel(names)

    def _set(self, option: str, value) -> None:
        object.__setattr__(self, option, value)  # a normalised value, while the frozen instance is built

    def _check_parallel(self, names: Naming) -> None:
        """Refuse, before the process group starts or anything loads, what a split model cannot run."""
        for option, refused, why in _TP_REFUSED:
            value = getattr(self, option)
            if refused(value) if callable(refused) else value == refused:
                raise ConfigError(f"{names.setting(option, value)} is not available with {names.tensor_parallel} "
                                  f"({why}); {names.leave}")

    def fit_context(self, limit: int) -> int:
        """The context requests get, once the model's (max_position_embeddings) is known."""
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ConfigError(f"max_model_len must be an integer in [1, {limit}] (the model's "
                              f"max_position_embeddings), got {self.max_model_len!r}")
        return self.max_model_len or limit
