"""@pytest.mark.precision(isolate=True) through the plugin: baselines hold the isolated rows and the gate holds
them; a bad marker value is one line naming the setting."""

from __future__ import annotations

import json
from typing import Any

import pytest
from plugin_testing import assert_no_traceback, baseline_file, output, project, run

ISOLATED_KINDS = ("fw_isolated", "bw_isolated", "grad_isolated")

GATE_TESTS = """
import pytest
from tinymodel import tiny_batch, tiny_model


@pytest.mark.precision(isolate=True)
def test_isolated(precision, assert_precision_within):
    assert_precision_within(precision.run(tiny_model(), tiny_batch(), variants=["bf16"]))


def test_plain(precision, assert_precision_within):
    assert_precision_within(precision.run(tiny_model(), tiny_batch(), variants=["bf16"]))
"""

BAD_MARKER_TEST = """
import pytest
from tinymodel import tiny_batch, tiny_model


@pytest.mark.precision(isolate="yes")
def test_bad_marker(precision, assert_precision_within):
    assert_precision_within(precision.run(tiny_model(), tiny_batch(), variants=["bf16"]))
"""


def _kinds(path: Any) -> set[str]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return {record["kind"] for record in data["variants"]["bf16"]["records"]}


def test_gate_on_isolated_rows(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    project(pytester, monkeypatch, test_iso=GATE_TESTS)
    run(pytester, "--update-baselines").assert_outcomes(passed=2)
    isolated_path = baseline_file(pytester, "test_iso", "test_isolated")
    assert set(ISOLATED_KINDS) <= _kinds(isolated_path)
    assert not set(ISOLATED_KINDS) & _kinds(baseline_file(pytester, "test_iso", "test_plain"))

    run(pytester).assert_outcomes(passed=2)

    data = json.loads(isolated_path.read_text(encoding="utf-8"))
    (record,) = [
        r for r in data["variants"]["bf16"]["records"] if (r["name"], r["kind"]) == ("blocks.1", "fw_isolated")
    ]
    assert record["rms_rel"] > 0
    record["rms_rel"] /= 10
    isolated_path.write_text(json.dumps(data), encoding="utf-8")
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "FAILED test_iso.py::test_isolated" in text
    regressed = [line for line in result.outlines if line.startswith("precision regressed:")]
    assert len(regressed) == 1, text
    assert regressed[0].endswith("first: bf16 blocks.1 (fw_isolated)"), regressed[0]
    rows = [line.split() for line in result.outlines if line.split()[:3] == ["bf16", "blocks.1", "fw_isolated"]]
    assert rows and rows[0][3] == "rms_rel", text


def test_a_bad_isolate_marker_fails_its_test_naming_the_setting(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As for the marker's rtol= and atol=: one line "ConfigurationError: ...", no traceback through the plugin.
    project(pytester, monkeypatch, test_bad=BAD_MARKER_TEST)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    message = "ConfigurationError: @pytest.mark.precision(isolate=...) must be True or False, got 'yes'"
    assert message in result.outlines, output(result)
    assert_no_traceback(result)
