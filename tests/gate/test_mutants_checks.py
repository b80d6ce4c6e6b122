"""What a user reads when a drift rule is malformed, and the row a tensor that gained non-finite values gets in the
failure table (its baseline's count is what is allowed)."""

from __future__ import annotations

import pytest

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import Record, TensorError
from pytest_precision.gate.checks import check_against_baseline
from pytest_precision.gate.drift import parsed_drift_rtol
from pytest_precision.gate.tolerance import Violation
from pytest_precision.gate.tolerance_rules import ToleranceRules
from pytest_precision.plugin.messages import violation_table


@pytest.mark.parametrize("rule", ["torch2.0", "pytorch=2.0"])
def test_a_malformed_drift_rule_lists_the_fields_and_an_example(rule: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        parsed_drift_rtol(f"numpy=1 {rule}", "precision_drift_rtol")
    message = str(refused.value)
    assert message.startswith(f"precision_drift_rtol: {rule!r} is not FIELD=RTOL with FIELD one of torch, ")
    assert "torch, transformers, numpy, python, device, cpu_capability, threads, cuda, cudnn" in message
    assert message.endswith(" (e.g. 'torch=2.0')")


def _record(nonfinite: int) -> Record:
    """Tensor x (fw, 2x3) with rms_rel 0.01 and `nonfinite` NaN/Inf values where the reference is finite."""
    error = TensorError(6, 1.0, 0.01, 0.01, 0.03, 0.03, 0.0, 0.0, 0.99, 1.0, 0.01, 0.99, 40.0, nonfinite)
    return Record.from_error("x", "fw", (2, 3), error)


def test_more_nonfinite_values_allow_the_baselines_count() -> None:
    check = check_against_baseline({"fp16": [_record(1)]}, {"fp16": [_record(3)]}, ToleranceRules(), ["rms_rel"])
    assert check.violations == [Violation("fp16", "x", "fw", "nonfinite", "nonfinite", 1, 3, 1)]
    header, row = violation_table(check.violations)
    assert header.split()[-1] == "allowed"
    assert row.split() == ["fp16", "x", "fw", "nonfinite", "1", "3", "3.00x", "1"]
    # As many as the baseline had is no violation.
    assert check_against_baseline({"fp16": [_record(3)]}, {"fp16": [_record(3)]}, ToleranceRules()).violations == []
