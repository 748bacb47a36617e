"""Exceptions sluice raises. Every message names the offending thing (a file, a key, a value)."""


class SluiceError(Exception):
    """Base class: catch this to handle any sluice error."""


class ConfigError(SluiceError):
    """config.json describes an architecture or feature sluice does not implement, or is malformed."""


class CheckpointError(SluiceError):
    """Weight files are missing, malformed, unsafe, or disagree with the config."""


class ModelNotFoundError(SluiceError):
    """A path or repo id could not be resolved to a local model directory."""


class TemplateError(SluiceError):
    """A chat template failed to render or tried to leave the sandbox."""


class RequestError(SluiceError, ValueError):
    """A bad request: invalid sampling value, prompt too long for the context, and so on."""


class ObservatoryError(SluiceError, ValueError):
    """A measurement cannot be taken as asked: too big to hold, degenerate data, a bad output dir."""


class SurgeryError(SluiceError, ValueError):
    """A what-if (`sluice inspect --surgery`) is unknown, malformed, or does not apply to this model."""


class BenchmarkError(SluiceError, ValueError):
    """A benchmark was asked for something it cannot measure: an unknown dtype or model, a size <= 0."""


class NumericsError(SluiceError):
    """The model computed NaN or inf where a number was needed (its weights or config are broken)."""


class ContextExceeded(RequestError):
    """A prompt and the max_tokens asked for do not fit the context together; the numbers are kept
    so that a caller (the server) can say it in its own words."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, what: str = ""):
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit
        super().__init__(f"{what}has {prompt_tokens} tokens and asks for max_tokens={max_tokens}: "
                         f"{prompt_tokens + max_tokens} tokens do not fit the context of {limit} "
                         "tokens (shorten the prompt or lower max_tokens)")


class ConstraintError(RequestError):
    """A constrained-decoding request (engine/constraints.py) is malformed: an unknown kind, or a JSON
    Schema, regex or grammar that does not compile; the message names which and where."""
