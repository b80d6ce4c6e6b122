"""Sharded models (FSDP2, tensor parallel, both) and the per-rank parts of their tensors.

Under torch.distributed each rank captures its part of every tensor: its rows of a data-parallel batch, its
shard of a DTensor (parameter gradients, tensor-parallel activations). The exact pass's sums of the parts
(metrics.exact_sums) add up to those of the whole tensor, so every rank computes what one process would on the
full tensors. What counts:
- a DTensor's local shard, once: along a mesh dimension where it is Replicate only the rank at coordinate 0
  counts it; a Partial one is reduced first;
- a plain tensor (an FSDP activation, a tensor-parallel module's local output) on every rank, except that a
  rank whose sums are bit-for-bit those of a lower rank holds the same data (a row-parallel output,
  replicated over its tensor-parallel group; the same batch on two data-parallel ranks) and counts once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.torch_version import torch_version, version_text
from pytest_precision.numbers.metrics import EXACT_SUMS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pytest_precision.base.dtypes import ModelFactory

#: `shard(model, variant) -> model | None`; the second argument is the run's pytest_precision.Variant (typed Any:
#: this layer sits below the engine that defines it, and a shard function annotated with Variant must fit).
ShardFunction = Callable[["nn.Module", Any], "nn.Module | None"]


class PolicyHolder(Protocol):
    """What the policy check reads of a run's Variant."""

    @property
    def name(self) -> str: ...

    @property
    def fsdp_knobs(self) -> bool: ...

    def fsdp_description(self) -> str: ...

    def mp_policy(self) -> Any: ...


@dataclass(frozen=True)
class ShardedModel:
    """A model and how each run shards it: `shard(model, variant)` gets the run's model (a copy of `model`, or
    a factory's product, already cast for the variant like any run's) and applies `fully_shard`,
    `parallelize_module` or both, with `variant.mp_policy()` for FSDP2's mixed precision; it returns the
    model (or None: sharded in place). The fp32 reference is sharded by the same function."""

    model: nn.Module | ModelFactory
    shard: ShardFunction


def sharded(model: nn.Module | ModelFactory, shard: ShardFunction) -> ShardedModel:
    """The model for compare/precision.run under torch.distributed: `shard(model, variant)` shards each run's
    copy (see ShardedModel)."""
    from torch import nn

    if not isinstance(model, nn.Module) and not callable(model):
        raise ConfigurationError(
            f"sharded(model, shard): model must be a torch.nn.Module or a factory (dtype, device) -> nn.Module, "
            f"got {type(model).__name__}"
        )
    if not callable(shard):
        raise ConfigurationError(
            f"sharded(model, shard): shard must be a callable (model, variant) -> model, got {type(shard).__name__}"
        )
    return ShardedModel(model, shard)


def is_dtensor(tensor: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)


@dataclass(frozen=True)
class Part:
    """How one rank's part of a tensor counts: `owned` True/False for a DTensor shard (False: a replica another
    rank counts), None for a plain tensor (deduplicated by its sums); `shape` the whole tensor's for a DTensor,
    the local one otherwise."""

    owned: bool | None
    shape: tuple[int, ...]


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, Part]:
    """This rank's part of `tensor` as a plain tensor, and how it counts (see Part)."""
    if not is_dtensor(tensor):
        return tensor, Part(None, tuple(tensor.shape))
    from torch.distributed.tensor import Replicate

    dtensor: Any = tensor
    placements = list(dtensor.placements)
    if any(p.is_partial() for p in placements):
        replicated = [Replicate() if p.is_partial() else p for p in placements]
        dtensor = dtensor.redistribute(dtensor.device_mesh, replicated)
    coordinate = dtensor.device_mesh.get_coordinate()
    owned = coordinate is not None and all(
        c == 0 for c, p in zip(coordinate, dtensor.placements, strict=True) if p.is_replicate()
    )
    return dtensor.to_local(), Part(bool(owned), tuple(dtensor.shape))


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (differentiably); any other tensor as is."""
    if is_dtensor(tensor):
        return tensor.full_tensor()  # type: ignore[attr-defined,no-any-return]
    return tensor


def _identity(values: Sequence[float]) -> tuple[str, ...]:
    return tuple(float(v).hex() for v in values)


def counted(parts: Sequence[tuple[Sequence[float], Part]]) -> list[int]:
    """Indices (ranks) of the parts that count (see the module's docstring)."""
    chosen: list[int] = []
    seen: set[tuple[str, ...]] = set()
    for index, (values, part) in enumerate(parts):
        if part.owned is False:
            continue
        if part.owned is None:
            key = _identity(values)
            if key in seen:
                continue
            seen.add(key)
        chosen.append(index)
    return chosen


def combine_exact_sums(vectors: Sequence[Sequence[float]]) -> list[float]:
    """The exact_sums vector of a whole tensor from those of its parts (in order: the sums are added in the same
    order on every rank, so every rank gets the same bits)."""
    total = [0.0] * 8 + [math.inf, -math.inf, math.inf, -math.inf]
    for values in vectors:
        if len(values) != EXACT_SUMS:
            raise ValueError(f"combine_exact_sums: {len(values)} values, expected {EXACT_SUMS}")
        for index in (0, 1, 2, 3, 4, 5, 7):
            total[index] += values[index]
        for index in (6, 9, 11):
            total[index] = largest(total[index], values[index])
        for index in (8, 10):
            total[index] = -largest(-total[index], -values[index])
    return total


def combined_shape(parts: Sequence[Part], *, rows_split: bool) -> tuple[int, ...]:
    """The whole tensor's shape: a DTensor's own; for plain parts of data-parallel ranks (`rows_split`), their
    rows added; else (ranks given the same inputs: tensor-parallel shards) the first part's, whose count alone
    covers the whole tensor."""
    first = parts[0]
    if first.owned is not None or len(parts) == 1 or not rows_split:
        return first.shape
    shapes = [p.shape for p in parts]
    if all(len(s) == len(first.shape) >= 1 and s[1:] == first.shape[1:] for s in shapes):
        return (sum(s[0] for s in shapes), *first.shape[1:])
    return first.shape


def largest(a: float, b: float) -> float:
    """max(a, b), NaN when either is (as torch's max over a tensor holding NaN)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def add_vectors(vectors: Sequence[Sequence[float]], maximum: Sequence[int] = ()) -> list[float]:
    """Element-wise sums of equal-length vectors, except the positions in `maximum`, which keep the largest."""
    total = list(vectors[0])
    for values in vectors[1:]:
        for index, value in enumerate(values):
            total[index] = largest(total[index], value) if index in maximum else total[index] + value
    return total


def mesh_of(model: nn.Module) -> dict[str, Any]:
    """The world size and the device mesh of the model's first DTensor parameter (None when it has none)."""
    from pytest_precision.distributed import ranks as distributed

    mesh: Any = None
    names: Any = None
    for parameter in model.parameters():
        if is_dtensor(parameter):
            device_mesh = parameter.device_mesh  # type: ignore[attr-defined]
            mesh = list(device_mesh.shape)
            names = list(device_mesh.mesh_dim_names) if device_mesh.mesh_dim_names else None
            break
    return {"world_size": distributed.world_size(), "mesh": mesh, "mesh_dims": names}


#: The first torch whose FSDP2 runs on the CPU (torch 2.6's FSDP2 calls `torch.cpu.Stream.record_event`, which
#: only 2.7 has).
FSDP_ON_CPU_SINCE = (2, 7)


def check_fsdp_device(sharded_modules: Sequence[nn.Module], device_type: str) -> None:
    """Refuse FSDP2 on the CPU where this torch cannot run it, naming the version, before a rank crashes."""
    import torch

    if sharded_modules and device_type == "cpu" and torch_version() < FSDP_ON_CPU_SINCE:
        since = version_text(FSDP_ON_CPU_SINCE)
        raise ConfigurationError(
            f"FSDP2 (fully_shard) runs on the CPU from torch {since}; this is torch {torch.__version__}. Run "
            f"sharded models on CUDA devices, or install torch >= {since} for CPU runs (gloo)"
        )


def check_policy(model: nn.Module, variant: PolicyHolder, device_type: str = "cpu") -> None:
    """Every fully_shard of the run's model used `variant.mp_policy()`: a shard function ignoring it would
    measure the fp32 reference against itself (or a bf16 "reference"); a variant with FSDP2 knobs needs one."""
    from torch.distributed.fsdp import FSDPModule

    wanted = variant.mp_policy()
    sharded_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if variant.fsdp_knobs and not sharded_modules:
        raise ConfigurationError(
            f"variant {variant.name!r} sets FSDP2 mixed precision ({variant.fsdp_description()}) but the shard "
            "function applied no fully_shard: call fully_shard(module, mp_policy=variant.mp_policy()) in it"
        )
    check_fsdp_device(sharded_modules, device_type)
    for module in sharded_modules:
        # FSDP2 keeps the policy in private state; where a torch version lacks it the check is skipped.
        get_state = getattr(module, "_get_fsdp_state", None)
        policy = getattr(get_state(), "_mp_policy", None) if callable(get_state) else None
        if policy is not None and policy != wanted:
            raise ConfigurationError(
                f"run {variant.name!r}: fully_shard got mp_policy={policy}, the run asks for {wanted}; pass "
                "mp_policy=variant.mp_policy() to every fully_shard call of the shard function (the fp32 "
                "reference's is MixedPrecisionPolicy(): no casting)"
            )


__all__ = ["ShardedModel", "sharded"]
