"""What a checkpoint becomes: config, weights, the plain-torch decoder, and the loader."""

from .config import ModelConfig
from .layers import Transformer
from .loading import load

__all__ = ["ModelConfig", "Transformer", "load"]
