"""Errors raised while resolving or loading the served model.

The server catches `ModelError` and exits with its message: each one says what is
wrong and what to do, so no traceback is needed.
"""


class ModelError(RuntimeError):
    """The model cannot be resolved or loaded."""


class EmbeddedModelError(ModelError):
    """The embedded model is missing or could not be converted."""


class ModelResolutionError(ModelError):
    """The model id names nothing loadable."""
