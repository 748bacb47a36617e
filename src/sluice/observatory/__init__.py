"""The observatory: measurements attached to a built model from outside (forward hooks)."""

from .attach import observe
from .probes import Observation

__all__ = ["Observation", "observe"]
