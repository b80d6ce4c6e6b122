"""The gate's rules at their edges: undefined metrics, bad and infinite tolerances and limits, and the
one-line bugs (>= for >, + atol for - atol, min spread for max, last key for first, raw value for magnitude,
a constant reference's variance residue) that an earlier suite let through."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import Record, TensorError
from pytest_precision.gate.baseline import json_ready
from pytest_precision.gate.checks import check_against_baseline, check_limits, undefined_metrics, validated_limits
from pytest_precision.gate.tolerance import (
    NOISE_FACTOR,
    Tolerance,
    allowed_value,
    checked_number,
    is_better,
    is_worse,
    validated_metrics,
)
from pytest_precision.gate.tolerance_rules import ToleranceRules
from pytest_precision.numbers.metrics import tensor_error

ZERO = Tolerance(rtol=0.0, atol=0.0)


def record(
    name: str = "layers.0",
    kind: str = "fw",
    *,
    count: int = 10,
    shape: tuple[int, ...] = (10,),
    spread: float | None = None,
    nonfinite: int = 0,
    **metrics: float | None,
) -> Record:
    """A record with plausible metrics (rms_rel 0.01, slope 1, correlation 0.999, ...) overridden by `metrics`."""
    values: dict[str, float | None] = {
        "ref_rms": 1.0,
        "rms_abs": 0.01,
        "rms_rel": 0.01,
        "max_abs": 0.03,
        "max_rel": 0.03,
        "bias_abs": 0.001,
        "bias_rel": 0.001,
        "correlation": 0.999,
        "slope": 1.0,
        "residual_rms_rel": 0.01,
        "cosine": 0.999,
        "sqnr_db": 40.0,
    }
    values.update(metrics)
    error = TensorError(count=count, nonfinite=nonfinite, **values)  # type: ignore[arg-type]
    return Record.from_error(name, kind, shape, error, spread=spread)


def gate(before: Record, after: Record, rules: ToleranceRules | None = None, metrics: tuple[str, ...] = ("rms_rel",)):
    return check_against_baseline({"bf16": [before]}, {"bf16": [after]}, rules or ToleranceRules(), metrics)


# --- a constant reference: no fit metrics, whatever float64 leaves of its variance ---------------------------


def test_constant_reference_has_no_slope_or_correlation_despite_a_positive_variance_residue():
    reference = torch.full((999,), 5.906)
    noise = torch.randn(999, generator=torch.Generator().manual_seed(0)) * 1e-3
    variant = reference + noise
    x = reference.double().numpy()
    y = variant.double().numpy()
    # Why this value: sum(x^2)/n - mean(x)^2 in float64 is not 0 for it, so only the constant flag gives
    # var_x = 0 (0.1 or 3.3 happen to cancel exactly and would not catch a lost flag).
    assert (x * x).sum() / x.size - (x.sum() / x.size) ** 2 > 0
    error = tensor_error(reference, variant)
    assert error.slope is None and error.correlation is None and error.residual_rms_rel is None
    d = y - x
    # float32 partial sums (see metrics.py): ~1e-8 of their value
    assert error.rms_rel == pytest.approx(np.sqrt(np.mean(d * d)) / np.sqrt(np.mean(x * x)), rel=1e-6)
    cosine = (x @ y) / np.sqrt((x @ x) * (y @ y))
    assert error.cosine == pytest.approx(cosine, rel=1e-6)


# --- the worse-check at zero tolerance -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "value"),
    [("rms_rel", 0.0123), ("sqnr_db", 38.5), ("correlation", 0.9991), ("slope", 0.987), ("bias_rel", -0.004)],
)
def test_an_unchanged_value_passes_at_zero_tolerance(metric, value):
    assert not is_worse(metric, value, value, ZERO)
    assert not is_better(metric, value, value, ZERO)
    result = gate(record(**{metric: value}), record(**{metric: value}), ToleranceRules(base=ZERO), (metric,))
    assert result.violations == [] and result.improvements == []


@pytest.mark.parametrize(("metric", "worse"), [("rms_rel", 0.0124), ("sqnr_db", 38.4), ("slope", 0.986)])
def test_the_smallest_step_worse_fails_at_zero_tolerance(metric, worse):
    base = {"rms_rel": 0.0123, "sqnr_db": 38.5, "slope": 0.987}[metric]
    assert is_worse(metric, base, worse, ZERO)


# --- atol on a higher-is-better metric: an absolute allowance on its distance from perfect --------------------


def _error64(metric: str, value: float) -> np.float64:
    """The distance from perfect in float64 numpy: 1 - value, or the SQNR's amplitude 10^(-dB / 20)."""
    if metric == "sqnr_db":
        return np.power(np.float64(10.0), -np.float64(value) / 20.0)
    return np.float64(1.0) - np.float64(value)


@pytest.mark.parametrize(
    ("metric", "expected", "rtol", "atol"), [("sqnr_db", 40.0, 0.0, 0.01), ("cosine", 0.99, 0.01, 0.005)]
)
def test_atol_is_an_absolute_allowance_on_the_distance_from_perfect(metric, expected, rtol, atol):
    limit = _error64(metric, expected) * (1 + np.float64(rtol)) + np.float64(atol)
    floor = -20.0 * np.log10(limit) if metric == "sqnr_db" else 1.0 - limit  # the smallest passing value
    tolerance = Tolerance(rtol=rtol, atol=atol)
    assert allowed_value(metric, expected, tolerance) == pytest.approx(float(floor), rel=1e-12)
    assert not is_worse(metric, expected, float(floor) + 1e-6, tolerance)
    assert is_worse(metric, expected, float(floor) - 1e-6, tolerance)


# --- run-to-run spread: the larger of baseline's and run's -----------------------------------------------------


@pytest.mark.parametrize(("baseline_spread", "run_spread"), [(0.002, 0.0001), (0.0001, 0.002)])
def test_the_larger_spread_of_baseline_and_run_sets_the_noise_floor(baseline_spread, run_spread):
    rules = ToleranceRules(base=Tolerance(rtol=0.1, atol=0.0))
    before = record(rms_rel=0.01, spread=baseline_spread)
    # 0.0155 is within 0.01 + 3 * 0.002 = 0.016, beyond 0.01 * 1.1 and 0.01 + 3 * 0.0001.
    result = gate(before, record(rms_rel=0.0155, spread=run_spread), rules)
    assert result.violations == []
    allowed = result.worst_ratio
    assert allowed == pytest.approx(1.55)
    result = gate(before, record(rms_rel=0.0161, spread=run_spread), rules)
    assert [v.allowed for v in result.violations] == [pytest.approx(0.01 + NOISE_FACTOR * 0.002)]


# --- per-tensor tolerances: the first matching key wins --------------------------------------------------------


def test_the_first_matching_tolerance_key_wins():
    loose_first = ToleranceRules(base=ZERO, per_tensor={"fw": {"rtol": 5.0}, r"layers\.0": {"rtol": 0.0}})
    strict_first = ToleranceRules(base=ZERO, per_tensor={r"layers\.0": {"rtol": 0.0}, "fw": {"rtol": 5.0}})
    assert loose_first.for_tensor("layers.0", "fw") == Tolerance(rtol=5.0, atol=0.0)
    assert strict_first.for_tensor("layers.0", "fw") == Tolerance(rtol=0.0, atol=0.0)
    before, after = record(rms_rel=0.01), record(rms_rel=0.02)  # moved 2x
    assert gate(before, after, loose_first).violations == []
    assert [v.reason for v in gate(before, after, strict_first).violations] == ["regressed"]
    # A later key still applies to tensors the first does not match.
    assert loose_first.for_tensor("layers.0", "bw") == Tolerance(rtol=0.0, atol=0.0)


def test_tolerance_rules_round_trip_through_the_session_report_keeping_key_order():
    rules = ToleranceRules(
        base=Tolerance(rtol=0.2, atol=math.inf),
        rtol=None,
        atol=3e-6,
        per_tensor={"zeta": {"rtol": 1.0}, "alpha": {"atol": 0.5}},
    )
    written = json.dumps(json_ready(rules.to_dict()), sort_keys=True)
    assert ToleranceRules.from_dict(json.loads(written)) == rules
    assert list(ToleranceRules.from_dict(json.loads(written)).per_tensor) == ["zeta", "alpha"]


# --- limits bound the magnitude ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "value", "bound", "fails"),
    [
        ("bias_rel", -0.05, 0.01, True),  # |bias| = 0.05: beyond a raw-value comparison's reach
        ("bias_rel", 0.05, 0.01, True),
        ("bias_rel", -0.005, 0.01, False),
        ("slope", 1.005, 0.01, False),  # |1 - slope| = 0.005
        ("slope", 0.98, 0.01, True),  # |1 - slope| = 0.02
        ("slope", 1.02, 0.01, True),
        ("sqnr_db", 29.0, 30.0, True),  # a minimum
        ("sqnr_db", 31.0, 30.0, False),
        ("correlation", 0.95, 0.99, True),
    ],
)
def test_limits_bound_the_magnitude(metric, value, bound, fails):
    violations = check_limits({"bf16": [record(**{metric: value})]}, {"fw": {metric: bound}})
    assert [(v.name, v.metric, v.obtained, v.allowed) for v in violations] == (
        [("layers.0", metric, value, bound)] if fails else []
    )


# --- undefined metrics ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("undefined", [None, math.nan])
def test_a_metric_undefined_in_the_run_fails_where_the_baseline_has_a_number(undefined):
    result = gate(record(rms_rel=0.01), record(rms_rel=undefined), ToleranceRules(base=Tolerance(rtol=100.0)))
    assert [(v.reason, v.name, v.metric, v.expected, v.obtained) for v in result.violations] == [
        ("undefined", "layers.0", "rms_rel", 0.01, None)
    ]


def test_a_metric_undefined_in_the_baseline_fails_where_the_run_has_a_number():
    result = gate(record(correlation=None), record(correlation=0.99), metrics=("correlation",))
    assert [(v.reason, v.expected, v.obtained) for v in result.violations] == [("undefined", None, 0.99)]


def test_undefined_on_both_sides_passes_only_when_the_reference_explains_it():
    # A scalar loss: its reference is constant, so slope and correlation are undefined in every run.
    loss = record("loss", "loss", count=1, shape=(), slope=None, correlation=None, residual_rms_rel=None)
    assert gate(loss, loss, metrics=("rms_rel", "slope", "correlation")).violations == []
    assert undefined_metrics(loss, ("rms_rel", "slope", "correlation", "delta_rms")) == []
    # Nothing compared (every position masked): undefined in both, but no reason of the reference.
    empty = record(count=0, **dict.fromkeys(["ref_rms", "rms_abs", "rms_rel", "sqnr_db"]))
    assert undefined_metrics(empty, ("rms_rel", "nonfinite")) == ["rms_rel"]
    assert [v.reason for v in gate(empty, empty).violations] == ["undefined"]
    # A variant collapsed to a constant: correlation undefined where the reference is not constant.
    collapsed = record(correlation=None)
    assert undefined_metrics(collapsed, ("correlation",)) == ["correlation"]
    # An all-zero reference (a zero-initialised adapter's output): relative metrics undefined by the reference.
    zeros = record(ref_rms=0.0, rms_rel=None, cosine=None, slope=None, correlation=None)
    assert undefined_metrics(zeros, ("rms_rel", "cosine", "slope")) == []


def test_a_limit_on_an_undefined_metric_fails_unless_the_row_does_not_carry_it():
    collapsed = record(correlation=None)
    logprob = dataclasses.replace(record("logprob", "logprob"), delta_rms=0.01)
    violations = check_limits({"bf16": [collapsed, logprob]}, {".": {"correlation": 0.9, "delta_rms": 0.1}})
    assert [(v.name, v.metric, v.obtained) for v in violations] == [("layers.0", "correlation", None)]
    # A key whose tensors never carry the metric checks nothing: an error, not a pass.
    with pytest.raises(ConfigurationError, match=r"limits\['fw'\]\['delta_rms'\]: no tensor it applies to carries"):
        check_limits({"bf16": [collapsed]}, {"fw": {"delta_rms": 0.1}})


# --- bad and infinite tolerances and limits ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, "rtol is NaN; give a number (inf means no bound)"),
        ("0.1", "rtol must be a number, got '0.1' (str)"),
        (True, "rtol must be a number, got True (bool)"),
        (None, "rtol must be a number, got None (NoneType)"),
        ([0.1], "rtol must be a number, got [0.1] (list)"),
        (-0.1, "rtol must be >= 0, got -0.1"),
    ],
)
def test_a_tolerance_that_is_not_a_number_is_named(value, message):
    with pytest.raises(ConfigurationError) as raised:
        checked_number(value, "rtol", minimum=0.0)
    assert str(raised.value) == message
    with pytest.raises(ConfigurationError):
        Tolerance(rtol=value)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"rtol": math.nan}, "assert_precision_within(rtol=...) is NaN"),
        ({"atol": "1e-5"}, "assert_precision_within(atol=...) must be a number, got '1e-5'"),
        ({"per_tensor": {"fw": {"rtol": math.nan}}}, "tolerances['fw']['rtol'] is NaN"),
        ({"per_tensor": {"fw": {"atol": -1}}}, "tolerances['fw']['atol'] must be >= 0, got -1"),
        ({"per_tensor": {"fw": 0.1}}, "tolerances['fw'] must be a dict like {'rtol': 0.2}, got 0.1"),
        ({"per_tensor": [("fw", {"rtol": 1})]}, "tolerances must be a dict {tensor regex, kind or metric:"),
        ({"per_tensor": {3: {"rtol": 1}}}, "tolerances: key 3 must be a string"),
    ],
)
def test_bad_call_and_per_tensor_tolerances_are_named(rules, message):
    with pytest.raises(ConfigurationError) as raised:
        ToleranceRules(**rules)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"fw": {"rms_rel": math.nan}}, "limits['fw']['rms_rel'] is NaN"),
        ({"fw": {"rms_rel": "0.1"}}, "limits['fw']['rms_rel'] must be a number, got '0.1'"),
        ({"fw": {"rms_rel": None}}, "limits['fw']['rms_rel'] must be a number, got None"),
        ({"fw": {"rms_rel": -0.1}}, "limits['fw']['rms_rel'] must be >= 0, got -0.1"),
        ({"fw": {"rms_rel": -math.inf}}, "limits['fw']['rms_rel'] must be >= 0, got -inf"),
        ({"fw": {}}, "limits['fw'] must be a non-empty dict like {'rms_rel': 0.05}"),
        ({"fw": 0.1}, "limits['fw'] must be a non-empty dict"),
        ({"fw": {"rms_rell": 0.1}}, "metrics: unknown metric 'rms_rell'"),
        ([("fw", {"rms_rel": 1})], "limits must be a dict"),
    ],
)
def test_bad_limits_are_named(limits, message):
    with pytest.raises(ConfigurationError) as raised:
        validated_limits(limits)
    assert str(raised.value).startswith(message)
    with pytest.raises(ConfigurationError):
        check_limits({"bf16": [record()]}, limits)


def test_a_negative_minimum_is_a_valid_limit():
    assert validated_limits({"fw": {"sqnr_db": -5}}) == {"fw": {"sqnr_db": -5.0}}


def test_infinite_tolerance_never_fails_the_value_but_still_gates_the_rest():
    unbounded = ToleranceRules(base=Tolerance(rtol=math.inf))
    before = record(rms_rel=0.01, sqnr_db=40.0)
    assert gate(before, record(rms_rel=1e6, sqnr_db=-30.0), unbounded, ("rms_rel", "sqnr_db")).violations == []
    assert gate(before, record(rms_rel=1e-9), unbounded).improvements == []
    assert allowed_value("rms_rel", 0.01, Tolerance(atol=math.inf)) == math.inf
    assert allowed_value("sqnr_db", 40.0, Tolerance(atol=math.inf)) == -math.inf
    reasons = [v.reason for v in gate(before, record(rms_rel=0.01, nonfinite=1), unbounded).violations]
    assert reasons == ["nonfinite"]
    assert [v.reason for v in gate(before, record(rms_rel=None), unbounded).violations] == ["undefined"]
    assert [v.reason for v in gate(before, record(name="other"), unbounded).violations] == ["new", "missing"]


def test_an_infinite_limit_is_no_bound():
    worst = record(rms_rel=1e30, correlation=-1.0, bias_rel=-1e30)
    assert check_limits({"bf16": [worst]}, {"fw": {"rms_rel": math.inf, "bias_rel": math.inf}}) == []
    assert check_limits({"bf16": [worst]}, {"fw": {"correlation": -math.inf}}) == []


def test_exact_sqnr_baseline_with_rtol_one_still_gates():
    # An exact baseline (+inf dB) has no error to scale: any error now fails, up to atol of amplitude.
    tolerance = Tolerance(rtol=1.0, atol=0.0)
    assert allowed_value("sqnr_db", math.inf, tolerance) == math.inf
    assert is_worse("sqnr_db", math.inf, 200.0, tolerance) and not is_worse("sqnr_db", math.inf, math.inf, tolerance)
    loose = Tolerance(rtol=1.0, atol=1e-3)  # amplitude 1e-3 is 60 dB
    assert allowed_value("sqnr_db", math.inf, loose) == pytest.approx(60.0)
    assert is_worse("sqnr_db", math.inf, 59.9, loose) and not is_worse("sqnr_db", math.inf, 60.1, loose)


def test_metrics_given_as_one_string_is_one_metric_and_none_is_an_error():
    assert validated_metrics("rms_rel") == ["rms_rel"]
    with pytest.raises(ConfigurationError, match="metrics: empty"):
        validated_metrics([])
    with pytest.raises(ConfigurationError, match="unknown metric 3"):
        validated_metrics([3])  # type: ignore[list-item]


def test_infinite_rtol_holds_for_a_negative_higher_is_better_baseline():
    # sqnr_db below 0 (error louder than the signal): -5 * (1 - inf) would be +inf, a floor nothing meets.
    unbounded = ToleranceRules(base=Tolerance(rtol=math.inf, atol=0.0))
    result = gate(record(sqnr_db=-5.0), record(sqnr_db=-50.0), unbounded, ("sqnr_db",))
    assert result.violations == []
    # A finite rtol bounds the amplitude at (1 + rtol)x: -5 dB with rtol 10 allows 11x, to -25.8 dB.
    assert is_worse("sqnr_db", -5.0, -50.0, Tolerance(rtol=10.0, atol=0.0))
    assert not is_worse("sqnr_db", -5.0, -25.0, Tolerance(rtol=10.0, atol=0.0))


def test_messages_say_which_side_is_undefined_and_why():
    from pathlib import Path

    from pytest_precision.plugin.messages import UNDEFINED_CAUSES, limit_message, regression_message, undefined_message

    in_run = gate(record(rms_rel=0.01), record(rms_rel=None)).violations
    in_baseline = gate(record("head", rms_rel=None), record("head", rms_rel=0.02)).violations
    lines = regression_message(in_run + in_baseline, 2, Path("b.json"), "t.py::t", {}).splitlines()
    assert lines[1] == (
        f"undefined in this run, nothing to hold against the baseline: bf16 layers.0 (fw) rms_rel ({UNDEFINED_CAUSES})"
    )
    assert lines[2] == (
        "undefined in the baseline but defined in this run (refresh the baseline if the change is intended): "
        "bf16 head (fw) rms_rel"
    )
    assert lines[4].split() == ["bf16", "layers.0", "fw", "rms_rel", "0.01", "undefined"]
    assert lines[5].split() == ["bf16", "head", "fw", "rms_rel", "undefined", "0.02"]
    limits = check_limits({"bf16": [record(correlation=None)]}, {"fw": {"correlation": 0.9}})
    assert limit_message(limits, {}).splitlines()[2].split() == [
        "bf16", "layers.0", "fw", "correlation", "(limit)", "undefined", "0.9"
    ]  # fmt: skip
    empty = record(count=0, shape=(4, 8), rms_rel=None)
    refusal = undefined_message([("bf16", empty, ["rms_rel"])], Path("b.json")).splitlines()
    assert refusal[0].startswith("not writing b.json: 1 gated tensor(s) have nothing to compare")
    assert refusal[1] == "  bf16  layers.0 (fw): rms_rel undefined (0 of 32 values compared)"


# --- a bound met exactly, and the improvement threshold ----------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "value"), [("correlation", 0.99), ("sqnr_db", 30.0), ("rms_rel", 0.02), ("bias_rel", -0.02)]
)
def test_a_value_exactly_at_its_limit_passes(metric, value):
    """A limit is inclusive: a minimum (correlation, sqnr_db) or maximum (|value|) met exactly holds."""
    assert check_limits({"bf16": [record(**{metric: value})]}, {"fw": {metric: abs(value)}}) == []


@pytest.mark.parametrize(
    ("metric", "expected", "obtained", "improved"),
    [
        # higher is better: the error must fall below error * (1 - rtol) - atol, for correlation 0.1 * 0.9 - 1e-5
        # (above 0.91001), for 30 dB an amplitude of 10^-1.5 * 0.9 - 1e-5 (above 30.918 dB)
        ("correlation", 0.9, 0.91, False),
        ("correlation", 0.9, 0.9101, True),
        ("sqnr_db", 30.0, 30.9, False),
        ("sqnr_db", 30.0, 30.93, True),
        # lower is better: below expected * (1 - rtol) - atol = 0.01 * 0.9 - 1e-5
        ("rms_rel", 0.01, 0.0095, False),
        ("rms_rel", 0.01, 0.0089, True),
    ],
)
def test_an_improvement_must_clear_the_tolerance(metric, expected, obtained, improved):
    tolerance = Tolerance()
    assert is_better(metric, expected, obtained, tolerance) is improved
    assert not is_worse(metric, expected, obtained, tolerance)
    check = gate(record(**{metric: expected}), record(**{metric: obtained}), metrics=(metric,))
    assert [v.metric for v in check.improvements] == ([metric] if improved else [])
    assert check.violations == []


def test_a_nan_relative_metric_of_a_nonzero_reference_is_not_excused():
    """NaN on both sides with ref_rms > 0 is nothing compared, not a property of the reference: it fails, and an
    update refuses it."""
    nan = record(rms_rel=math.nan)
    assert undefined_metrics(nan, ["rms_rel"]) == ["rms_rel"]
    check = gate(nan, record(rms_rel=math.nan))
    assert [(v.reason, v.metric) for v in check.violations] == [("undefined", "rms_rel")]
    zero_reference = record(ref_rms=0.0, rms_rel=None)
    assert undefined_metrics(zero_reference, ["rms_rel"]) == []
    assert gate(zero_reference, record(ref_rms=0.0, rms_rel=None)).violations == []
