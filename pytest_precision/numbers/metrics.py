"""Per-tensor error metrics of a variant tensor `y` against a reference tensor `x` (range statistics of `x` in a
variant's dtype are in range_stats).

Two ways to the same sums, both kept on the tensors' device until one host transfer for a whole run:

- the fast pass (`reference_sums` once per reference tensor, `error_sums` per variant tensor): float32 work in
  chunks, each chunk's sums accumulated in float64. The sums are taken over `d = y - x` (exact in float32 for
  y near x) and over `x - m`, m the reference's float32 mean, so that no statistic is lost to cancellation
  (var_y - cov^2/var_x for y ~ x cancels to ~1e-8 of the signal; var_d does not). It assumes every value is
  finite: a NaN/Inf shows in the sums as NaN/Inf, and the caller then runs the exact pass;
- the exact pass (`exact_sums`): float64 throughout, NaN/Inf masked out element by element and counted.

What each statistic needs: counts and extremes (min/max, for max|d| and for telling a constant side) need no
float64 at all; the sums of d, d*d, x*d and (x-m)^2 are float32 dot products and sums over a chunk, exact to
~1e-7 of their value, added up across chunks in float64. Identical tensors give d = 0 and so exactly 0 error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from pytest_precision.base.records import (
    TensorError,
)

# Elements per chunk of the fused float64 passes. On the CPU a chunk's temporaries (2 MiB each) stay in cache
# and below malloc's mmap threshold, so no chunk pays page faults: 4.8 ms for 2M elements against 23 ms with
# 4M-element chunks. On an accelerator larger chunks amortise kernel launches and the per-chunk sync (32 MiB).
CPU_CHUNK_ELEMENTS = 1 << 18
DEVICE_CHUNK_ELEMENTS = 1 << 22


def chunk_elements(device: torch.device) -> int:
    """Elements per chunk of a float64 pass on `device`."""
    return CPU_CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS


def ratio_or_none(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, None when the denominator is zero (the only guard: no fixed epsilon)."""
    return None if denominator == 0 else numerator / denominator


def metrics_from_sums(
    n: int,
    sx: float,
    sd: float,
    sxx: float,
    sdd: float,
    sxd: float,
    max_abs: float,
    nonfinite: int,
    *,
    x_constant: bool = False,
    y_constant: bool = False,
    shift: float = 0.0,
    sxx_whole: float | None = None,
) -> TensorError:
    """Build every metric from the fused sums over x and d = y - x (n elements, all finite).

    `shift`: sx, sxx and sxd are sums over x - shift rather than x (the fast pass shifts by the reference's
    mean, so that var_x does not cancel); `sxx_whole`: sum x^2 itself, when known (else derived from the
    shifted sums). `x_constant` / `y_constant` say a side holds one value: its variance
    is then exactly zero, which sxx/n - mean^2 does not give for constants like 0.1 that binary floating point
    cannot hold.
    """
    if n == 0:
        return TensorError(0, None, None, None, None, None, None, None, None, None, None, None, None, nonfinite)
    bias_abs = sd / n
    mean_shifted = sx / n
    var_x = 0.0 if x_constant else max(sxx / n - mean_shifted * mean_shifted, 0.0)
    var_d = max(sdd / n - bias_abs * bias_abs, 0.0)
    cov_xd = sxd / n - mean_shifted * bias_abs
    # Sums over x itself: sum x^2 = sum (x - s)^2 + 2 s sum (x - s) + n s^2, sum x d = sum (x - s) d + s sum d.
    if sxx_whole is None:
        sxx_whole = sxx if shift == 0 else max(sxx + 2.0 * shift * sx + n * shift * shift, 0.0)
    sxd_whole = sxd if shift == 0 else sxd + shift * sd
    ref_rms = math.sqrt(sxx_whole / n)
    rms_abs = math.sqrt(sdd / n)
    cov_xy = var_x + cov_xd
    var_y = 0.0 if y_constant else max(var_x + 2.0 * cov_xd + var_d, 0.0)
    syy = sxx_whole + 2.0 * sxd_whole + sdd
    slope = None if var_x == 0 else 1.0 + cov_xd / var_x
    # var_y - cov_xy^2 / var_x, rewritten in terms of d so that it does not cancel.
    residual_var = None if var_x == 0 else max(var_d - cov_xd * cov_xd / var_x, 0.0)
    correlation = None if var_x == 0 or var_y == 0 else cov_xy / math.sqrt(var_x * var_y)
    if correlation is not None:
        correlation = min(max(correlation, -1.0), 1.0)
    cosine = None if sxx_whole == 0 or syy <= 0 else (sxx_whole + sxd_whole) / math.sqrt(sxx_whole * syy)
    if cosine is not None:
        cosine = min(max(cosine, -1.0), 1.0)
    if sdd == 0:
        sqnr_db: float | None = math.inf
    elif sxx_whole == 0:
        sqnr_db = -math.inf
    else:
        sqnr_db = 10.0 * math.log10(sxx_whole / sdd)
    return TensorError(
        count=n,
        ref_rms=ref_rms,
        rms_abs=rms_abs,
        rms_rel=ratio_or_none(rms_abs, ref_rms),
        max_abs=max_abs,
        max_rel=ratio_or_none(max_abs, ref_rms),
        bias_abs=bias_abs,
        bias_rel=ratio_or_none(bias_abs, ref_rms),
        correlation=correlation,
        slope=slope,
        residual_rms_rel=None if residual_var is None else ratio_or_none(math.sqrt(residual_var), ref_rms),
        cosine=cosine,
        sqnr_db=sqnr_db,
        nonfinite=nonfinite,
    )


#: Values of `reference_sums`: the shift m (the reference's float32 mean), the scale k (a power of two bringing
#: max |x| near 1, so that no square underflows or overflows float32), sum (x - m) k, sum ((x - m) k)^2,
#: sum (x k)^2, min x, max x.
REFERENCE_SUMS = 7
#: Values of `error_sums`, with dk = (y - x) k: sum dk, sum dk^2, sum (x - m) dk, min dk, max dk, min y, max y.
ERROR_SUMS = 7
#: Values of `exact_sums`: n, sum x, sum d, sum x^2, sum d^2, sum x d, max |d|, nonfinite, min x, max x, min y,
#: max y (over the elements finite on both sides).
EXACT_SUMS = 12
#: The scale's exponent is clamped to +-MAGNITUDE_LIMIT (2^127 is the largest float32 power of two); any
#: float32 reference, subnormal ones included, then scales to max |x k| in [2^-23, 2].
MAGNITUDE_LIMIT = 126


def flattened(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1)


def combined_chunks(chunks: list[torch.Tensor], additive: int) -> torch.Tensor:
    """Per-chunk float64 values as one vector: the first `additive` summed over the chunks, then
    (min, max) pairs, the smallest min and the largest max."""
    import torch

    if len(chunks) == 1:
        return chunks[0]
    stacked = torch.stack(chunks)
    extremes = stacked[:, additive:]
    pairs = torch.stack([extremes[:, 0::2].amin(0), extremes[:, 1::2].amax(0)], dim=1).reshape(-1)
    return torch.cat([stacked[:, :additive].sum(0), pairs])


#: Elements per block of a float32 partial sum: sums of up to this many float32 values, added up in float64.
#: torch.dot over a whole chunk is as fast but loses ~1e-6 of a sum of 2^18 squares; blocks of 64 keep ~1e-9.
BLOCK = 64


def _sum(values: torch.Tensor) -> torch.Tensor:
    """The float64 sum of a float32 vector: float32 partial sums over blocks of BLOCK, added up in float64."""
    import torch

    if values.numel() % BLOCK == 0 and values.numel() > BLOCK:
        return values.view(-1, BLOCK).sum(1).sum(dtype=torch.float64)
    return values.sum(dtype=torch.float64)


def fast_pass_applies(reference: torch.Tensor, variant: torch.Tensor) -> bool:
    """Whether the float32 fast pass can measure this pair: float64 values would be rounded by it."""
    import torch

    return reference.dtype != torch.float64 and variant.dtype != torch.float64


def reference_sums(reference: torch.Tensor) -> torch.Tensor:
    """The reference's side of the fast pass, on its device (no host sync): see REFERENCE_SUMS.

    Computed once per reference tensor and shared by every variant measured against it."""
    import torch

    x_all = flattened(reference)
    if not x_all.numel():
        return x_all.new_tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    if x_all.dtype != torch.float32:
        x_all = x_all.to(torch.float32)
    low, high = torch.aminmax(x_all)
    magnitude = torch.maximum(-low, high)
    exponent = torch.where(magnitude > 0, torch.log2(magnitude).round(), 0.0).clamp(-MAGNITUDE_LIMIT, MAGNITUDE_LIMIT)
    scale = torch.exp2(-exponent)
    shift = x_all.mean()
    step = chunk_elements(x_all.device)
    chunks = []
    scaled_shift = shift * scale
    for start in range(0, x_all.numel(), step):
        scaled = x_all[start : start + step] * scale
        whole = _sum(scaled * scaled)
        centred = scaled.sub_(scaled_shift)
        chunks.append(torch.stack([_sum(centred), _sum(centred * centred), whole]))
    sums = chunks[0] if len(chunks) == 1 else torch.stack(chunks).sum(0)
    return torch.cat([torch.stack([shift, scale]).to(torch.float64), sums, torch.stack([low, high]).to(torch.float64)])


def error_sums(
    reference: torch.Tensor, variant: torch.Tensor, reference_values: torch.Tensor, *, variant_scale: float = 1.0
) -> torch.Tensor:
    """The variant's side of the fast pass, on the reference's device (no host sync): see ERROR_SUMS.

    `reference_values`: the reference's `reference_sums`. `variant_scale`: the variant's values are divided
    by it (a loss-scaled gradient, unscaled chunk by chunk)."""
    import torch

    x_all = flattened(reference)
    y_all = flattened(variant).to(x_all.device)
    if not x_all.numel():
        return x_all.new_zeros(ERROR_SUMS, dtype=torch.float64)
    if x_all.dtype != torch.float32:
        x_all = x_all.to(torch.float32)
    shift = reference_values[0]
    scale = reference_values[1].to(torch.float32)
    step = chunk_elements(x_all.device)
    chunks = []
    for start in range(0, x_all.numel(), step):
        x = x_all[start : start + step]
        y = y_all[start : start + step]
        y_low, y_high = torch.aminmax(y)
        # y upcast on the fly by the subtraction (one pass); a loss-scaled y unscaled first.
        unscaled = y if variant_scale == 1 else y.to(torch.float32, copy=True).div_(variant_scale)
        d = torch.sub(unscaled, x).mul_(scale)
        d_low, d_high = torch.aminmax(d)
        sum_d = _sum(d)
        chunks.append(
            torch.stack(
                [
                    sum_d,
                    _sum(d * d),
                    _sum(x * d) - shift * sum_d,  # sum (x - m) dk
                    d_low.to(torch.float64),
                    d_high.to(torch.float64),
                    y_low.to(torch.float64),
                    y_high.to(torch.float64),
                ]
            )
        )
    return combined_chunks(chunks, 3)


def _exact_chunk(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """EXACT_SUMS of one float64 chunk: only elements finite on both sides count."""
    import torch

    x_finite = torch.isfinite(x)
    y_finite = torch.isfinite(y)
    both = x_finite & y_finite
    d = torch.where(both, y - x, 0.0)
    x_kept = torch.where(both, x, 0.0)
    return torch.stack(
        [
            both.sum(dtype=torch.float64),
            x_kept.sum(),
            d.sum(),
            (x_kept * x_kept).sum(),
            (d * d).sum(),
            (x_kept * d).sum(),
            d.abs().max(),
            (x_finite & ~y_finite).sum(dtype=torch.float64),
            torch.where(both, x, math.inf).min(),
            torch.where(both, x, -math.inf).max(),
            torch.where(both, y, math.inf).min(),
            torch.where(both, y, -math.inf).max(),
        ]
    )


def exact_sums(reference: torch.Tensor, variant: torch.Tensor, *, variant_scale: float = 1.0) -> torch.Tensor:
    """EXACT_SUMS in float64, NaN/Inf on either side left out and counted, on the device (no host sync)."""
    import torch

    x_all = flattened(reference)
    y_all = flattened(variant).to(x_all.device)
    totals = torch.zeros(EXACT_SUMS, dtype=torch.float64, device=x_all.device)
    totals[8::2] = math.inf
    totals[9::2] = -math.inf
    step = chunk_elements(x_all.device)
    for start in range(0, x_all.numel(), step):
        x = x_all[start : start + step].to(torch.float64)
        y = y_all[start : start + step].to(torch.float64)
        if variant_scale != 1:
            y = y / variant_scale
        chunk = _exact_chunk(x, y)
        totals[:6] += chunk[:6]
        totals[6] = torch.maximum(totals[6], chunk[6])
        totals[7] += chunk[7]
        totals[8::2] = torch.minimum(totals[8::2], chunk[8::2])
        totals[9::2] = torch.maximum(totals[9::2], chunk[9::2])
    return totals


def fast_error(count: int, reference: Sequence[float], error: Sequence[float]) -> TensorError | None:
    """The TensorError of `count` elements from host copies of reference_sums and error_sums; None when the fast
    pass cannot be trusted (a NaN/Inf element, or a float32 square of an error far larger than the reference
    overflowing): then only the exact pass can tell."""
    if not all(math.isfinite(v) for v in reference) or not all(math.isfinite(v) for v in error):
        return None
    shift, scale, sx, sxx, sxx_whole, x_min, x_max = reference
    sd, sdd, sxd, d_min, d_max, y_min, y_max = error
    # Unscaled in float64: the scale is a power of two, so these divisions are exact.
    return metrics_from_sums(
        count,
        sx / scale,
        sd / scale,
        sxx / (scale * scale),
        sdd / (scale * scale),
        sxd / scale,  # sum (x - m) (y - x) k: one factor k
        max(-d_min, d_max) / scale if count else 0.0,
        0,
        x_constant=x_min == x_max,
        y_constant=y_min == y_max,
        shift=shift,
        sxx_whole=sxx_whole / (scale * scale),
    )


def exact_error(values: Sequence[float]) -> TensorError:
    """The TensorError from a host copy of exact_sums."""
    n, sx, sd, sxx, sdd, sxd, max_abs, nonfinite, x_min, x_max, y_min, y_max = values
    return metrics_from_sums(
        int(n), sx, sd, sxx, sdd, sxd, max_abs, int(nonfinite), x_constant=x_min == x_max, y_constant=y_min == y_max
    )


def to_host(values: Sequence[torch.Tensor]) -> list[list[float]]:
    """Device tensors of float values as lists of floats, in ONE device-to-host transfer (one sync)."""
    import torch

    if not values:
        return []
    flat = [v.reshape(-1).to(torch.float64) for v in values]
    joined = torch.cat(flat).tolist()
    out, start = [], 0
    for v in flat:
        out.append(joined[start : start + v.numel()])
        start += v.numel()
    return out


def tensor_error(reference: torch.Tensor, variant: torch.Tensor, *, variant_scale: float = 1.0) -> TensorError:
    """Compare `variant` to `reference` (same shape): the fast pass, or the exact one when NaN/Inf are present.

    Elements where either side is NaN/Inf are left out of every metric; those where only the variant is
    non-finite are counted in `nonfinite`. `variant_scale`: the variant's values are divided by it, chunk by
    chunk (a loss-scaled gradient, unscaled without a full copy). One host sync (two with NaN/Inf).
    """
    if reference.shape != variant.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)} vs variant {tuple(variant.shape)}")
    if not fast_pass_applies(reference, variant):
        [values] = to_host([exact_sums(reference, variant, variant_scale=variant_scale)])
        return exact_error(values)
    ref_sums = reference_sums(reference)
    error = error_sums(reference, variant, ref_sums, variant_scale=variant_scale)
    host_reference, host_error = to_host([ref_sums, error])
    fast = fast_error(reference.numel(), host_reference, host_error)
    if fast is not None:
        return fast
    [values] = to_host([exact_sums(reference, variant, variant_scale=variant_scale)])
    return exact_error(values)
