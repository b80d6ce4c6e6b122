"""Isolation of a run from the caller's process state: RNG streams, the seed, and ambient autocast, grad and
inference modes (each run sets its own; see ambient_modes_off)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


#: Seed set before every run, on every device, so randomness cannot masquerade as precision error.
RUN_SEED = 0


def default_device(model: object) -> torch.device:
    """The device of the model's first parameter, or the CPU for a factory."""
    import torch
    from torch import nn

    if isinstance(model, nn.Module):
        for parameter in model.parameters():
            return parameter.device
    return torch.device("cpu")


def comparison_device(model: object, device: str | torch.device | None) -> torch.device:
    """Where a comparison runs: `device` when given, else default_device of the model (a sharded model's own)."""
    import torch

    from pytest_precision.distributed.sharding import ShardedModel

    if device is not None:
        return torch.device(device)
    return default_device(model.model if isinstance(model, ShardedModel) else model)


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore torch's (CPU and the run's device), Python's and NumPy's global RNG state on exit."""
    import numpy as np
    import torch

    python_state = random.getstate()
    numpy_state = np.random.get_state()
    devices = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@contextlib.contextmanager
def ambient_modes_off(device: torch.device) -> Iterator[None]:
    """Run as outside any mode the caller set: no autocast (on the CPU, CUDA and the run's device), no
    inference mode, grad mode on (each run then sets its own). A call made inside the caller's
    torch.autocast, no_grad or inference_mode gives the same tensors as one made outside."""
    import torch

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for device_type in dict.fromkeys(("cpu", "cuda", device.type)):
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield


def seed_run(device: torch.device) -> None:
    """Seed the CPU generator and the run's own device only: torch.manual_seed would also reseed every
    CUDA device (or queue that until CUDA starts), which preserved_rng does not restore."""
    import torch

    torch.default_generator.manual_seed(RUN_SEED)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(RUN_SEED)
