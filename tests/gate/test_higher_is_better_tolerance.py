"""Issue 34 item 2: a tolerance on a higher-is-better metric bounds its distance from perfect (1 - value, or the
SQNR's amplitude 10^(-dB / 20)), so that no rtol, however large, and no drift rule makes the gate vacuous.

Every expected bound is computed here independently, in float64 numpy, from the rule the docs state:
error(obtained) fails when above error(baseline) * (1 + rtol + drift) + atol."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pytest_precision.base.records import METRIC_DIRECTIONS, Record, TensorError
from pytest_precision.gate.checks import check_against_baseline
from pytest_precision.gate.tolerance import Tolerance, Violation, allowed_value, is_better, is_worse
from pytest_precision.gate.tolerance_rules import ToleranceRules

#: Every higher-is-better metric, spelled out: a new one must be added here and given its distance from perfect.
HIGHER = ("correlation", "cosine", "sqnr_db", "top1_agreement", "ln_ppl_corr", "expert_agreement", "rho")
#: Each one's baseline: an error of 1e-3 from perfect (30 dB is an amplitude of 10^-1.5 = 0.0316).
BASELINE = {metric: 0.999 for metric in HIGHER} | {"sqnr_db": 30.0}


def error64(metric: str, value: float) -> float:
    """The distance from perfect, in float64 numpy."""
    if metric == "sqnr_db":
        return float(np.power(np.float64(10.0), -np.float64(value) / np.float64(20.0)))
    return float(np.float64(1.0) - np.float64(value))


def value64(metric: str, error: float) -> float:
    """The value at a distance `error` from perfect, in float64 numpy."""
    if metric == "sqnr_db":
        return float(np.float64(-20.0) * np.log10(np.float64(error)))
    return float(np.float64(1.0) - np.float64(error))


def record(metric: str, value: float) -> Record:
    """A forward row whose only gated metric `metric` holds `value` (rms_rel plausible, the rest as a tensor)."""
    error = TensorError(
        count=10,
        ref_rms=1.0,
        rms_abs=0.01,
        rms_rel=0.01,
        max_abs=0.03,
        max_rel=0.03,
        bias_abs=0.0,
        bias_rel=0.0,
        correlation=0.999,
        slope=1.0,
        residual_rms_rel=0.01,
        cosine=0.999,
        sqnr_db=40.0,
        nonfinite=0,
    )
    row = Record.from_error("layers.0", "fw", (10,), error)
    return dataclasses.replace(row, **{metric: value})


def test_the_higher_is_better_metrics_are_the_ones_this_table_covers() -> None:
    assert {m for m, direction in METRIC_DIRECTIONS.items() if direction == "higher"} == set(HIGHER)


# (rtol, drift): large tolerances, with and without the drift rule this repository's pyproject sets (torch=2.0).
WIDE = [(0.1, 0.0), (1.0, 0.0), (1.5, 0.0), (5.0, 0.0), (0.1, 2.0), (1.5, 2.0), (5.0, 2.0)]


@pytest.mark.parametrize(("rtol", "drift"), WIDE)
@pytest.mark.parametrize("metric", HIGHER)
def test_a_large_rtol_and_a_drift_rule_bound_the_distance_from_perfect(metric: str, rtol: float, drift: float) -> None:
    atol = 1e-5
    rules = ToleranceRules(base=Tolerance(rtol=rtol, atol=atol), drift_rtol=drift)
    baseline = BASELINE[metric]
    limit = error64(metric, baseline) * (1.0 + rtol + drift) + atol  # the largest passing error
    assert allowed_value(metric, baseline, rules.for_metric("layers.0", "fw", metric)) == pytest.approx(
        value64(metric, limit), rel=1e-12
    )

    def violations(error: float) -> list[Violation]:
        obtained = value64(metric, error)
        check = check_against_baseline(
            {"bf16": [record(metric, baseline)]}, {"bf16": [record(metric, obtained)]}, rules, [metric]
        )
        return [v for v in check.violations if v.metric == metric]

    assert violations(limit * 0.99) == []
    (found,) = violations(limit * 1.01)
    assert found.reason == "regressed" and found.allowed == pytest.approx(value64(metric, limit), rel=1e-12)
    assert found.ratio == pytest.approx(limit * 1.01 / error64(metric, baseline), rel=1e-9)
    # 10x the baseline's error fails whenever the tolerance allows less than that (every case here but rtol 5
    # with drift 2, which allows 8x: then 10x fails, 7x passes); 100x always fails.
    ten_times = error64(metric, baseline) * 10
    assert bool(violations(ten_times)) is (ten_times > limit)
    assert violations(error64(metric, baseline) * 100) != []


@pytest.mark.parametrize("metric", HIGHER)
def test_the_pyproject_drift_rule_fails_a_value_that_used_to_pass(metric: str) -> None:
    """rtol 0.1 + torch=2.0: the old floor, baseline * (1 - 2.1), was negative and passed anything; now 3.1x."""
    tolerance = Tolerance(rtol=2.1, atol=1e-5)
    baseline = BASELINE[metric]
    worst = -1.0 if metric != "sqnr_db" else -30.0  # a correlation of -1, an SQNR of -30 dB: error everywhere
    assert is_worse(metric, baseline, worst, tolerance)
    assert is_worse(metric, baseline, value64(metric, error64(metric, baseline) * 4), tolerance)
    assert not is_worse(metric, baseline, value64(metric, error64(metric, baseline) * 3), tolerance)


@pytest.mark.parametrize("metric", HIGHER)
def test_the_default_tolerance_allows_a_tenth_more_error_not_ten_thousand_times(metric: str) -> None:
    """At the default rtol 0.1 a cosine of 0.99999 allowed 0.9 (1 - cosine 10,000x); now 1.1x + atol."""
    tolerance = Tolerance()
    baseline = 0.99999 if metric != "sqnr_db" else 100.0  # an error of 1e-5 either way
    limit = error64(metric, baseline) * 1.1 + 1e-5
    assert is_worse(metric, baseline, value64(metric, limit * 1.001), tolerance)
    assert not is_worse(metric, baseline, value64(metric, limit * 0.999), tolerance)
    assert is_worse(metric, baseline, 0.9 if metric != "sqnr_db" else 20.0, tolerance)


@pytest.mark.parametrize("metric", HIGHER)
def test_an_improvement_is_a_smaller_distance_from_perfect(metric: str) -> None:
    tolerance = Tolerance(rtol=0.1, atol=0.0)
    baseline = BASELINE[metric]
    floor = error64(metric, baseline) * 0.9
    assert is_better(metric, baseline, value64(metric, floor * 0.99), tolerance)
    assert not is_better(metric, baseline, value64(metric, floor * 1.01), tolerance)
    assert not is_better(metric, baseline, baseline, Tolerance(rtol=1.5, atol=0.0))


def test_edges_of_the_distance_from_perfect() -> None:
    # A perfect value a rounding step above 1 is no error (not a negative one that a perfect run would exceed).
    assert not is_worse("cosine", 1.0 + 2e-16, 1.0, Tolerance(rtol=0.0, atol=0.0))
    # An exact baseline (+inf dB, or 1) allows only atol: 1e-5 of amplitude is 100 dB, 1e-5 of 1 - cosine.
    assert allowed_value("sqnr_db", math.inf, Tolerance()) == pytest.approx(100.0)
    assert allowed_value("cosine", 1.0, Tolerance()) == pytest.approx(1.0 - 1e-5, abs=1e-15)
    # -inf dB (a zero reference, a non-zero variant) and dB beyond float range do not raise.
    assert not is_worse("sqnr_db", -math.inf, -math.inf, Tolerance())
    assert is_worse("sqnr_db", 30.0, -1e5, Tolerance()) and not is_worse("sqnr_db", -1e5, -1e5, Tolerance())
    # A correlation that turned negative is further than 1 from perfect.
    assert Violation("v", "t", "fw", "regressed", "correlation", 0.5, -0.5).ratio == pytest.approx(3.0)
