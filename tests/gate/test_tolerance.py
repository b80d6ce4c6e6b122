"""The regression and improvement rules, with and without a recorded run-to-run spread."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_precision.base.records import Record, TensorError
from pytest_precision.gate.checks import check_against_baseline
from pytest_precision.gate.tolerance import (
    NOISE_FACTOR,
    Tolerance,
    Violation,
    allowed_value,
    is_better,
    is_worse,
    parsed_level,
)
from pytest_precision.gate.tolerance_rules import ToleranceRules
from pytest_precision.plugin.messages import regression_message

TOL = Tolerance(rtol=0.1, atol=0.0)


def record(rms_rel: float, *, spread: float | None = None, nonfinite: int = 0, name: str = "layers.0") -> Record:
    error = TensorError(10, 1.0, rms_rel, rms_rel, None, None, None, None, None, None, None, None, None, nonfinite)
    return Record.from_error(name, "fw", (10,), error, spread=spread)


def test_lower_is_better_bounds():
    assert allowed_value("rms_rel", 0.01, TOL) == pytest.approx(0.011)
    assert is_worse("rms_rel", 0.01, 0.0111, TOL) and not is_worse("rms_rel", 0.01, 0.0109, TOL)
    assert is_better("rms_rel", 0.01, 0.0089, TOL) and not is_better("rms_rel", 0.01, 0.0091, TOL)


def test_higher_is_better_and_slope_are_mirrored():
    # sqnr_db compares its amplitude 10^(-dB / 20): 40 dB is 0.01, and 1.1x that is 39.17 dB.
    assert is_worse("sqnr_db", 40.0, 39.1, TOL) and not is_worse("sqnr_db", 40.0, 39.2, TOL)
    assert is_better("sqnr_db", 40.0, 41.0, TOL) and not is_better("sqnr_db", 40.0, 40.8, TOL)
    # slope compares |1 - slope|: 0.99 -> 0.985 is 1.5x further from 1.
    assert is_worse("slope", 0.99, 0.985, TOL) and not is_worse("slope", 0.99, 1.0105, TOL)


def test_spread_widens_the_tolerance_to_noise_factor_times_it():
    spread = 0.002  # runs of this tensor differed by 0.2% of relative error
    assert allowed_value("rms_rel", 0.01, TOL, spread) == pytest.approx(0.01 + NOISE_FACTOR * spread)
    assert not is_worse("rms_rel", 0.01, 0.0155, TOL, spread)
    assert is_worse("rms_rel", 0.01, 0.0161, TOL, spread)
    assert not is_better("rms_rel", 0.01, 0.0089, TOL, spread)  # within the noise: not an improvement


def test_check_uses_the_larger_spread_of_baseline_and_run():
    rules = ToleranceRules(base=TOL)
    before = {"bf16": [record(0.01, spread=0.002)]}
    result = check_against_baseline(before, {"bf16": [record(0.0155)]}, rules)
    assert result.violations == [] and result.improvements == []
    assert result.worst_ratio == pytest.approx(1.55)
    result = check_against_baseline({"bf16": [record(0.01)]}, {"bf16": [record(0.0155, spread=0.002)]}, rules)
    assert result.violations == []
    result = check_against_baseline({"bf16": [record(0.01)]}, {"bf16": [record(0.0155)]}, rules)
    assert [v.reason for v in result.violations] == ["regressed"]
    result = check_against_baseline({"bf16": [record(0.01)]}, {"bf16": [record(0.005)]}, rules)
    assert [v.reason for v in result.improvements] == ["improved"] and result.violations == []


def test_nonfinite_always_fails_and_the_message_names_where_it_started():
    rules = ToleranceRules(base=Tolerance(rtol=100.0, atol=1.0))
    result = check_against_baseline({"fp16": [record(0.01)]}, {"fp16": [record(0.01, nonfinite=3)]}, rules)
    assert [v.reason for v in result.violations] == ["nonfinite"]
    message = regression_message(
        result.violations,
        result.gated,
        Path("baselines/t.cpu.json"),
        "t.py::t",
        {},
        {"fp16": "model.layers.1.mlp.down_proj (fw)"},
    )
    lines = message.splitlines()
    assert lines[1] == "non-finite values (NaN/Inf) where the baseline had none: fp16 layers.0 (fw)"
    assert lines[2] == "  fp16: first non-finite output from finite inputs in model.layers.1.mlp.down_proj (fw)"


def test_violation_ratio_in_the_worse_direction():
    assert Violation("v", "t", "fw", "regressed", "rms_rel", 0.01, 0.02).ratio == pytest.approx(2.0)
    # Higher-is-better metrics: the ratio of distances from perfect (amplitudes for sqnr_db).
    assert Violation("v", "t", "fw", "regressed", "sqnr_db", 40.0, 20.0).ratio == pytest.approx(10.0)
    assert Violation("v", "t", "fw", "regressed", "cosine", 0.999, 0.99).ratio == pytest.approx(10.0)
    assert Violation("v", "t", "fw", "improved", "top1_agreement", 0.9, 0.95).ratio == pytest.approx(0.5)


def test_one_number_and_each_metric_once_parse():
    """The counterpart of test_metric_tolerances.test_bad_option_text_is_named's "given twice" cases."""
    assert parsed_level("0.1 max_rel=0.5 rms_rel=0.2", "x") == (0.1, {"max_rel": 0.5, "rms_rel": 0.2})
