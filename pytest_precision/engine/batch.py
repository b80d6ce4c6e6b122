"""Normalise the `inputs` argument and derive what the metrics need from it (padding mask, shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    """Positional and keyword arguments of the model call, as the user gave them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def on(self, device: torch.device, float_dtype: torch.dtype | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A private copy of the arguments for one run: every tensor, at any depth of dicts, lists and tuples
        (namedtuples keep their type), copied once to `device`, floating ones cast to `float_dtype` (when
        given). A forward writing its inputs in place then changes neither the caller's tensors nor the next
        run's."""
        import torch

        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                # Detached, so the caller's tensor never receives a .grad; a new leaf that still requires
                # grad when the caller's did, so the first module's input gradient is still captured.
                wanted = float_dtype if value.is_floating_point() and float_dtype is not None else value.dtype
                moved = value.detach().to(device=device, dtype=wanted, copy=True)
                return moved.requires_grad_(value.requires_grad and moved.is_floating_point())
            if isinstance(value, tuple):
                items = [move(v) for v in value]
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
            if isinstance(value, list):
                return type(value)(move(v) for v in value)
            if isinstance(value, dict):
                return {k: move(v) for k, v in value.items()}
            return value

        return move(self.args), move(self.kwargs)

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """(batch, seq) bool: True where a position counts; from `attention_mask` and labels != -100."""
        import torch

        mask: torch.Tensor | None = None
        attention = self.kwargs.get("attention_mask")
        if isinstance(attention, torch.Tensor) and attention.dim() == 2:
            mask = attention.to(device) != 0
        labels = self.kwargs.get("labels")
        if isinstance(labels, torch.Tensor) and labels.dim() == 2 and not labels.is_floating_point():
            keep = labels.to(device) != IGNORE_INDEX
            mask = keep if mask is None else mask & keep
        return mask

    def shapes(self) -> dict[str, list[int]]:
        """Shapes of the tensor arguments, by keyword or `argN`."""
        import torch

        named = {f"arg{i}": v for i, v in enumerate(self.args)} | self.kwargs
        return {k: list(v.shape) for k, v in named.items() if isinstance(v, torch.Tensor)}

    def digest(self) -> str:
        """A SHA-256 of the top-level tensor arguments' names, shapes, dtypes and values (do two ranks hold the
        same inputs?)."""
        import hashlib

        import torch

        named = {f"arg{i}": v for i, v in enumerate(self.args)} | self.kwargs
        hasher = hashlib.sha256()
        for key in sorted(named):
            value = named[key]
            if isinstance(value, torch.Tensor):
                host = value.detach().cpu().contiguous()
                hasher.update(f"{key}{tuple(host.shape)}{host.dtype}".encode())
                hasher.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())
        return hasher.hexdigest()

    def token_count(self) -> int | None:
        """Tokens that count: the mask's sum, else the size of `input_ids` (or the first integer 2-D tensor)."""
        import torch

        mask = self.mask(torch.device("cpu"))
        if mask is not None:
            return int(mask.sum())
        candidates = [self.kwargs.get("input_ids"), *self.args]
        for value in candidates:
            if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
                return int(value.numel())
        return None


def to_batch(inputs: object) -> Batch:
    """A dict of keyword arguments, a tensor (or a namedtuple: one argument), or a tuple of positional arguments."""
    import torch

    if isinstance(inputs, dict):
        if not all(isinstance(k, str) for k in inputs):
            raise ConfigurationError("inputs: a dict of inputs needs string keys (keyword arguments of forward)")
        return Batch((), dict(inputs))
    if isinstance(inputs, torch.Tensor) or (isinstance(inputs, tuple) and hasattr(inputs, "_fields")):
        return Batch((inputs,), {})  # a namedtuple is one structured argument, not a tuple of arguments
    if isinstance(inputs, (tuple, list)):
        return Batch(tuple(inputs), {})
    raise ConfigurationError(
        f"inputs: expected a dict of keyword arguments, a tensor or a tuple of positional arguments, "
        f"got {type(inputs).__name__}"
    )


__all__ = ["Batch", "to_batch"]
