"""The review workflow: tolerances per metric at every level, default gated metrics from the ini, update modes,
stale files that fail the session, and what the session report and summary.md say about the environment."""

from __future__ import annotations

import json
import subprocess

import pytest
from plugin_testing import (
    SIMPLE_TEST,
    baseline_file,
    degrade,
    failed_tests,
    gate_tests,
    output,
    project,
    run,
    stale_lines,
)

TWO_TESTS = """
import math

import pytest
from tinymodel import run


def test_default(precision, assert_precision_within):
    assert_precision_within(run(precision))


@pytest.mark.precision(rtol={"rms_rel": math.inf, "max_rel": math.inf})
def test_marker(precision, assert_precision_within):
    assert_precision_within(run(precision))
"""


@pytest.mark.parametrize(
    ("ini", "args", "failed"),
    [
        # The ini gates rms_rel and max_rel; an inf rtol for one of them leaves the other failing.
        ("precision_metrics = rms_rel max_rel", ["--precision-rtol", "rms_rel=inf"], ["test_default"]),
        ("precision_metrics = rms_rel,max_rel", ["--precision-rtol=rms_rel=inf max_rel=inf"], []),
        # A number for every metric, then a per-metric value that is stricter for one of them.
        ("precision_metrics = rms_rel max_rel\nprecision_rtol = inf max_rel=0", [], ["test_default"]),
        # The marker's dict covers both metrics, above the ini's strict max_rel.
        ("precision_metrics = rms_rel max_rel\nprecision_rtol = max_rel=0", [], ["test_default"]),
        # Only rms_rel gated (the default): the marker's max_rel entry is unused, rms_rel's inf passes it.
        ("", [], ["test_default"]),
    ],
)
def test_per_metric_tolerances_from_ini_command_line_and_marker(pytester, monkeypatch, ini, args, failed):
    project(pytester, monkeypatch, test_levels=TWO_TESTS)
    run(pytester, "--update-baselines").assert_outcomes(passed=2)
    degrade(monkeypatch)  # block 1 rounded to float8: rms_rel and max_rel both grow many times
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    result = run(pytester, *args)
    assert failed_tests(result) == failed, output(result)


def test_a_tolerance_for_a_metric_the_gate_does_not_check_is_an_error(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_unused="""
        from tinymodel import run


        def test_unused(precision, assert_precision_within):
            assert_precision_within(run(precision), tolerances={"max_rel": {"rtol": 0.5}})


        def test_used(precision, assert_precision_within):
            assert_precision_within(run(precision), metrics=["rms_rel", "max_rel"], rtol={"max_rel": 0.5})
        """,
    )
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    assert (
        "ConfigurationError: assert_precision_within: tolerances for max_rel, which the gate does not check (it "
        "gates rms_rel); add them to metrics=[...] or drop their tolerances"
    ) in output(result)


@pytest.mark.parametrize(
    ("ini", "args", "message"),
    [
        ("", ["--precision-update-mode", "failing"], "--precision-update-mode=failing chooses what --update-baselines"),
        ("precision_update_mode = some", ["--update-baselines"], "precision_update_mode must be one of all, failing"),
        ("precision_metrics = rms_rel max_rell", [], "precision_metrics: metrics: unknown metric 'max_rell'"),
        ("", ["--precision-rtol", "max_rel=nan"], "precision_rtol is NaN"),
    ],
)
def test_bad_review_options_are_usage_errors(pytester, monkeypatch, ini, args, message):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in output(result)


UPDATE_TESTS = gate_tests("test_moved", "test_failing", "test_new")


def _nudge(path, factor, others=None):
    """Scale every rms_rel of a baseline file by `factor` (the first one only when `others` scales the rest):
    1.01 stays within tolerance, 0.01 makes the run 100x worse than the file, 100 100x better."""
    document = json.loads(path.read_text())
    first = True
    for variant in document["variants"].values():
        for entry in variant["records"]:
            if entry.get("rms_rel"):
                entry["rms_rel"] *= factor if first or others is None else others
                first = False
    path.write_text(json.dumps(document, indent=1))
    return path.read_bytes()


@pytest.mark.parametrize("mode", ["all", "failing", "missing"])
def test_update_modes_rewrite_all_failing_or_missing_files(pytester, monkeypatch, mode):
    project(pytester, monkeypatch, test_update=UPDATE_TESTS)
    run(pytester, "--update-baselines").assert_outcomes(passed=3)
    moved = baseline_file(pytester, "test_update", "test_moved")
    failing = baseline_file(pytester, "test_update", "test_failing")
    new = baseline_file(pytester, "test_update", "test_new")
    written = moved.read_bytes()
    # test_failing regresses on its first tensor and improves on all others.
    moved_bytes, failing_bytes = _nudge(moved, 1.01), _nudge(failing, 0.01, others=100.0)
    new.unlink()

    result = run(pytester, "--update-baselines", f"--precision-update-mode={mode}")
    summary = next(line for line in output(result).splitlines() if line.startswith("precision baselines (update"))
    if mode == "all":
        result.assert_outcomes(passed=3)
        assert moved.read_bytes() == written and failing.read_bytes() != failing_bytes
        assert summary.endswith("1 written, 2 updated")
    elif mode == "failing":
        # The file within tolerance is kept as it is; the failing one is rewritten, the missing one written.
        result.assert_outcomes(passed=3)
        assert moved.read_bytes() == moved_bytes and failing.read_bytes() != failing_bytes
        assert summary.endswith("1 written, 1 updated, 1 kept")
        # Rewritten, its file holds this run's numbers: no "improved, tighten the baseline" line for it.
        assert "precision improved" not in output(result)
    else:
        # Only the missing file is written; the failing test still fails, its file untouched.
        result.assert_outcomes(passed=2, failed=1)
        assert failed_tests(result) == ["test_failing"]
        assert moved.read_bytes() == moved_bytes and failing.read_bytes() == failing_bytes
        assert summary.endswith("1 written, 1 passed, 1 failed")
        assert "precision improved: test_update.py::test_failing: " in output(result)
    assert new.is_file()


def test_update_failing_rewrites_a_corrupt_baseline_and_keeps_refusing_nan(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    path.write_text("{ half a file")
    run(pytester, "--update-baselines", "--precision-update-mode", "failing").assert_outcomes(passed=1)
    assert json.loads(path.read_text())["test"] == "test_gate.py::test_name"
    pytester.makeini("[pytest]\nprecision_update_mode = failing\n")
    run(pytester, "--update-baselines").assert_outcomes(passed=1)  # the ini mode alone, without the flag: fine
    run(pytester).assert_outcomes(passed=1)


STALE_TESTS = gate_tests("test_kept", "test_removed")


def test_stale_baselines_fail_the_session_with_fail_stale_or_strict(pytester, monkeypatch):
    project(pytester, monkeypatch, test_stale=STALE_TESTS)
    pytester.makeini("[pytest]\ntestpaths = .\n")
    run(pytester, "--update-baselines").assert_outcomes(passed=2)
    pytester.makepyfile(test_stale=gate_tests("test_kept"))
    stale = baseline_file(pytester, "test_stale", "test_removed")

    result = run(pytester)
    assert result.ret == pytest.ExitCode.OK
    assert stale_lines(result)[1:] == ["baselines/test_stale/test_removed.cpu.json"]
    for args in (["--precision-fail-stale"], ["--precision-strict"]):
        result = run(pytester, *args)
        result.assert_outcomes(passed=1)
        assert result.ret == pytest.ExitCode.TESTS_FAILED, args
        assert "precision error: 1 stale baseline file(s) (listed above) and --precision-fail-stale or " in output(
            result
        )
    # A partial run never calls a file stale, so it never fails for one.
    assert run(pytester, "--precision-fail-stale", "-k", "kept").ret == pytest.ExitCode.OK
    pytester.makeini("[pytest]\ntestpaths = .\nprecision_fail_stale = true\n")
    assert run(pytester).ret == pytest.ExitCode.TESTS_FAILED
    # Pruned, the stale file is gone and the session passes.
    result = run(pytester, "--precision-prune")
    assert result.ret == pytest.ExitCode.OK
    assert not stale.exists()


def _git(pytester: pytest.Pytester, *arguments: str) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *arguments]
    return subprocess.run(command, cwd=pytester.path, check=True, capture_output=True, text=True).stdout.strip()


def test_session_report_and_summary_carry_environment_stale_files_drift_and_plot_links(pytester, monkeypatch):
    pytest.importorskip("matplotlib")
    from pytest_precision.reports.environment import git_state

    project(pytester, monkeypatch, test_stale=STALE_TESTS)
    pytester.makeini("[pytest]\ntestpaths = .\n")
    _git(pytester, "init", "-q")
    _git(pytester, "add", ".")
    _git(pytester, "commit", "-q", "-m", "tests")
    commit = _git(pytester, "rev-parse", "HEAD")
    # Untracked files do not make a checkout dirty: a new baseline not yet added is one. The git state is read
    # once, before the first baseline is written, so an untracked file must exist by then to be seen.
    (pytester.path / "notes.txt").write_text("not added")
    assert _git(pytester, "status", "--porcelain") == "?? notes.txt"
    git_state.cache_clear()
    run(pytester, "--update-baselines").assert_outcomes(passed=2)
    path = baseline_file(pytester, "test_stale", "test_kept")
    environment = json.loads(path.read_text())["environment"]
    assert environment["commit"] == commit and environment["dirty"] is False
    assert environment["pytest_precision"] and environment["cpu_capability"]
    assert environment["gpu"] is None and environment["cuda"] is None and environment["cudnn"] is None

    document = json.loads(path.read_text())
    document["environment"]["cpu_capability"] = "AVX512"
    path.write_text(json.dumps(document))
    pytester.makepyfile(test_stale=gate_tests("test_kept"))  # a tracked file now differs
    git_state.cache_clear()
    result = run(pytester, "--precision-report", "out")
    result.assert_outcomes(passed=1)

    report = json.loads((pytester.path / "out" / "precision-report.json").read_text())
    assert report["environment"]["commit"] == commit and report["environment"]["dirty"] is True
    assert report["environment"]["date"].startswith("20") and report["environment"]["date"].endswith("+00:00")
    assert report["stale"] == ["baselines/test_stale/test_removed.cpu.json"]
    assert report["drift"] == {
        "baselines/test_stale/test_kept.cpu.json": [
            f"cpu_capability: 'AVX512' in the baseline, {environment['cpu_capability']!r} now"
        ]
    }
    summary = (pytester.path / "out" / "summary.md").read_text()
    assert f"commit {commit[:12]} (dirty)" in summary.split("\n")[4]
    assert summary.split("\n")[4].startswith("Measured on: pytest-precision ")
    assert "### Environment differs from the baselines (numbers may move)" in summary
    assert "- `baselines/test_stale/test_kept.cpu.json`: cpu_capability: 'AVX512' in the baseline" in summary
    assert "### Stale baselines: 1 file(s) no test used\n\n- `baselines/test_stale/test_removed.cpu.json`" in summary
    assert "Plot: [test_stale/test_kept.png](test_stale/test_kept.png)." in summary
    assert (pytester.path / "out" / "test_stale" / "test_kept.png").is_file()


RANGE_TESTS = """
from tinymodel import run, tiny_batch, tiny_model


def test_range(precision, assert_precision_within):
    report = precision.run(tiny_model(), tiny_batch(), variants=["fp16"], range_stats=True, weight_cast=True)
    limits = {"bw": {"overflow_frac": 0.0}, "weight_cast": {"rms_rel": 1e-3}}
    assert_precision_within(report, metrics=["rms_rel", "underflow_frac"], limits=limits)


def test_range_not_measured(precision, assert_precision_within):
    assert_precision_within(run(precision), limits={"bw": {"underflow_frac": 0.5}})
"""


def test_range_statistics_and_weight_rows_through_the_fixture_and_a_vacuous_limit_refused(pytester, monkeypatch):
    project(pytester, monkeypatch, test_range=RANGE_TESTS)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    assert (
        "ConfigurationError: limits['bw']['underflow_frac']: no tensor it applies to carries it: range statistics "
        "need compare(..., range_stats=True)"
    ) in output(result)
    document = json.loads(baseline_file(pytester, "test_range", "test_range").read_text())
    records = document["variants"]["fp16"]["records"]
    kinds = {entry["kind"] for entry in records}
    assert "weight_cast" in kinds
    assert all("underflow_frac" in entry for entry in records if entry["kind"] in ("fw", "bw", "grad"))
    run(pytester, "-k", "test_range and not not_measured").assert_outcomes(passed=1)
