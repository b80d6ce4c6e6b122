"""User-facing errors: each names what is wrong (file, layer, argument) and says how to fix it."""

from __future__ import annotations


class PrecisionError(Exception):
    """Base class for every error pytest-precision raises on purpose.

    The plugin shows these as one-screen messages without a traceback.
    """


class ConfigurationError(PrecisionError, ValueError):
    """A bad argument: unknown variant, a module regex matching nothing, a missing loss, ..."""


class BaselineError(PrecisionError):
    """A baseline file that cannot be used: empty, not JSON, of another schema version, ..."""


class ModelRunError(PrecisionError):
    """The model rejected the inputs, or the run produced something that cannot be compared."""


class NotSupportedHere(ConfigurationError):
    """A variant this device or this torch cannot run (fp8 matmuls without a GPU that has them, ...). Under
    pytest the test is skipped with the reason; elsewhere it is an error."""
