"""Accuracy of tensor_error and distribution_stats against an independent float64 NumPy computation.

The metrics may use float32 partial sums with float64 accumulation; these tests pin how exact that must be:
identical tensors give exact zeros, and errors of tf32 and bf16 size, tiny gradients, loss-scaled fp16
gradients and tensors spanning many chunks are measured to 1e-3 of each metric's own size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from numpy_metrics import FLOAT_FIELDS, numpy_metrics

import pytest_precision.numbers.metrics as metrics_module
from pytest_precision.base.records import TensorError
from pytest_precision.numbers.logprobs import distribution_stats
from pytest_precision.numbers.metrics import tensor_error

RTOL = 1e-3
#: Large enough to span several CPU chunks (metrics.CPU_CHUNK_ELEMENTS = 2**18).
LARGE = (1100, 1000)
SHAPES = [(64, 97), (3, 5, 7), LARGE]


def assert_accurate(actual: TensorError, expected: dict[str, float | int | None]) -> None:
    """Each metric to RTOL of its own size: bias to RTOL of rms_abs, correlation and cosine to RTOL of their
    distance from 1, slope to RTOL of its distance from 1 (plus 1e-9)."""
    for name in ("count", "nonfinite"):
        assert getattr(actual, name) == expected[name], name
    rms_abs = expected["rms_abs"]
    for name in FLOAT_FIELDS:
        got, want = getattr(actual, name), expected[name]
        if want is None or math.isinf(want):
            assert got == want, f"{name}: {got!r} != {want!r}"
            continue
        assert got is not None, f"{name} is None, expected {want!r}"
        if name in ("bias_abs", "bias_rel"):
            scale = rms_abs if name == "bias_abs" else expected["rms_rel"]
            assert abs(got - want) <= RTOL * scale, f"{name}: {got!r} != {want!r} (scale {scale!r})"
        elif name in ("correlation", "cosine"):
            assert abs((1 - got) - (1 - want)) <= RTOL * abs(1 - want), f"{name}: 1 - {got!r} vs 1 - {want!r}"
        elif name == "slope":
            assert abs(got - want) <= RTOL * abs(want - 1) + 1e-9, f"slope: {got!r} != {want!r}"
        else:
            assert got == pytest.approx(want, rel=RTOL, abs=0), f"{name}: {got!r} != {want!r}"


def gaussian(shape: tuple[int, ...], seed: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * scale + offset


def tf32_rounded(x: torch.Tensor) -> torch.Tensor:
    """x with the low 13 mantissa bits of its float32 values zeroed (tf32's 10-bit significand)."""
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def relative_noise(x: torch.Tensor) -> torch.Tensor:
    """x plus Gaussian noise of 1e-4 of its RMS (an error of tf32 size)."""
    return x + gaussian(tuple(x.shape), seed=99, scale=1e-4 * float(x.double().square().mean().sqrt()))


VARIANTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "noise-1e-4": relative_noise,
    "tf32-rounded": tf32_rounded,
    "bf16": lambda x: x.to(torch.bfloat16),
}


@pytest.mark.parametrize(
    "reference",
    [
        gaussian((64, 97), seed=1),
        gaussian((64, 97), seed=2).to(torch.bfloat16).float(),
        gaussian((3 << 18) + 5, seed=3),
        gaussian((64, 97), seed=4, scale=0.01, offset=1000.0),
    ],
    ids=["float32", "bf16-valued", "multi-chunk", "offset-1000"],
)
def test_identical_tensors_give_exact_zeros(reference: torch.Tensor) -> None:
    error = tensor_error(reference, reference.clone())
    for name in ("rms_abs", "max_abs", "bias_abs", "rms_rel", "max_rel", "bias_rel", "residual_rms_rel"):
        assert getattr(error, name) == 0.0, f"{name}: {getattr(error, name)!r}"
    assert abs(error.slope - 1) < 1e-6
    assert abs(error.correlation - 1) <= 1e-7
    assert abs(error.cosine - 1) <= 1e-7
    assert error.sqnr_db == math.inf
    assert error.count == reference.numel()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("offset", [0.0, 10.0], ids=["centred", "mean-10"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_errors_of_tf32_and_bf16_size(shape: tuple[int, ...], offset: float, variant: str) -> None:
    """tf32- and bf16-size errors, also on tensors spanning chunks and on a reference with a large mean."""
    x = gaussian(shape, seed=sum(shape), offset=offset)
    y = VARIANTS[variant](x)
    assert_accurate(tensor_error(x, y), numpy_metrics(x, y))


def test_fp16_storage_and_loss_scaled_gradient_match_the_unscaled_metrics() -> None:
    """bf16-size values stored as float16, and the same gradient loss-scaled by 2**12 in float16."""
    x = gaussian(LARGE, seed=5, scale=1e-3)
    rounded = x.to(torch.bfloat16).float()
    want = numpy_metrics(x, rounded)
    assert_accurate(tensor_error(x, rounded.to(torch.float16)), want)
    scale = 2.0**12
    scaled = (rounded * scale).to(torch.float16)
    assert torch.equal(scaled.float() / scale, rounded)  # the scaling is exact: the metrics must be too
    assert_accurate(tensor_error(x, scaled, variant_scale=scale), want)


@pytest.mark.parametrize("scale", [1e-12, 1e-30])
def test_tiny_gradients_keep_exact_relative_metrics(scale: float) -> None:
    """Squares of 1e-30 underflow float32: relative metrics must not."""
    x = gaussian((300, 1000), seed=6, scale=scale)
    y = relative_noise(x)
    error = tensor_error(x, y)
    want = numpy_metrics(x, y)
    assert error.rms_rel == pytest.approx(want["rms_rel"], rel=RTOL)
    assert error.rms_abs == pytest.approx(want["rms_abs"], rel=RTOL)
    assert error.ref_rms == pytest.approx(want["ref_rms"], rel=RTOL)
    assert 5e-5 < error.rms_rel < 2e-4


@pytest.mark.parametrize("value", [0.1, 0.0])
def test_constant_reference(value: float) -> None:
    x = torch.full((64, 97), value)
    y = x + gaussian((64, 97), seed=7, scale=1e-3)
    error = tensor_error(x, y)
    assert error.slope is None
    assert error.correlation is None
    assert error.residual_rms_rel is None
    assert (error.rms_rel is None) == (value == 0.0)
    assert error.rms_abs == pytest.approx(numpy_metrics(x, y)["rms_abs"], rel=RTOL)


def test_constant_variant() -> None:
    x = gaussian((64, 97), seed=8)
    error = tensor_error(x, torch.full_like(x, 0.5))
    assert error.correlation is None
    assert error.slope is not None


@pytest.mark.parametrize(
    ("size", "positions"),
    [(64 * 97, [5, 77, 1000]), ((3 << 18) + 5, [(1 << 18) + 3, (1 << 18) + 9000, (2 << 18) - 1])],
    ids=["one-chunk", "middle-chunk-of-several"],
)
def test_nonfinite_values_are_counted_and_left_out(size: int, positions: list[int]) -> None:
    x = gaussian((size,), seed=9)
    y = x.to(torch.bfloat16).float()
    y[positions] = torch.tensor([math.nan, math.inf, -math.inf])
    error = tensor_error(x, y)
    want = numpy_metrics(x, y)
    assert error.nonfinite == 3
    assert error.count == size - 3 == want["count"]
    assert_accurate(error, want)


def test_chunk_size_does_not_change_the_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    x = gaussian((64, 97), seed=10, offset=10.0)
    y = x.to(torch.bfloat16)
    want = numpy_metrics(x, y)
    monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", 1 << 10)
    assert_accurate(tensor_error(x, y), want)


def numpy_distribution_stats(
    reference: torch.Tensor, variant: torch.Tensor, valid: torch.Tensor
) -> tuple[float, float, float]:
    """KL(p_ref || p_var) mean and max and the top-1 agreement over the valid positions, in float64."""
    rows = valid.numpy()
    p_logits = reference[:, :-1].to(torch.float64).numpy()[rows]
    q_logits = variant[:, :-1].to(torch.float64).numpy()[rows]

    def log_softmax(z: np.ndarray) -> np.ndarray:
        shifted = z - z.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    log_p, log_q = log_softmax(p_logits), log_softmax(q_logits)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    agreement = float(np.mean(p_logits.argmax(axis=-1) == q_logits.argmax(axis=-1)))
    return float(kl.mean()), float(kl.max()), agreement


@pytest.mark.parametrize("variant", ["noise-1e-4", "tf32-rounded", "bf16"])
def test_distribution_stats_match_numpy(variant: str) -> None:
    """KL mean and max to RTOL of their own value; masked-out positions do not count."""
    reference = gaussian((3, 17, 512), seed=11, scale=3.0)
    variant_logits = VARIANTS[variant](reference)
    valid = torch.ones(3, 16, dtype=torch.bool)
    valid[0, :5] = False
    valid[2, -3:] = False
    # Masked-out positions get a wildly different variant: counted, they would dominate the KL.
    variant_logits = variant_logits.clone()
    variant_logits[0, :5] = -variant_logits[0, :5]
    stats = distribution_stats(reference, variant_logits, valid)
    kl_mean, kl_max, agreement = numpy_distribution_stats(reference, variant_logits, valid)
    assert kl_mean > 0
    assert stats.kl_mean == pytest.approx(kl_mean, rel=RTOL)
    assert stats.kl_max == pytest.approx(kl_max, rel=RTOL)
    assert stats.top1_agreement == agreement


@pytest.mark.parametrize("scale", [1.0, 1e-3])
@pytest.mark.parametrize(("kind", "rtol"), [("bf16", 2e-9), ("tf32-noise", 1e-8)])
def test_sums_of_a_million_elements_stay_exact_to_1e9(kind: str, rtol: float, scale: float) -> None:
    """Blocks of 64 float32 values added up in float64 keep ~1e-9 of a sum of 2^20 squares (measured: at most
    6.6e-9 here); one float32 sum per chunk of 2^18 loses up to ~2e-8 of it, a float32 dot product ~2e-6."""
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(1 << 20, generator=generator) * 3 + 0.5) * scale
    y = x.to(torch.bfloat16) if kind == "bf16" else x + torch.randn(1 << 20, generator=generator) * 3e-4 * scale
    error = tensor_error(x, y)
    x64, y64 = x.double().numpy(), y.double().numpy()
    d = y64 - x64
    assert error.rms_abs == pytest.approx(math.sqrt(np.mean(d * d)), rel=rtol, abs=0)
    assert error.ref_rms == pytest.approx(math.sqrt(np.mean(x64 * x64)), rel=2e-9, abs=0)
