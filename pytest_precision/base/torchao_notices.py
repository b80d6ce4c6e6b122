"""Quiet two notices every process importing torchao prints on a CPU build of torch (transformers imports
torchao whenever it is installed): torchao failing to load its CUDA-only libraries, and torch's deprecation
notice about how torchao registers its enums. Both are about torchao's packaging, not the user's code; on a
CUDA build of torch a library that fails to load is still reported."""

from __future__ import annotations

import logging
import sys

#: The loggers that print the notices: torchao's package logger, torch's pytree module.
TORCHAO_LOGGER = "torchao"
PYTREE_LOGGER = "torch.utils._pytree"


class TorchaoNotices(logging.Filter):
    """Drops the notices above; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == TORCHAO_LOGGER:
            message = record.getMessage()
            return not (message.startswith("Failed to load ") and "torchao" in message and _cpu_torch())
        if record.name == PYTREE_LOGGER and record.args:
            enum = record.args[0] if isinstance(record.args, tuple) else None
            return not (
                isinstance(enum, type)
                and str(getattr(enum, "__module__", "")).startswith("torchao")
                and "register_constant() on Enum subclasses is deprecated" in str(record.msg)
            )
        return True


def _cpu_torch() -> bool:
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    return version is not None and getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None


def quiet_torchao_notices() -> None:
    """Install the filter (once) on the two loggers, before anything imports torchao."""
    for name in (TORCHAO_LOGGER, PYTREE_LOGGER):
        logger = logging.getLogger(name)
        if not any(isinstance(f, TorchaoNotices) for f in logger.filters):
            logger.addFilter(TorchaoNotices())


__all__ = ["TorchaoNotices", "quiet_torchao_notices"]
