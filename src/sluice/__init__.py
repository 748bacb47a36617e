"""sluice: a readable, fast, from-scratch decoder-LLM engine with an observatory for its numerics."""

from .config import ModelConfig
from .engine import LLM, RequestOutput
from .errors import (CheckpointError, ConfigError, ModelNotFoundError, RequestError, SluiceError,
                     TemplateError)
from .loading import load
from .model import Transformer
from .sampling import SamplingParams
from .tokenizer import Tokenizer

Model = Transformer

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "load", "Model", "ModelConfig", "Tokenizer", "Transformer", "SluiceError", "ConfigError",
           "CheckpointError", "ModelNotFoundError", "TemplateError", "RequestError"]
