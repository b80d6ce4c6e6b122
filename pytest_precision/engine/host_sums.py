"""A captured tensor's statistics waiting on the device, and their host copy: a run copies all of them to the
host at once, its one device-to-host transfer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pytest_precision.numbers.metrics import to_host

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class PendingSums:
    """One measured tensor whose statistics are still on the device."""

    name: str
    kind: str
    shape: tuple[int, ...]
    count: int
    reference: torch.Tensor | None  # reference_sums (fast pass), None for the exact pass
    values: torch.Tensor  # error_sums or exact_sums
    log_ratio: torch.Tensor | None = None
    range_values: torch.Tensor | None = None  # range_sums (compare(range_stats=True))
    range_host: list[float] | None = None  # their host copy, once resolved


#: A PendingSums's statistics on the host: (item, reference_sums or None, error_sums or exact_sums, log_ratio_sums).
HostSums = tuple[PendingSums, list[float] | None, list[float], list[float] | None]


def resolve_pending(values: Sequence[torch.Tensor]) -> list[list[float]]:
    """The device-side statistics of a whole pass on the host: its one device-to-host transfer."""
    return to_host(values)
