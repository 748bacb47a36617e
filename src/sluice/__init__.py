"""sluice: a readable, fast, from-scratch decoder-LLM engine with an observatory for its numerics."""

from .config import ModelConfig
from .errors import (CheckpointError, ConfigError, ModelNotFoundError, RequestError, SluiceError,
                     TemplateError)
from .loading import load
from .model import Transformer
from .tokenizer import Tokenizer

Model = Transformer

__version__ = "0.1.0"
__all__ = ["load", "Model", "ModelConfig", "Tokenizer", "Transformer", "SluiceError", "ConfigError",
           "CheckpointError", "ModelNotFoundError", "TemplateError", "RequestError"]
