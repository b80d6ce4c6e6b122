"""Environment-drift rules: parsing, which differing fields grant an allowance, and how it widens tolerances."""

from __future__ import annotations

import json

import pytest

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.gate.drift import DRIFT_RULE_FIELDS, drift_allowance, environment_differences, parsed_drift_rtol
from pytest_precision.gate.tolerance import Tolerance
from pytest_precision.gate.tolerance_rules import ToleranceRules

BASELINE = {"torch": "2.13.0+cpu", "transformers": "5.25.0", "threads": 2, "device": "cpu: x86_64"}


def test_rules_parse_with_spaces_or_commas() -> None:
    assert parsed_drift_rtol("torch=2.0, transformers=0.5 threads=0", "s") == {
        "torch": 2.0,
        "transformers": 0.5,
        "threads": 0.0,
    }
    assert parsed_drift_rtol("", "s") == {}
    assert "torch" in DRIFT_RULE_FIELDS and "backend" not in DRIFT_RULE_FIELDS


@pytest.mark.parametrize("text", ["torch", "torch=", "backend=1", "torch=x", "torch=nan", "torch=-0.1", "torch=inf"])
def test_bad_rules_name_the_setting(text: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^where: "):
        parsed_drift_rtol(text, "where")


def test_no_allowance_when_nothing_ruled_differs() -> None:
    assert drift_allowance({"torch": 2.0}, BASELINE, dict(BASELINE)) is None
    assert drift_allowance({"torch": 2.0}, BASELINE, {**BASELINE, "threads": 8}) is None  # threads has no rule
    assert drift_allowance({}, BASELINE, {**BASELINE, "torch": "2.6.0"}) is None
    assert drift_allowance({"torch": 0.0}, BASELINE, {**BASELINE, "torch": "2.6.0"}) is None


def test_the_largest_rule_among_differing_fields_applies() -> None:
    now = {**BASELINE, "torch": "2.6.0", "transformers": "4.56.0"}
    allowance = drift_allowance({"torch": 2.0, "transformers": 0.5, "threads": 9.0}, BASELINE, now)
    assert allowance is not None
    assert allowance.rtol == 2.0
    assert allowance.fields == (("torch", "2.13.0+cpu", "2.6.0"), ("transformers", "5.25.0", "4.56.0"))
    assert allowance.describe() == (
        "tolerances widened by rtol +2 (precision_drift_rtol) for torch: '2.13.0+cpu' in the baseline, '2.6.0' now; "
        "transformers: '5.25.0' in the baseline, '4.56.0' now"
    )


def test_a_field_the_baseline_lacks_does_not_count_as_differing() -> None:
    old = {k: v for k, v in BASELINE.items() if k != "transformers"}
    assert drift_allowance({"transformers": 1.0}, old, BASELINE) is None


def test_the_allowance_adds_to_every_rtol_and_survives_the_report_round_trip() -> None:
    rules = ToleranceRules(base=Tolerance(rtol=0.1, atol=1e-5), rtol={"max_rel": 0.5}, drift_rtol=2.0)
    assert rules.for_metric("x", "fw", "rms_rel") == Tolerance(rtol=2.1, atol=1e-5)
    assert rules.for_metric("x", "fw", "max_rel") == Tolerance(rtol=2.5, atol=1e-5)
    again = ToleranceRules.from_dict(json.loads(json.dumps(rules.to_dict())))
    assert again == rules
    assert ToleranceRules.from_dict({}).drift_rtol == 0.0
    with pytest.raises(ConfigurationError, match="drift_rtol"):
        ToleranceRules(drift_rtol=float("nan"))


def test_environment_differences_list_each_drift_field_that_differs() -> None:
    recorded = {"torch": "2.13.0+cpu", "threads": 2, "device": "cpu: x86_64"}
    current = {"torch": "2.6.0", "threads": 2, "device": "cpu: x86_64", "world_size": 1, "mesh": None}
    assert environment_differences(recorded, current) == ["torch: '2.13.0+cpu' in the baseline, '2.6.0' now"]
    # world_size is absent from old baselines: it counts as 1, so a 2-rank run differs and a 1-rank one does not.
    assert environment_differences(recorded, {**current, "torch": "2.13.0+cpu", "world_size": 2}) == [
        "world_size: 1 in the baseline, 2 now"
    ]
    assert environment_differences(dict(current), dict(current)) == []
