"""pytest-precision: per-layer numerical precision of PyTorch models as a CI gate.

The public names load lazily, so that `import pytest_precision.plugin` (which pytest does for every user of
the environment) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_precision.base.errors import (
        BaselineError,
        ConfigurationError,
        ModelRunError,
        NotSupportedHere,
        PrecisionError,
    )
    from pytest_precision.base.records import Record, TensorError
    from pytest_precision.distributed.ranks import RankFailure
    from pytest_precision.distributed.sharding import ShardedModel, sharded
    from pytest_precision.engine.arrangements import Arrangement, Call
    from pytest_precision.engine.compare import compare
    from pytest_precision.engine.compile_spec import CompileSpec
    from pytest_precision.engine.port_spec import Port
    from pytest_precision.engine.progress import ProgressEvent
    from pytest_precision.engine.reference_run import LowPrecisionReferenceWarning, reference
    from pytest_precision.engine.references import Reference, ReferenceCache
    from pytest_precision.engine.routers import Routers
    from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant
    from pytest_precision.numbers.metrics import tensor_error
    from pytest_precision.plugin.assertion import assert_precision_within
    from pytest_precision.plugin.session import PrecisionUnassertedWarning
    from pytest_precision.reports.report import PrecisionReport, compare_logprobs

__version__ = "0.1.0"

from pytest_precision.base.torchao_notices import quiet_torchao_notices

quiet_torchao_notices()  # torchao's CPU-build notices, printed by any later import of transformers

_EXPORTS = {
    "Arrangement": "engine.arrangements",
    "Call": "engine.arrangements",
    "assert_precision_within": "plugin.assertion",
    "compare": "engine.compare",
    "CompileSpec": "engine.compile_spec",
    "LowPrecisionReferenceWarning": "engine.reference_run",
    "PrecisionUnassertedWarning": "plugin.session",
    "RankFailure": "distributed.ranks",
    "ShardedModel": "distributed.sharding",
    "sharded": "distributed.sharding",
    "compare_logprobs": "reports.report",
    "BaselineError": "base.errors",
    "ConfigurationError": "base.errors",
    "ModelRunError": "base.errors",
    "NotSupportedHere": "base.errors",
    "PrecisionError": "base.errors",
    "TensorError": "base.records",
    "tensor_error": "numbers.metrics",
    "ProgressEvent": "engine.progress",
    "Reference": "engine.references",
    "ReferenceCache": "engine.references",
    "Routers": "engine.routers",
    "reference": "engine.reference_run",
    "PrecisionReport": "reports.report",
    "Record": "base.records",
    "BUILTIN_VARIANTS": "engine.variants",
    "Variant": "engine.variants",
    "Port": "engine.port_spec",
}

__all__ = [
    "BUILTIN_VARIANTS",
    "Arrangement",
    "BaselineError",
    "Call",
    "CompileSpec",
    "ConfigurationError",
    "LowPrecisionReferenceWarning",
    "ModelRunError",
    "NotSupportedHere",
    "Port",
    "PrecisionError",
    "PrecisionReport",
    "PrecisionUnassertedWarning",
    "ProgressEvent",
    "RankFailure",
    "Record",
    "Reference",
    "ReferenceCache",
    "Routers",
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
