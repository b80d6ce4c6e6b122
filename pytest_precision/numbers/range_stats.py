"""Range statistics: how much of a reference tensor a variant's dtype would lose to underflow (below its
smallest normal, or flushed to zero) or overflow, its largest magnitude and dynamic range (compare(range_stats=True)).

Like the error metrics, sums on the device (`range_sums`), one host copy, then `range_from_sums`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from pytest_precision.numbers.metrics import chunk_elements, combined_chunks, flattened, ratio_or_none, to_host


@dataclass(frozen=True)
class RangeStats:
    """How a reference tensor's finite values fit in a variant's dtype (compare(range_stats=True)).

    The magnitudes counted are |x| * scale: a loss-scaled variant holds its gradients `scale` times larger, so
    its bw and grad rows are counted at that scale (a larger scale moves small gradients out of underflow).
    Each threshold is where rounding to nearest (ties to even) in `dtype` changes the outcome, so a fraction
    counts exactly the elements that a cast of x * scale to `dtype` turns into a subnormal, zero or inf.
    underflow_frac: fraction of the non-zero elements that become subnormal OR zero (both counted: each lost
        significant bits): scaled magnitude below tiny - s / 2, where tiny = finfo(dtype).tiny is the
        smallest normal and s = tiny * eps the smallest subnormal (values in [tiny - s/2, tiny) round up to
        tiny); None when no element is non-zero.
    zero_frac: the part of those that become exactly zero (flushed): scaled magnitude at most s / 2 (the tie
        rounds to even, zero); zero_frac <= underflow_frac; None when no element is non-zero.
    overflow_frac: fraction of the finite elements that become inf: scaled magnitude at least
        max + ulp(max) / 2 (65520 in fp16, max 65504: values in between round down to max); None when no
        element is finite.
    ref_absmax: the largest |x| (not scaled); None when no element is finite.
    dynamic_range_log2: log2(ref_absmax / smallest non-zero |x|); None when no element is non-zero.
    """

    underflow_frac: float | None
    zero_frac: float | None
    overflow_frac: float | None
    ref_absmax: float | None
    dynamic_range_log2: float | None


RANGE_METRICS: tuple[str, ...] = tuple(f.name for f in fields(RangeStats))
#: Values of `range_sums`: finite count, non-zero count, underflow count, zero count, overflow count, smallest
#: non-zero |x|, largest |x| (over the finite elements).
RANGE_SUMS = 7


def range_thresholds(dtype: torch.dtype, scale: float = 1.0) -> tuple[float, float, float]:
    """The magnitudes of x at which x * scale, rounded to `dtype`, becomes subnormal or zero (below the first),
    exactly zero (at most the second) or inf (at least the third): tiny - s/2, s/2 and max + ulp(max)/2, with
    s = tiny * eps the smallest subnormal, each divided by `scale`."""
    import torch

    info = torch.finfo(dtype)
    half_subnormal = info.tiny * info.eps / 2  # powers of two: exact (0 for float64, whose half underflows)
    try:
        overflow = math.ldexp(2.0 - info.eps / 2, math.frexp(info.max)[1] - 1)
    except OverflowError:  # float64: max + ulp / 2 is past every float64
        overflow = math.inf
    return (info.tiny - half_subnormal) / scale, half_subnormal / scale, overflow / scale


_FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def _float32_toward(value: float, *, up: bool) -> float:
    """The smallest float32 >= `value` (`up`) or the largest float32 <= it, for `value` >= 0: a float32
    magnitude a compares with it as with `value` itself (a < value iff a < up; a <= value iff a <= down)."""
    if value > _FLOAT32_MAX:
        return math.inf if up else _FLOAT32_MAX
    nearest: float = struct.unpack("<f", struct.pack("<f", value))[0]
    step = 0
    if up and nearest < value:
        step = 1
    elif not up and nearest > value:
        step = -1
    if step:
        bits: int = struct.unpack("<I", struct.pack("<f", nearest))[0]
        nearest = struct.unpack("<f", struct.pack("<I", bits + step))[0]
    return nearest


def range_sums(reference: torch.Tensor, dtype: torch.dtype, *, scale: float = 1.0) -> torch.Tensor:
    """RANGE_SUMS of `reference` held in `dtype` at `scale`, on its device in chunks (no host sync).

    The comparisons run in float32 (float64 for a float64 reference) against thresholds rounded outward to
    float32, which compare every float32 magnitude exactly as the real thresholds do."""
    import torch

    x_all = flattened(reference)
    if not x_all.numel():
        return x_all.new_tensor([0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64)
    tiny, half, overflow = range_thresholds(dtype, scale)
    wide = x_all.dtype == torch.float64
    if not wide:
        tiny, half, overflow = (
            _float32_toward(tiny, up=True),
            _float32_toward(half, up=False),
            _float32_toward(overflow, up=True),
        )
    step = chunk_elements(x_all.device)
    chunks = []
    for start in range(0, x_all.numel(), step):
        x = x_all[start : start + step]
        # |x|, with NaN and Inf as -1: below every threshold's count of positive values, and never a maximum.
        magnitude = (x if wide else x.to(torch.float32)).abs().nan_to_num_(nan=-1.0, posinf=-1.0)
        # Whole-chunk counts (count_nonzero takes a fraction of a float64 sum's time); the zeros and the
        # non-finite, counted below every threshold, are taken off by difference.
        nonfinite, zeros, below_tiny, at_most_half, overflowing = (
            torch.stack(
                [
                    torch.count_nonzero(magnitude < 0),
                    torch.count_nonzero(magnitude == 0),
                    torch.count_nonzero(magnitude < tiny),
                    torch.count_nonzero(magnitude <= half),
                    torch.count_nonzero(magnitude >= overflow),
                ]
            )
            .to(torch.float64)
            .unbind()
        )
        finite = x.numel() - nonfinite
        chunks.append(
            torch.stack(
                [
                    finite,
                    finite - zeros,
                    below_tiny - zeros - nonfinite,
                    at_most_half - zeros - nonfinite,
                    overflowing,
                    torch.where(magnitude > 0, magnitude, math.inf).amin().to(torch.float64),
                    magnitude.amax().to(torch.float64),  # -1 when no element is finite
                ]
            )
        )
    return combined_chunks(chunks, 5)


def combine_range_sums(vectors: Sequence[Sequence[float]]) -> list[float]:
    """The range_sums of a whole tensor from those of its parts (each a host list of RANGE_SUMS values)."""
    total = [0.0] * 5 + [math.inf, -math.inf]
    for values in vectors:
        if len(values) != RANGE_SUMS:
            raise ValueError(f"combine_range_sums: {len(values)} values, expected {RANGE_SUMS}")
        for index in range(5):
            total[index] += values[index]
        total[5] = min(total[5], values[5])
        total[6] = max(total[6], values[6])
    return total


def range_from_sums(values: Sequence[float]) -> RangeStats:
    """The RangeStats from a host copy of range_sums."""
    finite, nonzero, underflow, zero, overflow, smallest, largest = values
    return RangeStats(
        underflow_frac=ratio_or_none(underflow, nonzero),
        zero_frac=ratio_or_none(zero, nonzero),
        overflow_frac=ratio_or_none(overflow, finite),
        ref_absmax=largest if finite else None,
        dynamic_range_log2=math.log2(largest / smallest) if nonzero else None,
    )


def range_stats(reference: torch.Tensor, dtype: torch.dtype | str, *, scale: float = 1.0) -> RangeStats:
    """RangeStats of `reference` held in `dtype` (a torch.dtype or a name like "fp16") at loss scale `scale`
    (> 0), in one host sync."""
    from pytest_precision.base.dtypes import torch_dtype

    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"range_stats: scale must be a finite positive number, got {scale!r}")
    chosen = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    [values] = to_host([range_sums(reference, chosen, scale=float(scale))])
    return range_from_sums(values)
