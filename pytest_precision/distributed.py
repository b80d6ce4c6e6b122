"""Per-tensor sums reduced across the ranks of a torch.distributed process group.

The groundwork of sharded precision gates: when each rank holds a different part of a tensor (its shard of a
data-parallel batch, its shard of a DTensor), the exact pass's sums (`metrics.exact_sums`: counts, float64
sums, extremes) of the parts add up to those of the whole, so every rank can compute the metrics one process
would compute on the full tensor. Two collectives per pass, whatever the number of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .metrics import EXACT_SUMS

if TYPE_CHECKING:
    import torch

#: Positions in an exact_sums vector: summed over the parts, the largest kept, the smallest kept.
ADDITIVE = (0, 1, 2, 3, 4, 5, 7)  # n, sum x, sum d, sum x^2, sum d^2, sum x d, nonfinite
LARGEST = (6, 9, 11)  # max |d|, max x, max y
SMALLEST = (8, 10)  # min x, min y


def global_exact_sums(parts: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """The exact_sums vectors of whole tensors from this rank's vectors of its parts, identical on every rank of
    `group` (the default group when None): counts and sums added, extremes reduced, in two all_reduce calls.

    Each rank passes the same number of vectors, in the same order (one per tensor). Collectives run on the
    vectors' device; gloo reduces CPU tensors, nccl CUDA ones."""
    import torch
    import torch.distributed as dist

    if not parts:
        return []
    for index, vector in enumerate(parts):
        if vector.shape != (EXACT_SUMS,) or vector.dtype != torch.float64:
            raise ValueError(
                f"global_exact_sums: vector {index} is {tuple(vector.shape)} {vector.dtype}, expected an "
                f"exact_sums vector ({EXACT_SUMS} float64 values)"
            )
    stacked = torch.stack(list(parts))
    additive = stacked[:, ADDITIVE].contiguous()
    # One MAX reduction for both kinds of extreme: a minimum is the negated maximum of the negated values.
    extremes = torch.cat([stacked[:, LARGEST], stacked[:, SMALLEST].neg()], dim=1).contiguous()
    dist.all_reduce(additive, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    reduced = torch.empty_like(stacked)
    reduced[:, ADDITIVE] = additive
    reduced[:, LARGEST] = extremes[:, : len(LARGEST)]
    reduced[:, SMALLEST] = extremes[:, len(LARGEST) :].neg()
    return list(reduced.unbind(0))


__all__ = ["global_exact_sums"]
