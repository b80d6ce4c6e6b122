"""Routing agreement of a mixture-of-experts router against the reference's, per token, from the routing tensors
(tokens, 2k + 1) of pytest_precision.engine.routers: k expert indices, k weights, the reference's margin.

Per router (one "routing" row):
- expert_agreement: the share of tokens whose top-k expert set equals the reference's;
- top1_changed: the share whose first choice (the expert of largest weight) changed;
- experts_changed: the mean number of the reference's k experts the variant did not choose, per token;
- load_shift: the total variation distance between the two runs' per-expert shares of the token-expert assignments;
- flip_margin_median, flip_margin_max: the reference's margin (k-th chosen score minus the best unchosen one) over the
  tokens whose set changed: small margins say flips are near-ties; undefined without flips or scores;
- margin_median: the reference's margin over all tokens (descriptive, never gated);
- the usual error metrics (rms_rel, max_abs, ...) of the routing weights on the tokens whose set agrees, each weight
  against the reference's weight of the same expert; `nonfinite` counts the variant's NaN/Inf weights on every token.
Computed on the device in float64 and copied to the host with the run's other statistics (no extra sync, but for a
router of unknown expert count: one, to size the load counts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_precision.base.records import TensorError
from pytest_precision.numbers.metrics import exact_error, exact_sums

if TYPE_CHECKING:
    import torch

#: The per-router statistics vector of routing_sums, in order.
ROUTING_SUMS = (
    "tokens",
    "same",
    "top1_changed",
    "experts_changed",
    "load_shift",
    "flip_median",
    "flip_max",
    "margin_median",
)


@dataclass(frozen=True)
class RoutingStats:
    """The routing metrics of one router (see the module doc); None where undefined."""

    expert_agreement: float | None
    top1_changed: float | None
    experts_changed: float | None
    load_shift: float | None
    flip_margin_median: float | None
    flip_margin_max: float | None
    margin_median: float | None


def top_k(values: torch.Tensor) -> int:
    """k of a routing tensor (..., 2k + 1)."""
    return (int(values.shape[-1]) - 1) // 2


def routing_sums(
    reference: torch.Tensor, variant: torch.Tensor, experts: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device, for routing tensors (tokens, 2k + 1) of one router: the ROUTING_SUMS vector, the exact_sums of
    the weights on agreeing tokens, and per token the reference's margin where the set changed (NaN elsewhere)."""
    import torch

    k = top_k(reference)
    device = reference.device
    variant = variant.to(device=device, dtype=torch.float64)
    reference = reference.to(torch.float64)
    tokens = reference.shape[0]
    ref_experts, var_experts = reference[:, :k].to(torch.int64), variant[:, :k].to(torch.int64)
    ref_weights, var_weights = reference[:, k : 2 * k], variant[:, k : 2 * k]
    margins = reference[:, 2 * k]
    ref_sorted, ref_order = ref_experts.sort(dim=-1)
    var_sorted, var_order = var_experts.sort(dim=-1)
    same = (ref_sorted == var_sorted).all(dim=-1)
    # Weights aligned by expert (both sets sorted): compared only where the sets agree, NaN leaves the others out.
    aligned_reference = torch.where(same[:, None], ref_weights.gather(1, ref_order), math.nan)
    weight_sums = exact_sums(aligned_reference, var_weights.gather(1, var_order))
    # NaN/Inf weights count on every token, flipped or not: a router gone non-finite flips its tokens too.
    weight_sums[7] = (~torch.isfinite(var_weights)).sum(dtype=torch.float64)
    flip_margins = torch.where(same, math.nan, margins)
    if tokens == 0:
        nan = torch.full((len(ROUTING_SUMS) - 1,), math.nan, dtype=torch.float64, device=device)
        return torch.cat([torch.zeros(1, dtype=torch.float64, device=device), nan]), weight_sums, flip_margins
    kept = (ref_experts[:, :, None] == var_experts[:, None, :]).any(dim=-1).sum(dim=-1)
    first = ref_experts.gather(1, ref_weights.argmax(dim=-1, keepdim=True))
    first_variant = var_experts.gather(1, var_weights.argmax(dim=-1, keepdim=True))
    if experts is None:  # a router of unknown size: one host sync to size the counts
        experts = int(torch.maximum(ref_experts.max(), var_experts.max())) + 1
    ones = torch.ones(tokens * k, dtype=torch.float64, device=device)
    ref_load = torch.zeros(experts, dtype=torch.float64, device=device).index_add_(0, ref_experts.reshape(-1), ones)
    var_load = torch.zeros(experts, dtype=torch.float64, device=device).index_add_(0, var_experts.reshape(-1), ones)
    load_shift = 0.5 * (ref_load - var_load).abs().sum() / (tokens * k)
    flip_max = torch.where(torch.isnan(flip_margins), -math.inf, flip_margins).max()
    stats = torch.stack(
        [
            torch.tensor(float(tokens), dtype=torch.float64, device=device),
            same.sum(dtype=torch.float64),
            (first != first_variant).sum(dtype=torch.float64),
            (k - kept).sum(dtype=torch.float64),
            load_shift,
            nan_median(flip_margins),
            flip_max,
            nan_median(margins),
        ]
    )
    return stats, weight_sums, flip_margins


def nan_median(values: torch.Tensor) -> torch.Tensor:
    """The median of the non-NaN values of a 1-D float64 tensor, the mean of the two middle ones for an even count
    (as NumPy's); NaN when every value is NaN. On the device, without a host sync (torch.nanmedian takes the lower
    middle value)."""
    import torch

    missing = torch.isnan(values)
    count = (~missing).sum()
    ordered = torch.where(missing, math.inf, values).sort().values
    low = ((count - 1).clamp(min=0) // 2).reshape(1)
    high = (count // 2).clamp(max=max(values.numel() - 1, 0)).reshape(1)
    middle = (ordered.gather(0, low) + ordered.gather(0, high)).reshape(()) / 2
    return torch.where(count > 0, middle, math.nan)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def routing_from_sums(stats: Sequence[float], weight_sums: Sequence[float]) -> tuple[TensorError, RoutingStats]:
    """The weights' TensorError and the RoutingStats from host copies of routing_sums' first two results."""
    tokens, same, first, changed, load_shift, flip_median, flip_max, margin_median = stats
    return exact_error(weight_sums), RoutingStats(
        expert_agreement=same / tokens if tokens else None,
        top1_changed=first / tokens if tokens else None,
        experts_changed=changed / tokens if tokens else None,
        load_shift=_finite_or_none(load_shift),
        flip_margin_median=_finite_or_none(flip_median),
        flip_margin_max=_finite_or_none(flip_max),
        margin_median=_finite_or_none(margin_median),
    )


def routing_mismatch(
    runs: Mapping[str, Mapping[str, torch.Tensor]],
    reference: Mapping[str, torch.Tensor],
    index: torch.Tensor | None,
    trainer: object,
    sampler: object = None,
) -> dict[str, float]:
    """Per router label, the set_disagreement of run `trainer` against run `sampler` (None: the `reference`), from
    `runs` (variant name -> router label -> routing tensor). A name that is not a run's, or a router that one of the
    two runs called and the other did not, is a ConfigurationError naming it: a router left out would read as one
    that agrees."""
    from pytest_precision.base.errors import ConfigurationError

    known = ", ".join(runs) or "none"
    for argument, name in (("trainer", trainer), ("sampler", sampler)):
        if (name is not None or argument == "trainer") and (not isinstance(name, str) or name not in runs):
            raise ConfigurationError(
                f"routing_mismatch: no routing of variant {name!r} (the {argument}) in this report; variants with "
                f"routing: {known} (compare() keeps it in memory for models with routers, not in files)"
            )
    assert isinstance(trainer, str)
    first, second = runs[trainer], reference if sampler is None else runs[str(sampler)]
    names = (trainer, "the reference" if sampler is None else str(sampler))
    for label in sorted(set(first) ^ set(second)):
        routed, unrouted = names if label in first else names[::-1]
        raise ConfigurationError(
            f"routing_mismatch: router {label!r} routed no token in run {unrouted!r} (never called there), but did in "
            f"run {routed!r}; the two runs must call the same routers"
        )
    return {label: set_disagreement(first[label], second[label], index) for label in first}


def set_disagreement(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor | None) -> float:
    """The share of tokens whose top-k expert sets differ between two routing tensors (rows, positions, 2k + 1) of
    one router, over the flat positions `index` (None: all); one host sync."""
    import torch

    k = top_k(a)
    first, second = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]).to(a.device)
    if index is not None and first.shape[0] == second.shape[0] and int(index.numel()) <= first.shape[0]:
        first, second = first.index_select(0, index.to(a.device)), second.index_select(0, index.to(a.device))
    if not first.shape[0]:
        return math.nan
    differ = (first[:, :k].sort(dim=-1).values != second[:, :k].sort(dim=-1).values).any(dim=-1)
    return float(differ.to(torch.float64).mean())
