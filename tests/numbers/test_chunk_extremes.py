"""The chunked passes of metrics.py against float64 NumPy over the whole tensor, with each side's extremes held
in each chunk position (first, middle, last full, last partial), as a lone spike or as a whole chunk constant
at the tensor's minimum or maximum.

The running minimum/maximum across chunks decides whether a side is constant, and a constant reference has no
slope or correlation: a pass that kept one chunk's extremes instead of the whole tensor's would report a
reference whose last chunk is constant as constant, and slope and correlation as undefined (issue 34, item 8).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from numpy_metrics import numpy_metrics
from test_metric_accuracy import assert_accurate

import pytest_precision.numbers.metrics as metrics_module
from pytest_precision.numbers.metrics import (
    MAGNITUDE_LIMIT,
    error_sums,
    exact_sums,
    reference_sums,
    tensor_error,
    to_host,
)

#: A small chunk keeps the tensors small; the real chunk size runs once, in test_the_issues_tensor below.
CHUNK = 256
#: The chunk holding an extreme, of five (four full and a last partial one): first, middle, last full, last.
POSITIONS = {"first": 0, "middle": 2, "last-full": 3, "last-partial": 4}


def tensor_size() -> int:
    """Five chunks of the chunk size in force, the last one partial."""
    return 4 * metrics_module.CPU_CHUNK_ELEMENTS + 37


LAYOUTS = ["spike-max", "spike-min", "constant-at-min", "constant-at-max"]


def with_extreme(values: torch.Tensor, layout: str, start: int, end: int) -> torch.Tensor:
    """`values` with the tensor's new extreme in [start, end): one element (a spike) or the whole chunk."""
    out = values.clone()
    low, high = float(values.min()), float(values.max())
    if layout == "spike-max":
        out[start + (end - start) // 2] = high + 3.0
    elif layout == "spike-min":
        out[start + (end - start) // 2] = low - 3.0
    elif layout == "constant-at-min":
        out[start:end] = low - 1.0
    else:
        out[start:end] = high + 1.0
    return out


def pair(side: str, layout: str, position: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference and a bf16-size variant over five chunks, `side` holding the extreme in chunk `position`."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{side} {layout} {position}".encode()))
    size, chunk = tensor_size(), metrics_module.CPU_CHUNK_ELEMENTS
    x = torch.randn(size, generator=generator, dtype=torch.float64)
    start = POSITIONS[position] * chunk
    end = min(start + chunk, size)
    if side == "reference":
        x = with_extreme(x, layout, start, end)
    y = x.to(torch.bfloat16).to(torch.float64)
    if side == "variant":
        y = with_extreme(y, layout, start, end)
    return x.to(dtype), y.to(dtype)


def numpy_exact_sums(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """metrics.EXACT_SUMS from their definitions over the whole tensor, in float64 NumPy (all finite here)."""
    x64 = x.double().numpy()
    d = y.double().numpy() - x64
    y64 = y.double().numpy()
    return [
        float(x64.size),
        float(np.sum(x64)),
        float(np.sum(d)),
        float(np.sum(x64 * x64)),
        float(np.sum(d * d)),
        float(np.sum(x64 * d)),
        float(np.max(np.abs(d))),
        0.0,
        float(x64.min()),
        float(x64.max()),
        float(y64.min()),
        float(y64.max()),
    ]


def assert_sums_match(got: list[float], want: list[float], magnitudes: list[float]) -> None:
    """Counts and extremes exactly; sums to 1e-12 of the sum of their terms' magnitudes (order of addition)."""
    names = ("n", "sum x", "sum d", "sum x^2", "sum d^2", "sum x d", "max |d|", "nonfinite")
    names += ("min x", "max x", "min y", "max y")
    for index, name in enumerate(names):
        if index in (1, 2, 3, 4, 5):
            assert abs(got[index] - want[index]) <= 1e-12 * magnitudes[index], (
                f"{name}: {got[index]!r} != {want[index]!r}"
            )
        else:
            assert got[index] == want[index], f"{name}: {got[index]!r} != {want[index]!r}"


def term_magnitudes(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    x64 = x.double().numpy()
    d = y.double().numpy() - x64
    return [0.0, *(float(np.sum(np.abs(t))) for t in (x64, d, x64 * x64, d * d, x64 * d))] + [0.0] * 6


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", CHUNK)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("side", ["reference", "variant"])
def test_exact_pass_holds_the_whole_tensors_extremes(side: str, layout: str, position: str) -> None:
    """float64 tensors take the exact pass: each of its twelve sums and every metric, against NumPy."""
    x, y = pair(side, layout, position, torch.float64)
    [values] = to_host([exact_sums(x, y)])
    assert_sums_match(values, numpy_exact_sums(x, y), term_magnitudes(x, y))
    want = numpy_metrics(x, y)
    assert want["slope"] is not None and want["correlation"] is not None  # neither side is constant
    assert_accurate(tensor_error(x, y), want)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("side", ["reference", "variant"])
def test_fast_pass_holds_the_whole_tensors_extremes(side: str, layout: str, position: str) -> None:
    """float32 tensors take the fast pass: its extremes exactly and every metric, against NumPy."""
    x, y = pair(side, layout, position, torch.float32)
    reference = reference_sums(x)
    ref_values, err_values = to_host([reference, error_sums(x, y, reference)])
    scale = ref_values[1]
    assert scale == 2.0 ** -max(-MAGNITUDE_LIMIT, min(MAGNITUDE_LIMIT, round(math.log2(float(x.abs().max())))))
    d = (y.numpy() - x.numpy()) * np.float32(scale)  # float32, as the pass computes it (the scale is exact)
    assert ref_values[5:] == [float(x.min()), float(x.max())]
    assert err_values[3:] == [float(d.min()), float(d.max()), float(y.min()), float(y.max())]
    want = numpy_metrics(x, y)
    assert want["slope"] is not None and want["correlation"] is not None
    assert_accurate(tensor_error(x, y), want)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("side", ["reference", "variant"])
def test_a_side_constant_but_for_one_chunk_is_not_constant(side: str, position: str) -> None:
    """Every chunk constant but one: a pass that judged constancy from some chunks would say constant."""
    generator = torch.Generator().manual_seed(len(position))
    size = tensor_size()
    values = torch.full((size,), 0.1, dtype=torch.float64)
    start = POSITIONS[position] * CHUNK
    values[start : start + CHUNK] = torch.rand(min(CHUNK, size - start), generator=generator, dtype=torch.float64)
    other = torch.randn(size, generator=generator, dtype=torch.float64)
    x, y = (values, other) if side == "reference" else (other, values)
    for dtype in (torch.float64, torch.float32):
        want = numpy_metrics(x.to(dtype), y.to(dtype))
        assert want["correlation"] is not None
        assert_accurate(tensor_error(x.to(dtype), y.to(dtype)), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["exact-pass", "fast-pass"])
@pytest.mark.parametrize("layout", ["constant-at-min", "constant-at-max"])
def test_the_issues_tensor(layout: str, dtype: torch.dtype) -> None:
    """The case of the report, at the real chunk size: over 2^18 elements, the last chunk constant at the
    tensor's minimum (or maximum); slope and correlation are defined and right."""
    x, y = pair("reference", layout, "last-partial", dtype)
    assert x.numel() > 1 << 18
    assert torch.all(
        x[4 * metrics_module.CPU_CHUNK_ELEMENTS :] == (x.min() if layout == "constant-at-min" else x.max())
    )
    want = numpy_metrics(x, y)
    error = tensor_error(x, y)
    assert error.slope is not None and error.correlation is not None
    assert_accurate(error, want)
