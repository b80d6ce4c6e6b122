"""Per-tensor error metrics of a variant tensor `y` against a reference tensor `x`.

All metrics come from one fused pass of float64 sums over the elements where both `x` and `y` are finite,
kept on the tensors' device and copied to the host once per tensor. The sums are taken over `x` and the
difference `d = y - x` rather than over `y`, so that statistics of a small error are not lost to
cancellation (var_y - cov^2/var_x for y ~ x cancels to ~1e-8 of the signal in float64; var_d does not).
"""

from __future__ import annotations

import math
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
) -> TensorError:
    """Build every metric from the fused sums over x and d = y - x (n elements, all finite).

    `x_constant` / `y_constant` say a side holds one value: its variance is then exactly zero, which
    sxx/n - mean^2 does not give for constants like 0.1 that binary floating point cannot hold.
    """
    if n == 0:
        return TensorError(0, None, None, None, None, None, None, None, None, None, None, None, None, nonfinite)
    ref_rms = math.sqrt(sxx / n)
    rms_abs = math.sqrt(sdd / n)
    bias_abs = sd / n
    mean_x = sx / n
    var_x = 0.0 if x_constant else max(sxx / n - mean_x * mean_x, 0.0)
    var_d = max(sdd / n - bias_abs * bias_abs, 0.0)
    cov_xd = sxd / n - mean_x * bias_abs
    cov_xy = var_x + cov_xd
    var_y = 0.0 if y_constant else max(var_x + 2.0 * cov_xd + var_d, 0.0)
    syy = sxx + 2.0 * sxd + sdd
    slope = None if var_x == 0 else 1.0 + cov_xd / var_x
    # var_y - cov_xy^2 / var_x, rewritten in terms of d so that it does not cancel.
    residual_var = None if var_x == 0 else max(var_d - cov_xd * cov_xd / var_x, 0.0)
    correlation = None if var_x == 0 or var_y == 0 else cov_xy / math.sqrt(var_x * var_y)
    if correlation is not None:
        correlation = min(max(correlation, -1.0), 1.0)
    cosine = None if sxx == 0 or syy <= 0 else (sxx + sxd) / math.sqrt(sxx * syy)
    if cosine is not None:
        cosine = min(max(cosine, -1.0), 1.0)
    if sdd == 0:
        sqnr_db: float | None = math.inf
    elif sxx == 0:
        sqnr_db = -math.inf
    else:
        sqnr_db = 10.0 * math.log10(sxx / sdd)
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


def _finite_chunk(
    x: torch.Tensor, y: torch.Tensor, d: torch.Tensor, sum_x: torch.Tensor, sum_d: torch.Tensor
) -> torch.Tensor:
    """The 12 running values of an all-finite chunk: dot products and min/max, no masks or temporaries."""
    import torch

    x_min, x_max = torch.aminmax(x)
    y_min, y_max = torch.aminmax(y)
    d_min, d_max = torch.aminmax(d)
    return torch.stack(
        [
            sum_x.new_tensor(float(x.numel())),
            sum_x,
            sum_d,
            torch.dot(x, x),
            torch.dot(d, d),
            torch.dot(x, d),
            torch.maximum(-d_min, d_max),
            sum_x.new_zeros(()),
            x_min,
            x_max,
            y_min,
            y_max,
        ]
    )


def _masked_chunk(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The 12 running values of a chunk holding NaN/Inf: only elements finite on both sides count."""
    import torch

    x_finite = torch.isfinite(x)
    y_finite = torch.isfinite(y)
    both = x_finite & y_finite
    d = torch.where(both, y - x, 0.0)
    x_kept = torch.where(both, x, 0.0)
    any_kept = d.numel() > 0
    return torch.stack(
        [
            both.sum(dtype=torch.float64),
            x_kept.sum(),
            d.sum(),
            (x_kept * x_kept).sum(),
            (d * d).sum(),
            (x_kept * d).sum(),
            d.abs().max() if any_kept else d.new_zeros(()),
            (x_finite & ~y_finite).sum(dtype=torch.float64),
            torch.where(both, x, math.inf).min() if any_kept else d.new_full((), math.inf),
            torch.where(both, x, -math.inf).max() if any_kept else d.new_full((), -math.inf),
            torch.where(both, y, math.inf).min() if any_kept else d.new_full((), math.inf),
            torch.where(both, y, -math.inf).max() if any_kept else d.new_full((), -math.inf),
        ]
    )


def tensor_error(reference: torch.Tensor, variant: torch.Tensor, *, variant_scale: float = 1.0) -> TensorError:
    """Compare `variant` to `reference` (same shape) in float64, in one fused, chunked pass on their device.

    Elements where either side is NaN/Inf are left out of every metric; those where only the variant is
    non-finite are counted in `nonfinite`. `variant_scale`: the variant's values are divided by it, in
    float64, chunk by chunk (a loss-scaled gradient, unscaled without a full float64 copy).
    """
    import torch

    if reference.shape != variant.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)} vs variant {tuple(variant.shape)}")
    x_all = reference.detach().reshape(-1)
    y_all = variant.detach().reshape(-1).to(x_all.device)
    # [n, sx, sd, sxx, sdd, sxd, max|d|, nonfinite, min x, max x, min y, max y] accumulated on the device;
    # one host copy at the end. The extremes (over compared elements) detect a constant side exactly.
    totals = torch.zeros(12, dtype=torch.float64, device=x_all.device)
    totals[8::2] = math.inf
    totals[9::2] = -math.inf
    step = chunk_elements(x_all.device)
    for start in range(0, x_all.numel(), step):
        x = x_all[start : start + step].to(torch.float64)
        y = y_all[start : start + step].to(torch.float64)
        if variant_scale != 1:
            y = y / variant_scale
        d = y - x
        sum_x, sum_d = x.sum(), d.sum()
        # One scalar tells whether the chunk is all finite (any NaN/Inf makes a sum non-finite; sums of
        # float32-range values cannot overflow float64): then a fast pass without masks, else the masked one.
        if d.numel() and bool(torch.isfinite(sum_x + sum_d)):
            chunk = _finite_chunk(x, y, d, sum_x, sum_d)
        else:
            chunk = _masked_chunk(x, y)
        totals[:6] += chunk[:6]
        totals[6] = torch.maximum(totals[6], chunk[6])
        totals[7] += chunk[7]
        totals[8::2] = torch.minimum(totals[8::2], chunk[8::2])
        totals[9::2] = torch.maximum(totals[9::2], chunk[9::2])
    n, sx, sd, sxx, sdd, sxd, max_abs, nonfinite, x_min, x_max, y_min, y_max = totals.tolist()
    return metrics_from_sums(
        int(n), sx, sd, sxx, sdd, sxd, max_abs, int(nonfinite), x_constant=x_min == x_max, y_constant=y_min == y_max
    )
