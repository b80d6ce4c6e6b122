"""range_stats at loss scales whose thresholds are no float32 (3, 0.3): every count matches numpy's own cast of
x * scale (exact in float64 for a float32 x) to the variant's dtype, values next to each threshold included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pytest_precision.numbers.range_stats import range_stats, range_thresholds


def _near_thresholds(dtype: torch.dtype, scale: float) -> np.ndarray:
    """float32 magnitudes spread over the dtype's range at `scale`, and the float32 neighbours of each threshold."""
    spread = np.geomspace(1e-12, 1e6, 4001) / scale
    near = []
    for threshold in range_thresholds(dtype, scale):
        below = np.float32(threshold)
        for value in (below, np.nextafter(below, np.float32(0)), np.nextafter(below, np.float32(np.inf))):
            near.append(np.nextafter(value, np.float32(0)))
            near.append(value)
    values = np.concatenate([spread, np.array(near, dtype=np.float64), [0.0, 0.0]]).astype(np.float32)
    signs = np.where(np.arange(values.size) % 2 == 0, 1.0, -1.0).astype(np.float32)
    return values * signs


@pytest.mark.parametrize("scale", [3.0, 0.3])
def test_fp16_range_stats_at_a_scale_match_a_numpy_cast(scale: float) -> None:
    x = _near_thresholds(torch.float16, scale)
    finite = x[np.isfinite(x)]
    with np.errstate(over="ignore"):
        cast = (np.abs(finite).astype(np.float64) * scale).astype(np.float16)
    tiny = np.finfo(np.float16).tiny
    nonzero = finite != 0
    underflow = np.count_nonzero(nonzero & (np.abs(cast) < tiny))
    zero = np.count_nonzero(nonzero & (cast == 0))
    overflow = np.count_nonzero(np.isinf(cast))
    assert 0 < zero < underflow and overflow > 0  # each threshold is crossed
    stats = range_stats(torch.from_numpy(x), "fp16", scale=scale)
    assert stats.underflow_frac == underflow / np.count_nonzero(nonzero)
    assert stats.zero_frac == zero / np.count_nonzero(nonzero)
    assert stats.overflow_frac == overflow / finite.size
    assert stats.ref_absmax == float(np.abs(finite).max())
