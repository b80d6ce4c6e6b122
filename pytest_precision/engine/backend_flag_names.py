"""The torch.backends settings a variant may set, and the values each takes: a fixed list, never a walk.

A `backend` path names a documented leaf of a torch.backends submodule. Resolving any other dotted path from
`torch.backends` would reach modules (`sys` is `torch.backends.sys`), class attributes and dunders: a data file
could then set `sys.path` and have code imported from a folder it names. So every path is looked up here
first, and only these names are ever passed to getattr/setattr (see backend_flags.resolve_flag).
"""

from __future__ import annotations

from typing import Any

from pytest_precision.base.errors import ConfigurationError

#: True/False settings (torch 2.6 to 2.15; a setting a torch lacks is refused naming it when a run sets it).
BOOL_FLAGS: frozenset[str] = frozenset(
    {
        "cuda.matmul.allow_tf32",
        "cuda.matmul.allow_bf16_reduced_precision_reduction",
        "cuda.matmul.allow_fp16_reduced_precision_reduction",
        "cuda.matmul.allow_fp16_accumulation",
        "cudnn.allow_tf32",
        "cudnn.benchmark",
        "cudnn.deterministic",
        "cudnn.enabled",
        "mkldnn.enabled",
        "mkldnn.deterministic",
        "opt_einsum.enabled",
    }
)
# The values torch accepts for each fp32_precision (torch >= 2.9): cuBLAS/cuDNN have no bf16 mode.
_CUDA_PRECISIONS = ("ieee", "tf32", "none")
_ALL_PRECISIONS = ("ieee", "tf32", "bf16", "none")
#: String settings (torch >= 2.9's per-backend fp32_precision), with the values each takes.
PRECISION_FLAGS: dict[str, tuple[str, ...]] = {
    "fp32_precision": _ALL_PRECISIONS,
    "cuda.matmul.fp32_precision": _CUDA_PRECISIONS,
    "cudnn.fp32_precision": _CUDA_PRECISIONS,
    "cudnn.conv.fp32_precision": _CUDA_PRECISIONS,
    "cudnn.rnn.fp32_precision": _CUDA_PRECISIONS,
    "mkldnn.fp32_precision": _ALL_PRECISIONS,
    "mkldnn.matmul.fp32_precision": _ALL_PRECISIONS,
    "mkldnn.conv.fp32_precision": _ALL_PRECISIONS,
    "mkldnn.rnn.fp32_precision": _ALL_PRECISIONS,
}
#: Every path a variant's `backend` may name.
BACKEND_FLAGS: frozenset[str] = BOOL_FLAGS | frozenset(PRECISION_FLAGS)


def checked_flag_name(path: object) -> str:
    """`path` when it is one of BACKEND_FLAGS, else a ConfigurationError listing them."""
    if not isinstance(path, str) or path not in BACKEND_FLAGS:
        raise ConfigurationError(
            f"backend flag {path!r} is not one of the torch.backends settings a variant may set: "
            f"{', '.join(sorted(BACKEND_FLAGS))}"
        )
    return path


def checked_flag_value(path: str, value: Any) -> Any:
    """`value` when flag `path` (one of BACKEND_FLAGS) takes it: a bool, or one of the precision's strings."""
    if path in BOOL_FLAGS:
        if not isinstance(value, bool):
            raise ConfigurationError(f"backend flag {path!r} takes true or false, got {value!r}")
        return value
    choices = PRECISION_FLAGS[path]
    if not isinstance(value, str) or value not in choices:
        raise ConfigurationError(f"backend flag {path!r} takes one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


__all__ = ["BACKEND_FLAGS", "BOOL_FLAGS", "PRECISION_FLAGS", "checked_flag_name", "checked_flag_value"]
