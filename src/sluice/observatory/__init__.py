"""The observatory: measurements attached to a built model from outside (forward hooks)."""

from .probes import ValveProbe

__all__ = ["ValveProbe"]
