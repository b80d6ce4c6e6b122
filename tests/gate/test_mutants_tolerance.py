"""Tolerances (gate/tolerance.py) against issue 34's mutants: the allowed error without repeats, the digits a
value near 1 is shown with, and a bad atol named in its error."""

from __future__ import annotations

import math

import pytest

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.gate.tolerance import Tolerance, allowed_error, format_value


@pytest.mark.parametrize(
    ("metric", "expected", "error"),
    [
        ("rms_rel", 0.01, 0.01),
        ("cosine", 0.999, 1.0 - 0.999),
        ("slope", 1.02, abs(1.0 - 1.02)),
        ("bias_rel", -0.2, 0.2),
    ],
)
def test_without_repeats_the_allowed_error_is_the_baselines_times_one_plus_rtol_plus_atol(
    metric: str, expected: float, error: float
) -> None:
    """No spread given (a run without repeats): nothing widens error * (1 + rtol) + atol."""
    tolerance = Tolerance(rtol=0.1, atol=1e-5)
    assert allowed_error(metric, expected, tolerance) == pytest.approx(error * 1.1 + 1e-5, rel=1e-12)
    assert allowed_error(metric, expected, Tolerance(rtol=0.0, atol=0.0)) == pytest.approx(error, rel=1e-12)


@pytest.mark.parametrize(
    ("metric", "value", "shown"),
    [
        ("cosine", 0.9987654321, "0.998765"),  # 1 - value = 1.23e-3: 6 significant digits
        ("correlation", 0.99999123456, "0.999991235"),  # 1 - value = 8.77e-6: 9 significant digits
        ("cosine", 0.99999, "0.99999"),  # trailing zeros dropped
    ],
)
def test_a_value_near_one_shows_its_distance_from_one_to_three_digits(metric: str, value: float, shown: str) -> None:
    text = format_value(metric, value)
    assert text == shown
    assert f"{1.0 - float(text):.3g}" == f"{1.0 - value:.3g}"


@pytest.mark.parametrize(
    ("atol", "message"),
    [(-1e-5, "atol must be >= 0, got -1e-05"), ("0.1", "atol must be a number, got '0.1' (str)")],
)
def test_a_bad_atol_is_named_in_its_error(atol: object, message: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Tolerance(rtol=0.1, atol=atol)  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_an_atol_of_nan_is_named_in_its_error() -> None:
    with pytest.raises(ConfigurationError, match=r"^atol is NaN"):
        Tolerance(atol=math.nan)
