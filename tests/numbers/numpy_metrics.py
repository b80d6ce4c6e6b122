"""The TensorError fields computed from their definitions in float64 NumPy: the independent computation the
metric tests hold the package against (no code shared with pytest_precision)."""

from __future__ import annotations

import math

import numpy as np
import torch

FIELDS = (
    "count", "ref_rms", "rms_abs", "rms_rel", "max_abs", "max_rel", "bias_abs", "bias_rel", "correlation",
    "slope", "residual_rms_rel", "cosine", "sqnr_db", "nonfinite",
)  # fmt: skip
FLOAT_FIELDS = FIELDS[1:-1]


def numpy_metrics(reference: torch.Tensor, variant: torch.Tensor) -> dict[str, float | int | None]:
    """Every TensorError field, from the definitions, in float64 NumPy (no shared code with the package)."""
    x_all = reference.detach().to(torch.float64).reshape(-1).numpy()
    y_all = variant.detach().to(torch.float64).reshape(-1).numpy()
    x_finite = np.isfinite(x_all)
    y_finite = np.isfinite(y_all)
    both = x_finite & y_finite
    nonfinite = int(np.count_nonzero(x_finite & ~y_finite))
    x = x_all[both]
    y = y_all[both]
    n = x.size
    if n == 0:
        return {"count": 0, "nonfinite": nonfinite, **dict.fromkeys(FLOAT_FIELDS)}
    d = y - x
    ref_rms = math.sqrt(np.mean(x * x))
    rms_abs = math.sqrt(np.mean(d * d))
    max_abs = float(np.max(np.abs(d)))
    bias_abs = float(np.mean(d))

    def rel(value: float) -> float | None:
        return None if ref_rms == 0 else value / ref_rms

    x_constant = bool(np.all(x == x[0]))
    y_constant = bool(np.all(y == y[0]))
    correlation = None if x_constant or y_constant else float(np.corrcoef(x, y)[0, 1])
    if x_constant:
        slope = residual = None
    else:
        coefficients = np.polyfit(x, y, 1)
        slope = float(coefficients[0])
        residual = rel(float(np.std(y - np.polyval(coefficients, x))))
    sum_xx = float(np.sum(x * x))
    sum_yy = float(np.sum(y * y))
    sum_dd = float(np.sum(d * d))
    cosine = None if sum_xx == 0 or sum_yy == 0 else float(np.dot(x, y) / math.sqrt(sum_xx * sum_yy))
    if sum_dd == 0:
        sqnr = math.inf
    elif sum_xx == 0:
        sqnr = -math.inf
    else:
        sqnr = 10 * math.log10(sum_xx / sum_dd)
    return {
        "count": n,
        "ref_rms": ref_rms,
        "rms_abs": rms_abs,
        "rms_rel": rel(rms_abs),
        "max_abs": max_abs,
        "max_rel": rel(max_abs),
        "bias_abs": bias_abs,
        "bias_rel": rel(bias_abs),
        "correlation": correlation,
        "slope": slope,
        "residual_rms_rel": residual,
        "cosine": cosine,
        "sqnr_db": sqnr,
        "nonfinite": nonfinite,
    }
