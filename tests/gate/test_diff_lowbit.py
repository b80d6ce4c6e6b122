"""`pytest-precision diff` fails a low-bit variant that converted another format or other modules, naming them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pytest_precision.base.records import Record, RunInfo, TensorError
from pytest_precision.cli.main import main
from pytest_precision.gate.baseline import document, render
from pytest_precision.reports.report import PrecisionReport

FP8 = {"format": "fp8 training, rowwise recipe", "kernels": "emulated", "torchao": "0.18.0"}
TEST = "t.py::t"


def baseline(path: Path, names: list[str]) -> str:
    run = RunInfo(
        variant={"name": "fp8", "dtype": "bfloat16", "fp8_training": "rowwise"},
        parameter_dtypes={"bfloat16": 2},
        buffer_dtypes={},
        input_shapes={"x": [2, 3]},
        token_count=None,
        backend={"settings": {}},
    )
    error = TensorError(6, 1.0, 0.01, 0.01, 0.03, 0.03, -0.001, -0.001, 0.999, 1.0, 0.01, 0.999, 40.0, 0)
    report = PrecisionReport(reference=dataclasses.replace(run, variant={"name": "fp32"}), device="cpu")
    lowbit = {**FP8, "modules": len(names), "module_names": names}
    report.add("fp8", dataclasses.replace(run, lowbit=lowbit), [Record.from_error("x", "fw", (2, 3), error)], [])
    path.write_text(render(document(report, TEST, {})), encoding="utf-8")
    return str(path)


def test_diff_fails_a_variant_that_converted_fewer_modules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = baseline(tmp_path / "old.cpu.json", ["a.up", "b.up"])
    new = baseline(tmp_path / "new.cpu.json", ["b.up"])
    assert main(["diff", old, new]) == 1
    lines = capsys.readouterr().out.splitlines()
    head = f"== {TEST}: 0 of 1 tensor metrics worse beyond rtol 0.1"
    assert lines[0] == f"{head}; 1 check lost, newly non-finite or converted otherwise"
    assert lines[1] == "  variant 'fp8': the baseline's fp8 training converted 2 modules, this run 1: missing a.up"
    assert main(["diff", old, old]) == 0


def test_diff_of_identical_lowbit_runs_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = baseline(tmp_path / "old.cpu.json", ["a.up", "b.up"])
    new = baseline(tmp_path / "new.cpu.json", ["b.up", "a.up"])  # the order written does not matter
    assert main(["diff", old, new]) == 0
    out: Any = capsys.readouterr().out
    assert "converted" not in out


def test_diff_ratios_compare_errors_as_the_gate_does() -> None:
    """A cosine from 0.9999 to 0.999 is ten times the error (1 - cosine), not 0.9991x: diff's ratio and its order
    of rows follow the gate's distance from perfect."""
    from pytest_precision.gate.baseline_diff import diff_rows

    rows = diff_rows(_cosine_report(0.9999, 0.01), _cosine_report(0.999, 0.02), ["rms_rel", "cosine"])
    assert [(row[3], row[6]) for row in rows] == [("cosine", pytest.approx(10.0)), ("rms_rel", pytest.approx(2.0))]


def test_diff_shows_cosines_with_the_digits_their_errors_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.99999 and 0.99990 are not both "1": the old and new columns keep 3 significant digits of 1 - cosine."""
    old, new = tmp_path / "old.cpu.json", tmp_path / "new.cpu.json"
    old.write_text(render(document(_cosine_report(0.99999, 0.01), TEST, {})), encoding="utf-8")
    new.write_text(render(document(_cosine_report(0.9999, 0.01), TEST, {})), encoding="utf-8")
    assert main(["diff", str(old), str(new), "--metric", "cosine", "--rtol", "0.1", "--atol", "0"]) == 1
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if " cosine " in line)
    assert row[4:7] == ["0.99999", "0.9999", "10x"], row


def _cosine_report(cosine: float, rms_rel: float) -> PrecisionReport:
    """A one-tensor bf16 report with these cosine (and correlation) and rms_rel values."""
    run = RunInfo(
        variant={"name": "bf16", "dtype": "bfloat16"},
        parameter_dtypes={"bfloat16": 2},
        buffer_dtypes={},
        input_shapes={"x": [2, 3]},
        token_count=None,
        backend={"settings": {}},
    )
    error = TensorError(6, 1.0, rms_rel, rms_rel, 0.03, 0.03, 0.0, 0.0, cosine, 1.0, 0.01, cosine, 40.0, 0)
    made = PrecisionReport(reference=dataclasses.replace(run, variant={"name": "fp32"}), device="cpu")
    made.add("bf16", run, [Record.from_error("x", "fw", (2, 3), error)], [])
    return made
