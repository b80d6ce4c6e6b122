"""Baselines at scale: stale files, improvements and --precision-strict, environment drift, the session
report and the JUnit property."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree

import pytest
import torch
from plugin_testing import SIMPLE_TEST, baseline_file, degrade, failure, output, project, run, stale_lines

TWO_TESTS = """
import pytest
from tinymodel import run


def test_one(precision, assert_precision_within):
    assert_precision_within(run(precision))


@pytest.mark.precision_gpu
def test_gpu_only(precision, assert_precision_within):
    assert_precision_within(run(precision))
"""


def test_stale_baselines_are_listed_after_full_runs_only_and_pruned_on_request(pytester, monkeypatch):
    project(pytester, monkeypatch, test_two=TWO_TESTS)
    pytester.makeini("[pytest]\ntestpaths = .\n")
    run(pytester, "--update-baselines").assert_outcomes(passed=1, skipped=1)
    used = baseline_file(pytester, "test_two", "test_one")
    # A file no test owns, one owned by the skipped GPU test, and one of a test that no longer exists.
    orphan = baseline_file(pytester, "test_two", "test_removed")
    gpu_owned = baseline_file(pytester, "test_two", "test_gpu_only")
    for path, test in ((orphan, "test_two.py::test_removed"), (gpu_owned, "test_two.py::test_gpu_only")):
        document = json.loads(used.read_text())
        document["test"] = test
        path.write_text(json.dumps(document))

    result = run(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    assert stale_lines(result) == [
        "precision stale baselines: 1 (no test uses them; delete with --precision-prune):",
        "baselines/test_two/test_removed.cpu.json",
    ]
    # Partial runs report nothing: -k, a node id, -m.
    for args in (("-k", "one"), ("test_two.py::test_one",), ("-m", "not precision_gpu")):
        assert stale_lines(run(pytester, *args)) == [], args
    assert orphan.exists()

    result = run(pytester, "--precision-prune")
    assert stale_lines(result)[0] == "precision stale baselines: 1 (deleted (--precision-prune)):"
    assert not orphan.exists()
    assert used.exists() and gpu_owned.exists()


def test_improvements_are_reported_and_fail_only_with_strict(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    degrade(monkeypatch)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    monkeypatch.delenv("TINY_DEGRADE")

    result = run(pytester)
    result.assert_outcomes(passed=1)
    line = next(line for line in output(result).splitlines() if line.startswith("precision improved:"))
    assert line.startswith("precision improved: test_gate.py::test_name: ")
    assert line.endswith(
        "tensor(s) beyond tolerance; tighten the baseline with: pytest test_gate.py::test_name --update-baselines"
    )

    result = run(pytester, "--precision-strict")
    result.assert_outcomes(failed=1)
    section = failure(result, "test_name")
    assert section[0].startswith("precision improved beyond tolerance in ")
    assert section[0].endswith("(--precision-strict): tighten the baseline")
    assert section[-1] == "Tighten it with: pytest test_gate.py::test_name --update-baselines"

    result = run(pytester, "--update-baselines", "--precision-strict")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--update-baselines and --precision-strict" in output(result)


def test_environment_drift_warns_once_per_file_and_never_fails(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    document = json.loads(path.read_text())
    document["environment"]["torch"] = "2.0.0"
    document["environment"]["threads"] = 64
    path.write_text(json.dumps(document))
    result = run(pytester)
    result.assert_outcomes(passed=1)
    lines = [line for line in output(result).splitlines() if line.startswith("precision environment differs")]
    assert len(lines) == 1
    assert lines[0].startswith("precision environment differs from baselines/test_gate/test_name.cpu.json")
    assert f"torch: '2.0.0' in the baseline, {torch.__version__!r} now" in lines[0]
    assert "threads: 64 in the baseline" in lines[0]


def baseline_from_another_torch(pytester, factor: float, torch_version: str = "2.0.0") -> None:
    """Make the recorded baseline look measured on `torch_version` with every rms_rel `factor` times this run's."""
    path = baseline_file(pytester, "test_gate", "test_name")
    document = json.loads(path.read_text())
    document["environment"]["torch"] = torch_version
    for entry in document["variants"].values():
        for record in entry["records"]:
            if isinstance(record.get("rms_rel"), float) and record["rms_rel"] > 0:
                record["rms_rel"] *= factor
    path.write_text(json.dumps(document))


def test_a_drift_rule_widens_tolerances_only_while_the_environment_differs(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    change = f"torch: '2.0.0' in the baseline, {torch.__version__!r} now"
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    baseline_from_another_torch(pytester, 1 / 1.5)  # this run's error is 1.5x the baseline's

    # No rule: a regression, whose message names the version change and the rule that would allow for it.
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = "\n".join(failure(result, "test_name"))
    assert "precision regressed" in section
    assert f"The environment differs from the baseline's (numbers may move): {change}." in section
    assert 'precision_drift_rtol = "torch=2.0"' in section

    # A rule wide enough: passes, and the session says the tolerances were widened and why.
    result = run(pytester, "-o", "precision_drift_rtol=torch=1.0")
    result.assert_outcomes(passed=1)
    (line,) = [line for line in output(result).splitlines() if line.startswith("precision environment differs")]
    assert line.endswith(f"; tolerances widened by rtol +1 (precision_drift_rtol) for {change}")

    # A rule too narrow for the change: still a failure, which says the rule was applied.
    result = run(pytester, "--precision-drift-rtol", "torch=0.2 numpy=5")
    result.assert_outcomes(failed=1)
    assert "Environment drift: tolerances widened by rtol +0.2 (precision_drift_rtol) for torch" in output(result)

    # The same numbers recorded on this torch: the rule does not apply, the gate is as tight as ever.
    baseline_from_another_torch(pytester, 1.0, torch_version=torch.__version__)
    result = run(pytester, "-o", "precision_drift_rtol=torch=1.0")
    result.assert_outcomes(failed=1)
    assert "widened" not in output(result)
    assert "The environment differs" not in output(result)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("torch", "'torch' is not FIELD=RTOL"),
        ("pytorch=1", "'pytorch=1' is not FIELD=RTOL"),
        ("torch=nan", "the extra rtol must be a finite number >= 0"),
        ("torch=-1", "the extra rtol must be a finite number >= 0"),
        ("torch=inf", "the extra rtol must be a finite number >= 0"),
        ("torch=1,torch=2", "torch is given twice"),
    ],
)
def test_a_bad_drift_rule_is_a_usage_error_naming_the_option(pytester, monkeypatch, value, fragment):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    result = run(pytester, "-o", f"precision_drift_rtol={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "precision_drift_rtol: " in output(result) and fragment in output(result)


def test_session_report_and_junit_property(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    result = run(pytester, "--precision-report", "out", "--junitxml", "junit.xml")
    result.assert_outcomes(passed=1)
    assert "precision report: " in output(result)
    report = json.loads((pytester.path / "out" / "precision-report.json").read_text())
    entry = report["tests"]["test_gate.py::test_name"]
    assert entry["outcome"] == "passed"
    assert entry["baseline_outcome"] == "passed"
    assert entry["baseline"] == "baselines/test_gate/test_name.cpu.json"
    assert [r["name"] for r in entry["variants"]["bf16"]["records"]][:2] == ["embed", "blocks.0"]

    summary = (pytester.path / "out" / "summary.md").read_text()
    assert "### `test_gate.py::test_name`: passed" in summary
    png = pytester.path / "out" / "test_gate" / "test_name.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    properties = {
        p.get("name"): p.get("value") for p in ElementTree.parse(pytester.path / "junit.xml").iter("property")
    }
    ratio = float(properties["precision_worst_ratio"])
    assert ratio == pytest.approx(1.0)  # the same run as the baseline: every ratio is 1


def test_session_report_is_merged_from_xdist_workers(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_many="""
        import pytest
        from tinymodel import tiny_batch, tiny_model


        @pytest.mark.parametrize("seed", range(4))
        def test_seed(precision, assert_precision_within, seed):
            assert_precision_within(precision.run(tiny_model(seed), tiny_batch(seed), variants=["bf16"]))
        """,
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "--update-baselines", "--precision-report", "out"
    )
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 4 written"])
    report = json.loads((pytester.path / "out" / "precision-report.json").read_text())
    assert sorted(report["tests"]) == [f"test_many.py::test_seed[{i}]" for i in range(4)]
    assert {entry["baseline_outcome"] for entry in report["tests"].values()} == {"written"}


def test_without_matplotlib_the_plots_are_a_one_line_note(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    step_summary = pytester.path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    result = run(pytester, "--update-baselines", "--precision-report", "out")
    result.assert_outcomes(passed=1)
    assert "precision plots: skipped, matplotlib is not installed (pip install 'pytest-precision[plot]')" in output(
        result
    )
    assert not list((pytester.path / "out").rglob("*.png"))
    assert "### `test_gate.py::test_name`: passed" in step_summary.read_text()
