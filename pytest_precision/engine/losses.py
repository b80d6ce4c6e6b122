"""The loss a run differentiates, and fp16 loss scaling: the scale that keeps fp16 gradients in range."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.distributed import ranks as distributed
from pytest_precision.engine.capture import GRADIENT_KINDS

if TYPE_CHECKING:
    import torch


LossFn = Callable[[Any, Any], "torch.Tensor"]


def loss_of(output: Any, inputs: Any, loss_fn: LossFn | None, variant: str) -> torch.Tensor | None:
    import torch

    loss: Any
    if loss_fn is not None:
        loss = loss_fn(output, inputs)
    else:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        return None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigurationError(
            f"run {variant!r}: the loss must be a scalar tensor, got {shape}; reduce it in loss_fn (e.g. .mean())"
        )
    return loss.reshape(())


def fp16_loss_scale(max_gradient: float) -> float:
    """The largest power of two keeping fp16 gradients in range with 4x headroom for unlogged partial sums."""
    if max_gradient <= 0 or not math.isfinite(max_gradient):
        return 1.0
    return float(2 ** max(0, math.floor(math.log2(FP16_MAX / max_gradient / 4))))


FP16_MAX = 65504.0


class LargestGradient:
    """A sink keeping the largest finite |gradient| over the bw and grad tensors it sees, on their device
    (read once, at the end: no host sync per tensor)."""

    def __init__(self) -> None:
        self.largest: torch.Tensor | None = None

    def __call__(self, name: str, kind: str, tensor: torch.Tensor) -> None:
        import torch

        if kind not in GRADIENT_KINDS or not tensor.numel():
            return
        magnitude = tensor.detach().abs().nan_to_num(nan=0.0, posinf=0.0).amax().to(torch.float64)
        self.largest = magnitude if self.largest is None else torch.maximum(self.largest, magnitude)

    def value(self) -> float:
        """The largest |gradient| seen (over every rank under torch.distributed)."""
        largest = 0.0 if self.largest is None else float(self.largest)
        return max(distributed.exchange(largest)) if distributed.active() else largest


CALIBRATE = "calibrate"
LossScale = float | str | Mapping[str, float | str] | None


def loss_scale_for(loss_scale: LossScale, variant: str) -> float | str | None:
    """`variant`'s entry of `loss_scale`: a positive number, "calibrate", or None (from the reference)."""
    value = loss_scale.get(variant) if isinstance(loss_scale, Mapping) else loss_scale
    if value is None or value == CALIBRATE:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ConfigurationError(
            f"loss_scale for {variant!r} must be a positive number or {CALIBRATE!r}, got {value!r}"
        )
    return number
