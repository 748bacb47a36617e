"""sluice: a readable, fast, from-scratch decoder-LLM engine with an observatory for its numerics.

The public names below load on first use (PEP 562), so `import sluice` and the `sluice` command
start without importing torch: a Ctrl-C or a usage error during start-up never meets a half-imported
torch, and `sluice --help` answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (CheckpointError, ConfigError, ConstraintError, ModelNotFoundError, NumericsError,
                     RequestError, SluiceError, TemplateError)

__version__ = "0.1.0"

# public name -> (module, attribute)
_LAZY = {
    "LLM": (".llm", "LLM"), "RequestOutput": (".engine", "RequestOutput"),
    "SamplingParams": (".engine.sampling", "SamplingParams"),
    "Constraint": (".engine.constraints", "Constraint"),
    "ModelConfig": (".model", "ModelConfig"), "Transformer": (".model", "Transformer"),
    "Model": (".model", "Transformer"), "load": (".model", "load"),
    "observe": (".observatory", "observe"), "surgery": (".observatory.surgery", None),
    "inspect": (".observatory.export", "inspect"),
    "Tokenizer": (".text.tokenizer", "Tokenizer"),
}

__all__ = ["LLM", "RequestOutput", "SamplingParams", "Constraint", "load", "observe", "Model", "ModelConfig", "Tokenizer",
           "Transformer", "SluiceError", "ConfigError", "CheckpointError", "ModelNotFoundError", "TemplateError",
           "RequestError", "ConstraintError", "NumericsError", "surgery", "inspect"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'sluice' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module, __name__)
    value = value if attr is None else getattr(value, attr)  # attr None: the name is a module
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # what editors and type checkers see
    from .engine import RequestOutput
    from .llm import LLM
    from .engine.sampling import SamplingParams
    from .engine.constraints import Constraint
    from .model import ModelConfig, Transformer, load
    from .model import Transformer as Model
    from .observatory import observe, surgery
    from .text.tokenizer import Tokenizer
