"""Dtype names: the long name of a dtype given as torch.dtype or text ("bf16", "torch.bfloat16", ...), and the
callable type of a model factory. Shared by every layer that names a dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pytest_precision.base.errors import ConfigurationError

if TYPE_CHECKING:
    import torch
    from torch import nn

DTypeName = Literal["float64", "float32", "bfloat16", "float16"]

_DTYPE_ALIASES: dict[str, DTypeName] = {
    "fp64": "float64",
    "float64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}


def dtype_name(dtype: object) -> DTypeName:
    """Normalise a dtype given as torch.dtype or string ("bf16", "torch.bfloat16", ...) to its long name."""
    text = str(dtype).removeprefix("torch.")
    try:
        return _DTYPE_ALIASES[text]
    except KeyError:
        raise ConfigurationError(
            f"unsupported dtype {dtype!r}: use one of float64, float32, bfloat16, float16"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch.dtype for a dtype name."""
    import torch

    return getattr(torch, dtype_name(name))  # type: ignore[no-any-return]


#: A model factory: `(dtype, device) -> nn.Module`, building the model in that dtype on that device.
ModelFactory = Callable[["torch.dtype", "torch.device"], "nn.Module"]
