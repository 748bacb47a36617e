"""sluice: a readable, fast, from-scratch decoder-LLM engine with an observatory for its numerics."""

from .engine import LLM, RequestOutput
from .engine.sampling import SamplingParams
from .errors import (CheckpointError, ConfigError, ModelNotFoundError, RequestError, SluiceError,
                     TemplateError)
from .model import ModelConfig, Transformer, load
from .observatory import observe, surgery
from .tokenizer import Tokenizer

Model = Transformer

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "load", "observe", "Model", "ModelConfig", "Tokenizer", "Transformer", "SluiceError", "ConfigError",
           "CheckpointError", "ModelNotFoundError", "TemplateError", "RequestError", "surgery"]
