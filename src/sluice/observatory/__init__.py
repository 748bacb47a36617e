"""The observatory: measurements attached to a built model from outside (forward hooks)."""

from .probes import Observation, observe

__all__ = ["Observation", "observe"]
