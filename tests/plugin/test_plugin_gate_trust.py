"""A green tick that cannot be wrong: undefined metrics, bad tolerances at every level, corrupt baselines,
the summary's regressions, limits in compare mode, exact loss scales, and comparisons nothing gated."""

from __future__ import annotations

import json

import pytest
from plugin_testing import (
    SIMPLE_TEST,
    assert_no_traceback,
    baseline_file,
    degrade,
    failure,
    output,
    project,
    run,
    table_rows,
)

# --- tolerances: command line, ini, marker, call, tolerances=, limits= -----------------------------------------


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        (["--precision-rtol", "nan"], "", "precision_rtol is NaN; give a number >= 0 (inf means no bound)"),
        (["--precision-atol=-1e-5"], "", "precision_atol must be >= 0, got '-1e-5'"),
        ([], "precision_atol = NaN", "precision_atol is NaN; give a number >= 0 (inf means no bound)"),
        ([], "precision_rtol = -0.5", "precision_rtol must be >= 0, got '-0.5'"),
    ],
)
def test_a_bad_tolerance_option_is_a_usage_error(pytester, monkeypatch, args, ini, message):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: {message}" in output(result)


BAD_SETTINGS = """
import pytest
from tinymodel import run

NAN = float("nan")


@pytest.mark.precision(rtol=NAN)
def test_marker_nan(precision, assert_precision_within):
    assert_precision_within(run(precision))


@pytest.mark.precision(atol="1e-5")
def test_marker_string(precision, assert_precision_within):
    assert_precision_within(run(precision))


def test_call_nan(precision, assert_precision_within):
    assert_precision_within(run(precision), rtol=NAN)


def test_call_negative(precision, assert_precision_within):
    assert_precision_within(run(precision), atol=-1)


def test_tolerances_nan(precision, assert_precision_within):
    assert_precision_within(run(precision), tolerances={"fw": {"rtol": NAN}})


def test_tolerances_not_a_dict(precision, assert_precision_within):
    assert_precision_within(run(precision), tolerances={"fw": 0.5})


def test_limit_nan(precision, assert_precision_within):
    assert_precision_within(run(precision), limits={"fw": {"rms_rel": NAN}})


def test_limit_none(precision, assert_precision_within):
    assert_precision_within(run(precision), limits={"fw": {"rms_rel": None}})
"""

BAD_SETTING_MESSAGES = {
    "test_marker_nan": "@pytest.mark.precision(rtol=...) is NaN; give a number (inf means no bound)",
    "test_marker_string": "@pytest.mark.precision(atol=...) must be a number, got '1e-5' (str)",
    "test_call_nan": "assert_precision_within(rtol=...) is NaN; give a number (inf means no bound)",
    "test_call_negative": "assert_precision_within(atol=...) must be >= 0, got -1",
    "test_tolerances_nan": "tolerances['fw']['rtol'] is NaN; give a number (inf means no bound)",
    "test_tolerances_not_a_dict": "tolerances['fw'] must be a dict like {'rtol': 0.2}, got 0.5",
    "test_limit_nan": "limits['fw']['rms_rel'] is NaN; give a number (inf means no bound)",
    "test_limit_none": "limits['fw']['rms_rel'] must be a number, got None (NoneType)",
}


@pytest.mark.parametrize("mode", [(), ("--update-baselines",)])
def test_a_bad_tolerance_anywhere_fails_its_test_naming_the_setting(pytester, monkeypatch, mode):
    project(pytester, monkeypatch, test_bad=BAD_SETTINGS)
    result = run(pytester, *mode)
    result.assert_outcomes(failed=len(BAD_SETTING_MESSAGES))
    for test, message in BAD_SETTING_MESSAGES.items():
        assert failure(result, test)[0] == f"ConfigurationError: {message}"
    assert_no_traceback(result)
    assert not (pytester.path / "baselines").exists()


def test_infinite_tolerance_on_the_command_line_passes_a_regression(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    degrade(monkeypatch)
    run(pytester).assert_outcomes(failed=1)
    run(pytester, "--precision-rtol", "inf").assert_outcomes(passed=1)


# --- undefined metrics -------------------------------------------------------------------------------------------

COLLAPSE_TEST = """
import os

from pytest_precision import Variant
from tinymodel import tiny_batch, tiny_model


def collapse_block_1(model):
    \"\"\"Block 1 outputs zeros: its correlation with the reference, and that of everything upstream in the
    backward pass, is undefined.\"\"\"
    forward = model.blocks[1].forward
    model.blocks[1].forward = lambda x: forward(x) * 0
    return model


def test_name(precision, assert_precision_within):
    prepare = collapse_block_1 if os.environ.get("COLLAPSE") else None
    variant = Variant(name="bf16", dtype="bfloat16", prepare=prepare)
    report = precision.run(tiny_model(), tiny_batch(), variants=[variant])
    assert_precision_within(report, metrics=["rms_rel", "correlation"])
"""


def test_a_metric_undefined_in_the_run_fails_and_is_never_written(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=COLLAPSE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    written = path.read_bytes()

    monkeypatch.setenv("COLLAPSE", "1")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_name")
    assert section[0].endswith("first: bf16 blocks.1 (fw)")
    assert section[1].startswith(
        "undefined in this run, nothing to hold against the baseline: bf16 blocks.1 (fw) correlation, "
    )
    rows = table_rows(section)
    # The baseline's correlation is shown with 3 digits of its distance from 1 (0.99999...), the run's undefined.
    assert ["bf16", "blocks.1", "fw", "correlation", "undefined"] in [row[:4] + row[5:6] for row in rows]
    assert_no_traceback(result)

    result = run(pytester, "--update-baselines")
    result.assert_outcomes(failed=1)
    section = failure(result, "test_name")
    assert section[0].startswith("not writing baselines/test_gate/test_name.cpu.json: ") and section[0].endswith(
        "gated tensor(s) have nothing to compare, a metric without a value (first in execution order first):"
    )
    assert section[1] == "  bf16  blocks.1 (fw): correlation undefined (1024 of 1024 values compared)"
    assert path.read_bytes() == written


def test_a_metric_undefined_in_the_baseline_fails(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=COLLAPSE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    data = json.loads(path.read_text())
    (record,) = [r for r in data["variants"]["bf16"]["records"] if (r["name"], r["kind"]) == ("blocks.1", "fw")]
    record["correlation"] = None
    path.write_text(json.dumps(data))
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_name")
    assert section[1] == (
        "undefined in the baseline but defined in this run (refresh the baseline if the change is intended): "
        "bf16 blocks.1 (fw) correlation"
    )
    assert [row[:5] for row in table_rows(section)] == [["bf16", "blocks.1", "fw", "correlation", "undefined"]]


# --- corrupt baselines -----------------------------------------------------------------------------------------


def test_a_nan_literal_in_a_baseline_is_a_baseline_error(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    data = json.loads(path.read_text())
    (record,) = [r for r in data["variants"]["bf16"]["records"] if (r["name"], r["kind"]) == ("blocks.1", "fw")]
    record["rms_rel"] = float("nan")
    path.write_text(json.dumps(data))  # Python writes NaN, which JSON does not have
    result = run(pytester)
    result.assert_outcomes(failed=1)
    assert failure(result, "test_name")[0] == (
        "BaselineError: precision baseline baselines/test_gate/test_name.cpu.json: variant 'bf16', tensor "
        "'blocks.1' (fw): field 'rms_rel' holds the literal NaN, which JSON does not allow (an undefined metric "
        'is null, an infinite one "inf" or "-inf"). Re-create it with: pytest test_gate.py::test_name '
        "--update-baselines"
    )
    assert_no_traceback(result)


def test_a_loss_scale_that_is_no_power_of_two_is_a_baseline_error(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    monkeypatch.setenv("TINY_VARIANTS", "fp16")
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    data = json.loads(path.read_text())
    data["variants"]["fp16"]["run"]["loss_scale"] = 3000.0
    path.write_text(json.dumps(data))
    result = run(pytester)
    result.assert_outcomes(failed=1)
    assert failure(result, "test_name")[0].startswith(
        "BaselineError: precision baseline baselines/test_gate/test_name.cpu.json: variant 'fp16': field "
        "'loss_scale' is 3000.0, not a finite positive power of two (or null)."
    )
    assert_no_traceback(result)


# --- exact loss scales -------------------------------------------------------------------------------------------

SCALE_TEST = """
import os

from tinymodel import tiny_batch, tiny_model


def small_loss(output, inputs):
    # 1/64 of the loss: gradients small enough for a scale of 2**21 not to overflow fp16.
    return output["loss"] / 64


def test_scaled(precision, assert_precision_within):
    given = {"loss_scale": float(os.environ["SCALE"])} if "SCALE" in os.environ else {}
    report = precision.run(tiny_model(), tiny_batch(), variants=["fp16"], loss_fn=small_loss, **given)
    assert report.runs["fp16"].loss_scale == 2.0**21
    assert_precision_within(report)
"""


def test_update_records_the_loss_scale_exactly_and_compare_reuses_it(pytester, monkeypatch):
    project(pytester, monkeypatch, test_scale=SCALE_TEST)
    monkeypatch.setenv("SCALE", str(2**21))
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_scale", "test_scaled")
    assert '"loss_scale": 2097152.0' in path.read_text()  # not 2.09715e+06
    monkeypatch.delenv("SCALE")
    run(pytester).assert_outcomes(passed=1)  # the recorded scale, read back exactly


# --- limits hold in compare mode -----------------------------------------------------------------------------------

LIMIT_IN_COMPARE = """
import os

from tinymodel import run


def test_name(precision, assert_precision_within):
    limits = {"head": {"rms_rel": 1e-9}} if os.environ.get("LIMIT") else None
    assert_precision_within(run(precision), limits=limits)
"""


def test_limits_fail_a_compare_run_whose_baseline_passes(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=LIMIT_IN_COMPARE)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    run(pytester).assert_outcomes(passed=1)
    monkeypatch.setenv("LIMIT", "1")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_name")
    assert section[0] == "precision limits exceeded by 2 tensor metric(s) (limits hold without a baseline)"
    assert [row[:5] for row in table_rows(section)] == [
        ["bf16", "head.bias", "grad", "rms_rel", "(limit)"],
        ["bf16", "head.weight", "grad", "rms_rel", "(limit)"],
    ]


# --- summary.md lists the gate's regressions -------------------------------------------------------------------

SUMMARY_TESTS = """
from tinymodel import run

EVERY_KIND = {kind: {"rtol": 100} for kind in ("fw", "logprob", "loss", "bw", "grad")}


def test_loose(precision, assert_precision_within):
    assert_precision_within(run(precision), rtol=100)


def test_per_tensor(precision, assert_precision_within):
    assert_precision_within(run(precision), tolerances=EVERY_KIND, metrics=["rms_rel", "max_rel"])


def test_default(precision, assert_precision_within):
    assert_precision_within(run(precision))
"""


def summary_sections(text: str) -> dict[str, str]:
    """{test id: its section of summary.md, from its title line on}."""
    return {block.split("`")[1]: block for block in text.split("\n### ")[1:]}


def test_summary_holds_each_test_to_the_tolerances_its_gate_used(pytester, monkeypatch):
    project(pytester, monkeypatch, test_sum=SUMMARY_TESTS)
    run(pytester, "--update-baselines").assert_outcomes(passed=3)
    degrade(monkeypatch)  # block 1 and what follows it move far more than 2x
    result = run(pytester, "--precision-report", "out")
    result.assert_outcomes(passed=2, failed=1)
    sections = summary_sections((pytester.path / "out" / "summary.md").read_text())
    for test in ("test_sum.py::test_loose", "test_sum.py::test_per_tensor"):
        assert sections[test].startswith(f"`{test}`: passed\n")
        assert "Against the baseline: 0 regression(s), " in sections[test]
        assert "Worst regressions" not in sections[test]
    assert "Against the baseline: 0 regression(s)" not in sections["test_sum.py::test_default"]
    assert "**Worst regressions**" in sections["test_sum.py::test_default"]

    report = json.loads((pytester.path / "out" / "precision-report.json").read_text())
    gates = {test: entry["gate"] for test, entry in report["tests"].items()}
    assert gates["test_sum.py::test_loose"] == {
        "base": {"atol": 1e-05, "rtol": 0.1},
        "base_metrics": {},
        "rtol": 100,
        "atol": None,
        "tolerances": [],
        "drift_rtol": 0.0,
        "metrics": ["rms_rel"],
    }
    assert gates["test_sum.py::test_per_tensor"]["tolerances"][0] == ["fw", {"rtol": 100}]
    assert gates["test_sum.py::test_per_tensor"]["metrics"] == ["rms_rel", "max_rel"]

    # Under xdist the gate's tolerances travel from the workers with the rest of each test's entry.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--precision-report", "xdist")
    result.assert_outcomes(passed=2, failed=1)
    sections = summary_sections((pytester.path / "xdist" / "summary.md").read_text())
    assert "Against the baseline: 0 regression(s), " in sections["test_sum.py::test_loose"]
    assert "Against the baseline: 0 regression(s), " in sections["test_sum.py::test_per_tensor"]


# --- precision.run that nothing gates ---------------------------------------------------------------------------

UNASSERTED_TESTS = """
from tinymodel import run


def test_unasserted(precision):
    run(precision)


def test_asserted(precision, assert_precision_within):
    assert_precision_within(run(precision))


def test_raises(precision):
    run(precision)
    raise ValueError("the test's own failure")
"""

UNASSERTED = (
    "test_unasserted.py::test_unasserted ran precision.run but never called assert_precision_within, so no "
    "baseline or limit gates its numbers: pass the report to assert_precision_within(report) (or call "
    "pytest_precision.compare directly when the test checks the report itself)"
)


def test_a_run_nothing_gates_warns_and_fails_under_strict(pytester, monkeypatch):
    project(pytester, monkeypatch, test_unasserted=UNASSERTED_TESTS)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=2, failed=1, warnings=1)
    text = output(result)
    assert f"PrecisionUnassertedWarning: {UNASSERTED}" in text
    assert "ValueError: the test's own failure" in text

    result = run(pytester, "--precision-strict")
    result.assert_outcomes(passed=1, failed=2)
    assert failure(result, "test_unasserted")[0] == UNASSERTED
    assert UNASSERTED not in "\n".join(failure(result, "test_raises"))
