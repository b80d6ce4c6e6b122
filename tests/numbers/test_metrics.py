"""tensor_error against an independent float64 NumPy computation written from the metric definitions."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from numpy_metrics import FIELDS, FLOAT_FIELDS, numpy_metrics

import pytest_precision.numbers.metrics as metrics_module
from pytest_precision.base.records import METRIC_NAMES, TensorError
from pytest_precision.numbers.metrics import tensor_error

RTOL = 1e-6  # float32 sums per chunk (exact to ~1e-7), added up in float64: see metrics.py


def assert_matches(
    actual: TensorError, expected: dict[str, float | int | None], *, residual_rtol: float = RTOL
) -> None:
    assert tuple(f.name for f in dataclasses.fields(TensorError)) == FIELDS
    assert set(FIELDS) == set(expected)
    for name, want in expected.items():
        got = getattr(actual, name)
        if want is None or isinstance(want, int) or math.isinf(want):
            assert got == want, f"{name}: {got!r} != {want!r}"
        else:
            rtol = residual_rtol if name == "residual_rms_rel" else RTOL
            assert got is not None, f"{name} is None, expected {want!r}"
            # sqnr_db is a logarithm: a relative error RTOL of the power ratio is 4.3 RTOL dB, whatever its value.
            atol = 10 * RTOL if name == "sqnr_db" else 0
            assert got == pytest.approx(want, rel=rtol, abs=atol), f"{name}: {got!r} != {want!r}"


def gaussian(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * scale


def test_small_noise_float32() -> None:
    x = gaussian((64, 97), seed=1)
    y = x + gaussian((64, 97), seed=2, scale=1e-3)
    error = tensor_error(x, y)
    # The residual about the fit is ~1e-3 of the signal: the NumPy reference forms it as y - fit(x), which
    # cancels ~3 digits and goes through polyfit's least squares, so it is only good to ~1e-9 relative.
    assert_matches(error, numpy_metrics(x, y), residual_rtol=1e-6)
    assert error.count == x.numel()
    assert 0 < error.rms_rel < 2e-3


def test_bf16_rounded_variant() -> None:
    x = gaussian((32, 128), seed=3)
    y = x.to(torch.bfloat16)
    error = tensor_error(x, y)
    assert_matches(error, numpy_metrics(x, y), residual_rtol=1e-6)
    # bf16 round-to-nearest (8-bit significand): |d| <= 2^-8 |x|, rms relative error ~ 2^-8 / sqrt(3) / 1.5.
    assert 1e-3 < error.rms_rel < 2.5e-3
    assert error.max_abs <= 2.0**-8 * float(x.abs().max())


def test_biased_and_scaled_variant() -> None:
    x = gaussian((4096,), seed=4)
    y = 1.25 * x + 0.5 + gaussian((4096,), seed=5, scale=0.01)
    error = tensor_error(x, y)
    # The residual about the fit is what is left of var(d) ~ 0.3 after removing the fit's ~0.3: the float32 sums
    # (~1e-8 of var(d)) leave it ~3e-5 of its own value (~0.01^2) wrong; the other metrics do not cancel.
    assert_matches(error, numpy_metrics(x, y), residual_rtol=2e-4)
    assert error.slope == pytest.approx(1.25, abs=1e-3)
    assert error.bias_abs == pytest.approx(0.5 + 0.25 * float(x.double().mean()), abs=1e-3)
    assert error.bias_rel == pytest.approx(error.bias_abs / error.ref_rms, rel=1e-12)


def test_float64_inputs_and_mixed_dtypes() -> None:
    x = gaussian((1000,), seed=6).double()
    y = (x + 1e-7 * gaussian((1000,), seed=7).double()).to(torch.float16)
    assert_matches(tensor_error(x, y), numpy_metrics(x, y), residual_rtol=1e-6)


def test_identical_tensors() -> None:
    x = gaussian((10, 10), seed=8)
    error = tensor_error(x, x.clone())
    assert error.count == 100
    assert error.rms_abs == 0 and error.rms_rel == 0 and error.max_abs == 0 and error.bias_abs == 0
    assert error.sqnr_db == math.inf
    assert error.slope == 1.0
    assert error.correlation == pytest.approx(1.0, abs=1e-15)
    assert error.cosine == pytest.approx(1.0, abs=1e-15)
    assert error.residual_rms_rel == 0
    assert error.nonfinite == 0
    assert error.ref_rms == pytest.approx(math.sqrt(float((x.double() ** 2).mean())), rel=RTOL)


def test_all_zero_reference() -> None:
    x = torch.zeros(50)
    y = gaussian((50,), seed=9)
    error = tensor_error(x, y)
    assert_matches(error, numpy_metrics(x, y))
    assert error.ref_rms == 0
    for name in ("rms_rel", "max_rel", "bias_rel", "correlation", "slope", "residual_rms_rel", "cosine"):
        assert getattr(error, name) is None, name
    assert error.sqnr_db == -math.inf
    assert error.rms_abs == pytest.approx(math.sqrt(float((y.double() ** 2).mean())), rel=RTOL)


def test_all_zero_reference_and_variant() -> None:
    error = tensor_error(torch.zeros(7), torch.zeros(7))
    assert error.count == 7 and error.ref_rms == 0 and error.rms_abs == 0
    assert error.rms_rel is None and error.slope is None and error.correlation is None
    assert error.sqnr_db == math.inf


def test_constant_reference_exact_constant() -> None:
    # 2.0: every float64 sum is exact, so var(x) is exactly 0.
    x = torch.full((1000,), 2.0)
    y = x + gaussian((1000,), seed=10, scale=0.01)
    error = tensor_error(x, y)
    assert_matches(error, numpy_metrics(x, y))
    assert error.ref_rms == 2.0
    assert error.slope is None and error.correlation is None and error.residual_rms_rel is None
    assert error.cosine is not None


def test_constant_reference_inexact_constants() -> None:
    for value in (0.1, 0.3, 1 / 3, 7.77, 1e-3, -1.1, 2.5e4):
        x = torch.full((1000,), value)
        y = x + gaussian((1000,), seed=11, scale=0.01)
        error = tensor_error(x, y)
        assert error.slope is None, (value, error.slope)
        assert error.correlation is None, (value, error.correlation)
        assert error.residual_rms_rel is None, (value, error.residual_rms_rel)


def test_constant_variant_has_no_correlation() -> None:
    for seed in range(5):
        x = gaussian((1000,), seed=100 + seed)
        for value in (0.1, 0.3, 7.77, 2.5, -1.1):
            error = tensor_error(x, torch.full((1000,), value))
            assert error.correlation is None, (seed, value, error.correlation)


def test_nan_and_inf_in_variant() -> None:
    x = gaussian((200,), seed=12)
    y = x + gaussian((200,), seed=13, scale=1e-2)
    y[3] = float("nan")
    y[50] = float("inf")
    y[199] = -float("inf")
    error = tensor_error(x, y)
    assert error.nonfinite == 3
    assert error.count == 197
    assert_matches(error, numpy_metrics(x, y))
    finite = torch.ones(200, dtype=torch.bool)
    finite[[3, 50, 199]] = False
    clean = tensor_error(x[finite], y[finite])
    assert clean.nonfinite == 0
    for name in FLOAT_FIELDS:  # the same elements: the exact pass (NaN/Inf present) against the fast one
        assert getattr(error, name) == pytest.approx(getattr(clean, name), rel=RTOL), name


def test_nan_in_reference() -> None:
    x = gaussian((100,), seed=14)
    y = x + gaussian((100,), seed=15, scale=1e-2)
    x[0] = float("nan")
    x[1] = float("inf")
    y[1] = float("nan")  # both non-finite: neither compared nor counted
    y[2] = float("nan")  # only the variant: counted
    error = tensor_error(x, y)
    assert error.count == 97
    assert error.nonfinite == 1
    assert_matches(error, numpy_metrics(x, y))


def test_all_variant_nonfinite() -> None:
    x = gaussian((5,), seed=16)
    error = tensor_error(x, torch.full((5,), float("nan")))
    assert error.count == 0 and error.nonfinite == 5
    assert all(getattr(error, name) is None for name in FLOAT_FIELDS)


def test_empty_tensors() -> None:
    error = tensor_error(torch.empty(0, 4), torch.empty(0, 4))
    assert error.count == 0
    assert error.nonfinite == 0
    assert all(getattr(error, name) is None for name in FLOAT_FIELDS)


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="shape"):
        tensor_error(torch.zeros(4, 3), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="shape"):
        tensor_error(torch.zeros(12), torch.zeros(3, 4))


def test_scalar_tensors() -> None:
    error = tensor_error(torch.tensor(2.0), torch.tensor(2.5))
    assert error.count == 1
    assert error.rms_abs == 0.5 and error.bias_abs == 0.5 and error.rms_rel == 0.25
    assert error.slope is None and error.correlation is None
    assert error.sqnr_db == pytest.approx(10 * math.log10(4.0 / 0.25), rel=RTOL)


def test_chunked_pass_matches_unchunked_and_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 10_007  # not a multiple of the chunk size
    x = gaussian((n,), seed=17)
    y = x + gaussian((n,), seed=18, scale=1e-2)
    y[9_500] = x[9_500] + 7.0  # the maximum lies in the last full chunk
    y[[5, 2_500, 10_006]] = float("nan")
    y[3_000:4_000] = float("inf")  # one whole chunk non-finite
    whole = tensor_error(x, y)
    monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", 1000)
    chunked = tensor_error(x, y)
    assert chunked.count == whole.count == n - 1003
    assert chunked.nonfinite == whole.nonfinite == 1003
    assert chunked.max_abs == whole.max_abs == pytest.approx(7.0, rel=1e-6)
    assert set(METRIC_NAMES) == set(FIELDS) - {"count"}
    for name in FLOAT_FIELDS:
        a, b = getattr(chunked, name), getattr(whole, name)
        assert a == pytest.approx(b, rel=1e-12), name
    assert_matches(chunked, numpy_metrics(x, y), residual_rtol=1e-6)


def test_tiny_magnitudes_have_exact_relative_metrics() -> None:
    # Gradients of ~1e-12: any epsilon in a denominator would distort the relative metrics.
    x = gaussian((4096,), seed=19, scale=1e-12)
    y = x + gaussian((4096,), seed=20, scale=1e-15)
    error = tensor_error(x, y)
    assert_matches(error, numpy_metrics(x, y), residual_rtol=1e-6)
    assert error.ref_rms == pytest.approx(1e-12, rel=0.05)
    assert error.rms_rel == pytest.approx(1e-3, rel=0.05)
    assert error.sqnr_db == pytest.approx(60.0, abs=0.5)


def test_tiny_reference_large_error() -> None:
    x = gaussian((256,), seed=21, scale=1e-30)
    y = x + gaussian((256,), seed=22, scale=1e-30)
    error = tensor_error(x, y)
    assert_matches(error, numpy_metrics(x, y))
    assert error.rms_rel == pytest.approx(1.0, rel=0.2)


def test_a_scaled_variant_is_unscaled_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a loss-scaled fp16 gradient gets: divided by the scale in float64 before any metric.
    x = gaussian((5_003,), seed=31)
    y = (x + gaussian((5_003,), seed=32, scale=1e-3)).to(torch.float16)
    y[17] = float("inf")
    scale = 2.0**12
    scaled = (y.double() * scale).to(torch.float32)  # exact: a power of two
    monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", 1000)
    unscaled = tensor_error(x, scaled, variant_scale=scale)
    assert unscaled == tensor_error(x, y)
    assert unscaled.nonfinite == 1
    assert_matches(unscaled, numpy_metrics(x, y.to(torch.float64)), residual_rtol=1e-6)
