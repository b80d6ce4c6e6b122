"""pytest-precision: per-layer numerical precision of PyTorch models as a CI gate.

The public names load lazily, so that `import pytest_precision.plugin` (which pytest does for every user of
the environment) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .arrangements import Arrangement, Call
    from .assertion import assert_precision_within
    from .comparison import LowPrecisionReferenceWarning, compare
    from .cross_engine import compare_logprobs
    from .distributed import RankFailure
    from .errors import BaselineError, ConfigurationError, ModelRunError, PrecisionError
    from .metrics import TensorError, tensor_error
    from .progress import ProgressEvent
    from .references import Reference, ReferenceCache, reference
    from .report import PrecisionReport, Record
    from .session import PrecisionUnassertedWarning
    from .sharding import ShardedModel, sharded
    from .variants import BUILTIN_VARIANTS, Variant

__version__ = "0.1.0"

_EXPORTS = {
    "Arrangement": "arrangements",
    "Call": "arrangements",
    "assert_precision_within": "assertion",
    "compare": "comparison",
    "LowPrecisionReferenceWarning": "comparison",
    "PrecisionUnassertedWarning": "session",
    "RankFailure": "distributed",
    "ShardedModel": "sharding",
    "sharded": "sharding",
    "compare_logprobs": "cross_engine",
    "BaselineError": "errors",
    "ConfigurationError": "errors",
    "ModelRunError": "errors",
    "PrecisionError": "errors",
    "TensorError": "metrics",
    "tensor_error": "metrics",
    "ProgressEvent": "progress",
    "Reference": "references",
    "ReferenceCache": "references",
    "reference": "references",
    "PrecisionReport": "report",
    "Record": "report",
    "BUILTIN_VARIANTS": "variants",
    "Variant": "variants",
}

__all__ = [
    "BUILTIN_VARIANTS",
    "Arrangement",
    "BaselineError",
    "Call",
    "ConfigurationError",
    "LowPrecisionReferenceWarning",
    "ModelRunError",
    "PrecisionError",
    "PrecisionReport",
    "PrecisionUnassertedWarning",
    "ProgressEvent",
    "RankFailure",
    "Record",
    "Reference",
    "ReferenceCache",
    "ShardedModel",
    "TensorError",
    "Variant",
    "__version__",
    "assert_precision_within",
    "compare",
    "compare_logprobs",
    "inputs",
    "reference",
    "sharded",
    "tensor_error",
]


def __getattr__(name: str) -> Any:
    if name == "inputs":  # the submodule of input builders: pytest_precision.inputs.random_tokens(...)
        return importlib.import_module(".inputs", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_precision' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
