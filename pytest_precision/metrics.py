"""Per-tensor error metrics of a variant tensor `y` against a reference tensor `x`, and range statistics of
`x` in a variant's dtype (RangeStats: how much of it would underflow or overflow there).

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
import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Direction = Literal["lower", "higher", "unit"]

#: Whether a smaller ("lower"), larger ("higher") or closer-to-one ("unit": |1 - value|) value is better.
METRIC_DIRECTIONS: dict[str, Direction] = {
    "ref_rms": "lower",
    "rms_abs": "lower",
    "rms_rel": "lower",
    "max_abs": "lower",
    "max_rel": "lower",
    "bias_abs": "lower",
    "bias_rel": "lower",
    "correlation": "higher",
    "slope": "unit",
    "residual_rms_rel": "lower",
    "cosine": "higher",
    "sqnr_db": "higher",
    "nonfinite": "lower",
    # Log-ratio statistics of chosen-token log-probabilities (kind "logprob"), see logprobs.py.
    "delta_mean": "lower",
    "delta_rms": "lower",
    "delta_max_abs": "lower",
    "clip_fraction": "lower",
    "seq_delta_mean": "lower",
    "seq_delta_std": "lower",
    "seq_delta_rms": "lower",
    "seq_delta_max": "lower",
    "kl_mean": "lower",
    "kl_max": "lower",
    "top1_agreement": "higher",
    # Cross-engine decomposition delta = floor + (e_a - e_b), see cross_engine.py.
    "rho": "higher",
    "rms_e_a": "lower",
    "rms_e_b": "lower",
    "rms_e_diff": "lower",
    "rms_floor": "lower",
    # Range statistics (compare(range_stats=True)), see RangeStats. All "lower": a fraction of elements lost to
    # underflow or overflow is harm done by the variant's dtype, and a bound on the reference's own largest
    # magnitude or dynamic range (descriptive of the reference, but what decides whether a narrow dtype can
    # hold it) is a maximum, "activations stay below 1e4 so that fp16 keeps headroom".
    "underflow_frac": "lower",
    "zero_frac": "lower",
    "overflow_frac": "lower",
    "ref_absmax": "lower",
    "dynamic_range_log2": "lower",
}

#: Metrics only some records carry (log-probability rows); None elsewhere and left out of their JSON.
OPTIONAL_METRICS: tuple[str, ...] = (
    "delta_mean",
    "delta_rms",
    "delta_max_abs",
    "clip_fraction",
    "seq_delta_mean",
    "seq_delta_std",
    "seq_delta_rms",
    "seq_delta_max",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    "rho",
    "rms_e_a",
    "rms_e_b",
    "rms_e_diff",
    "rms_floor",
    "underflow_frac",
    "zero_frac",
    "overflow_frac",
    "ref_absmax",
    "dynamic_range_log2",
)

#: Metrics describing the reference rather than an error: never gated.
DESCRIPTIVE_METRICS = frozenset({"ref_rms"})

#: Signed metrics whose magnitude is what matters (the gate compares |value|).
SIGNED_METRICS = frozenset({"bias_abs", "bias_rel", "delta_mean", "seq_delta_mean"})

# Elements per chunk of the fused float64 passes. On the CPU a chunk's temporaries (2 MiB each) stay in cache
# and below malloc's mmap threshold, so no chunk pays page faults: 4.8 ms for 2M elements against 23 ms with
# 4M-element chunks. On an accelerator larger chunks amortise kernel launches and the per-chunk sync (32 MiB).
CPU_CHUNK_ELEMENTS = 1 << 18
DEVICE_CHUNK_ELEMENTS = 1 << 22


def chunk_elements(device: torch.device) -> int:
    """Elements per chunk of a float64 pass on `device`."""
    return CPU_CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS


@dataclass(frozen=True)
class TensorError:
    """Error of one variant tensor against its reference. Undefined values are None.

    count: elements compared (both finite, not masked out).
    ref_rms: sqrt(mean(x^2)).
    rms_abs: sqrt(mean((y-x)^2)); rms_rel = rms_abs / ref_rms (None when ref_rms is 0).
    max_abs: max|y-x|; max_rel = max_abs / ref_rms.
    bias_abs: mean(y-x); bias_rel = bias_abs / ref_rms.
    correlation: centred Pearson correlation of x and y (None when either is constant).
    slope: cov(x,y) / var(x), the least-squares fit y ~ slope*x + c (None when x is constant).
    residual_rms_rel: RMS of y about that fit over ref_rms, sqrt(max(var_y - cov^2/var_x, 0)) / ref_rms.
    cosine: sum(xy) / sqrt(sum(x^2) sum(y^2)) (None when either is all zeros).
    sqnr_db: 10 log10(sum x^2 / sum (y-x)^2); +inf when y equals x, -inf when x is all zeros and y is not.
    nonfinite: count of NaN/Inf in y where x is finite.
    """

    count: int
    ref_rms: float | None
    rms_abs: float | None
    rms_rel: float | None
    max_abs: float | None
    max_rel: float | None
    bias_abs: float | None
    bias_rel: float | None
    correlation: float | None
    slope: float | None
    residual_rms_rel: float | None
    cosine: float | None
    sqnr_db: float | None
    nonfinite: int


METRIC_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TensorError) if f.name != "count")


def _ratio(numerator: float, denominator: float) -> float | None:
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
        rms_rel=_ratio(rms_abs, ref_rms),
        max_abs=max_abs,
        max_rel=_ratio(max_abs, ref_rms),
        bias_abs=bias_abs,
        bias_rel=_ratio(bias_abs, ref_rms),
        correlation=correlation,
        slope=slope,
        residual_rms_rel=None if residual_var is None else _ratio(math.sqrt(residual_var), ref_rms),
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


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1)


def _combine(chunks: list[torch.Tensor], additive: int) -> torch.Tensor:
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

    x_all = _flat(reference)
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

    x_all = _flat(reference)
    y_all = _flat(variant).to(x_all.device)
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
    return _combine(chunks, 3)


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

    x_all = _flat(reference)
    y_all = _flat(variant).to(x_all.device)
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

    x_all = _flat(reference)
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
    return _combine(chunks, 5)


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
        underflow_frac=_ratio(underflow, nonzero),
        zero_frac=_ratio(zero, nonzero),
        overflow_frac=_ratio(overflow, finite),
        ref_absmax=largest if finite else None,
        dynamic_range_log2=math.log2(largest / smallest) if nonzero else None,
    )


def range_stats(reference: torch.Tensor, dtype: torch.dtype | str, *, scale: float = 1.0) -> RangeStats:
    """RangeStats of `reference` held in `dtype` (a torch.dtype or a name like "fp16") at loss scale `scale`
    (> 0), in one host sync."""
    from .variants import torch_dtype

    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"range_stats: scale must be a finite positive number, got {scale!r}")
    chosen = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    [values] = to_host([range_sums(reference, chosen, scale=float(scale))])
    return range_from_sums(values)
