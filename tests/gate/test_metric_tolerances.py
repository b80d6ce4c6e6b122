"""Tolerances per metric, and per tensor and metric together: their precedence, parsing and round trip."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from test_gate_rules import record

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.gate.baseline import json_ready
from pytest_precision.gate.checks import check_against_baseline
from pytest_precision.gate.tolerance import Tolerance, level_text, merged_levels, parsed_level
from pytest_precision.gate.tolerance_rules import ToleranceRules

ZERO = Tolerance(rtol=0.0, atol=0.0)


def gate(before, after, rules: ToleranceRules, metrics: tuple[str, ...]):
    return check_against_baseline({"bf16": [before]}, {"bf16": [after]}, rules, metrics)


def test_a_loose_max_rel_beside_a_strict_rms_rel():
    """The reason for per-metric tolerances: max is noisier than RMS, so gating both used to force max's
    tolerance onto RMS."""
    rules = ToleranceRules(base=Tolerance(rtol=0.1, atol=0.0), per_tensor={"max_rel": {"rtol": 1.0}})
    before = record(rms_rel=0.01, max_rel=0.05)
    # max_rel grew 1.8x (within rtol 1.0), rms_rel 1.05x (within 0.1): passes.
    assert gate(before, record(rms_rel=0.0105, max_rel=0.09), rules, ("rms_rel", "max_rel")).violations == []
    # rms_rel grew 1.5x: fails on rms_rel only, with rms_rel's own allowed value.
    violations = gate(before, record(rms_rel=0.015, max_rel=0.09), rules, ("rms_rel", "max_rel")).violations
    assert [(v.metric, v.allowed) for v in violations] == [("rms_rel", pytest.approx(0.011))]
    # max_rel grew 2.2x, beyond its own rtol 1.0.
    violations = gate(before, record(rms_rel=0.01, max_rel=0.11), rules, ("rms_rel", "max_rel")).violations
    assert [(v.metric, v.allowed) for v in violations] == [("max_rel", pytest.approx(0.1))]


def test_precedence_call_then_tensor_and_metric_then_tensor_then_metric_then_session_levels():
    rules = ToleranceRules(
        base=Tolerance(rtol=0.1, atol=1e-5),
        rtol={"sqnr_db": 0.9},
        per_tensor={
            "mlp": {"rtol": 0.3, "max_rel": {"rtol": 0.4}},
            "max_rel": {"rtol": 0.5, "atol": 0.25},
            "fw": {"atol": 0.125},
        },
        base_metrics={"max_rel": {"rtol": 0.6}, "cosine": {"rtol": 0.7, "atol": 0.75}},
    )
    # 1. the call's dict, for the metric it names, above everything.
    assert rules.for_metric("layers.0.mlp", "fw", "sqnr_db") == Tolerance(rtol=0.9, atol=1e-5)
    # 2. the first tensor key that matches, its entry for the metric; atol is not in that entry, so the
    #    metric key (3.) gives it.
    assert rules.for_metric("layers.0.mlp", "fw", "max_rel") == Tolerance(rtol=0.4, atol=0.25)
    # the tensor entry's own rtol for other metrics; the first matching key ends the search ("fw" is not seen).
    assert rules.for_metric("layers.0.mlp", "fw", "rms_rel") == Tolerance(rtol=0.3, atol=1e-5)
    # 3. a metric key applies to every tensor; "fw" gives this tensor its atol first.
    assert rules.for_metric("layers.0.attn", "fw", "max_rel") == Tolerance(rtol=0.5, atol=0.125)
    # 4. session per-metric values, 5. the session's number.
    assert rules.for_metric("layers.0.attn", "bw", "cosine") == Tolerance(rtol=0.7, atol=0.75)
    assert rules.for_metric("layers.0.attn", "bw", "rms_rel") == Tolerance(rtol=0.1, atol=1e-5)
    # A call-level number beats every per-metric entry.
    assert ToleranceRules(rtol=0.0, per_tensor={"max_rel": {"rtol": 5.0}}).for_metric("x", "fw", "max_rel").rtol == 0


def test_a_key_named_like_a_metric_is_never_a_regex():
    # "rms_rel" as a regex would match a tensor named "block.rms_rel"; as a metric key it applies to rms_rel only.
    rules = ToleranceRules(base=ZERO, per_tensor={"rms_rel": {"rtol": 5.0}})
    assert rules.for_metric("block.rms_rel", "fw", "max_rel") == ZERO
    assert rules.for_metric("anything", "bw", "rms_rel") == Tolerance(rtol=5.0, atol=0.0)


def test_session_levels_merge_a_higher_number_over_lower_per_metric_values():
    ini = parsed_level("0.2, max_rel=0.5 sqnr_db=inf", "precision_rtol")
    assert ini == (0.2, {"max_rel": 0.5, "sqnr_db": math.inf})
    # The marker's number replaces the ini level whole, per-metric values included.
    assert merged_levels(ini, 0.3) == (0.3, {})
    # The marker's per-metric values replace the ini's for those metrics only.
    assert merged_levels(ini, {"max_rel": 0.9, "cosine": 0.1}) == (
        0.2,
        {"max_rel": 0.9, "sqnr_db": math.inf, "cosine": 0.1},
    )
    assert merged_levels(ini, None) == ini
    assert parsed_level(level_text(ini), "x") == ini
    assert parsed_level("max_abs=1e-3", "x") == (None, {"max_abs": 1e-3})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", "precision_rtol must be a number, got 'lots'"),
        ("max_rel=nan", "precision_rtol is NaN"),
        ("0.1 max_rel=-1", "precision_rtol must be >= 0, got '0.1 max_rel=-1'"),
        ("max_rell=0.5", "precision_rtol: unknown metric 'max_rell'"),
        ("nonfinite=1", "precision_rtol: nonfinite takes no tolerance"),
        ("ref_rms=1", "precision_rtol: unknown metric 'ref_rms'"),
        # Given twice at one level: the last would win, "0.1 50" gating at rtol 50.
        ("max_rel=0.1 max_rel=50", "precision_rtol: max_rel is given twice in 'max_rel=0.1 max_rel=50'"),
        ("max_rel=0.1, max_rel=0.1", "precision_rtol: max_rel is given twice in"),  # even the same value
        ("0.1 50", "precision_rtol: two numbers for every metric in '0.1 50'"),
        ("0.1, 0.1", "precision_rtol: two numbers for every metric in"),
        ("0.1, max_rel=0.5 inf", "precision_rtol: two numbers for every metric in"),
    ],
)
def test_bad_option_text_is_named(text, message):
    with pytest.raises(ConfigurationError) as raised:
        parsed_level(text, "precision_rtol")
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"rtol": {"max_rel": math.nan}}, "assert_precision_within(rtol=...)['max_rel'] is NaN"),
        ({"atol": {"max_rell": 1.0}}, "assert_precision_within(atol=...): unknown metric 'max_rell'"),
        ({"per_tensor": {"max_rel": {"max_abs": {"rtol": 1}}}}, "tolerances['max_rel']: unknown key 'max_abs'; use"),
        ({"per_tensor": {"fw": {"max_rel": 0.5}}}, "tolerances['fw']['max_rel'] must be a dict like {'rtol': 0.2}"),
        ({"per_tensor": {"fw": {"max_rel": {"rtl": 0.5}}}}, "tolerances['fw']['max_rel']: unknown key(s) rtl"),
        ({"per_tensor": {"fw": {"max_rel": {"rtol": -1}}}}, "tolerances['fw']['max_rel']['rtol'] must be >= 0"),
        ({"per_tensor": {"nonfinite": {"rtol": 1}}}, "tolerances['nonfinite']: nonfinite takes no tolerance"),
        ({"per_tensor": {"fw": {"nonfinite": {"rtol": 1}}}}, "tolerances['fw']['nonfinite']: nonfinite takes no"),
    ],
)
def test_bad_per_metric_tolerances_are_named(rules, message):
    with pytest.raises(ConfigurationError) as raised:
        ToleranceRules(**rules)
    assert str(raised.value).startswith(message)


def test_the_metrics_a_call_names():
    rules = ToleranceRules(
        rtol={"max_rel": 1.0}, per_tensor={"cosine": {"rtol": 1.0}, "fw": {"rtol": 1.0, "sqnr_db": {"atol": 1.0}}}
    )
    assert rules.named_metrics() == {"max_rel", "cosine", "sqnr_db"}
    assert ToleranceRules(rtol=1.0, per_tensor={"fw": {"rtol": 1.0}}).named_metrics() == set()


def test_per_metric_rules_round_trip_through_the_session_report():
    rules = ToleranceRules(
        base=Tolerance(rtol=0.2, atol=math.inf),
        rtol={"max_rel": math.inf},
        atol=3e-6,
        per_tensor={"zeta": {"rtol": 1.0, "max_rel": {"atol": 0.5}}, "cosine": {"rtol": 0.25}},
        base_metrics={"sqnr_db": {"rtol": 0.125}},
    )
    written = json.dumps(json_ready(rules.to_dict()), sort_keys=True)
    back = ToleranceRules.from_dict(json.loads(written))
    assert back == rules
    assert list(back.per_tensor) == ["zeta", "cosine"]
    for metric in ("max_rel", "rms_rel", "cosine", "sqnr_db"):
        assert back.for_metric("zeta.1", "fw", metric) == rules.for_metric("zeta.1", "fw", metric)


def test_rules_written_before_per_metric_tolerances_still_read():
    old = {"base": {"rtol": 0.1, "atol": 1e-5}, "rtol": None, "atol": 0.5, "tolerances": [["fw", {"rtol": 2.0}]]}
    rules = ToleranceRules.from_dict(old)
    assert rules.for_metric("x", "fw", "max_rel") == Tolerance(rtol=2.0, atol=0.5)


def test_a_gate_or_limit_on_a_metric_no_record_carries_is_an_error_not_a_pass():
    """Range statistics exist only with compare(range_stats=True), log-probability metrics only on logprob
    rows: gating them on a run without them would pass having checked nothing."""
    from pytest_precision.gate.checks import check_carried, check_limits

    run = {"bf16": [record(), record(name="lm_head")]}
    with pytest.raises(ConfigurationError, match=r"limits\['fw'\]\['underflow_frac'\]: no tensor"):
        check_limits(run, {"fw": {"underflow_frac": 0.01}})
    with pytest.raises(ConfigurationError, match="range statistics need compare"):
        check_carried(run, ["rms_rel", "overflow_frac"])
    with pytest.raises(ConfigurationError, match=r"metrics: 'kl_mean' is gated, but .*logprob rows"):
        check_carried(run, ["kl_mean"])
    # One record carrying it is enough: the others are skipped as before.
    layer = dataclasses.replace(record(), underflow_frac=0.5)
    carried = {"bf16": [layer, record(name="lm_head")]}
    check_carried(carried, ["underflow_frac"])
    assert [v.name for v in check_limits(carried, {"fw": {"underflow_frac": 0.25}})] == ["layers.0"]
