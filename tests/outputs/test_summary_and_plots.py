"""The markdown summary (summary.md, GitHub job summary) and the error-vs-depth plot."""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from conftest import random_tokens, tiny_llama
from pytest_precision import compare
from pytest_precision.base.records import Record
from pytest_precision.outputs.plots import matplotlib_available, plot_error_vs_depth, plot_path
from pytest_precision.outputs.summary import SUMMARY_FILE, markdown_summary, report_from_entry, write_summary
from pytest_precision.reports.report import PrecisionReport

VARIANTS = ["bf16", "fp16"]
NODEID = "tests/test_model.py::test_llama[bf16]"


@pytest.fixture(scope="module")
def report() -> PrecisionReport:
    ids = random_tokens()
    return compare(tiny_llama(layers=2), {"input_ids": ids, "labels": ids}, VARIANTS)


def entry_of(report: PrecisionReport, outcome: str = "passed", **extra: Any) -> dict[str, Any]:
    """One test's entry of precision-report.json, as the plugin writes it."""
    data = report.to_dict()
    entry: dict[str, Any] = {
        "outcome": outcome,
        "baseline_outcome": "matched",
        "baseline": "tests/baselines/test_model/test_llama_bf16.cpu.json",
        "reference": data["reference"],
        "variants": data["variants"],
        "nonfinite_origin": data["nonfinite_origin"],
    }
    entry.update(extra)
    return entry


def scaled(
    report: PrecisionReport, factors: dict[tuple[str, str, str], float], default: float = 1.0
) -> dict[str, list[Record]]:
    """The report's records per variant with rms_rel multiplied: a synthetic baseline."""
    return {
        variant: [
            dataclasses.replace(r, rms_rel=r.rms_rel * factors.get((variant, r.name, r.kind), default))
            for r in report.records(variant)
        ]
        for variant in report.variants
    }


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if cells[0] == first_cell:
                rows.append(cells)
    return rows


def change_rows(text: str) -> list[list[str]]:
    """Rows of the regression / improvement tables, in document order."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 7 and cells[0] not in ("variant", ":---"):
            rows.append(cells)
    return rows


# -- summary -------------------------------------------------------------------------------------------------


def test_report_round_trips_through_the_entry(report: PrecisionReport) -> None:
    again = report_from_entry(entry_of(report))
    assert again.variants == report.variants
    assert again.records("bf16") == report.records("bf16")


def test_summary_sections_and_propagation_tables(report: PrecisionReport) -> None:
    other = "tests/test_model.py::test_gpt2"
    text = markdown_summary({NODEID: entry_of(report), other: entry_of(report, "failed")})
    assert text.startswith("## Precision report\n")
    assert "2 test(s): 1 failed, 1 passed." in text
    assert f"### `{NODEID}`: passed" in text
    assert "Baseline: matched (`tests/baselines/test_model/test_llama_bf16.cpu.json`)." in text
    assert "Error propagation: `rms_rel` against the fp32 reference on cpu" in text
    assert f"### `{other}`: failed" in text
    assert "Against the baseline" not in text  # no baselines given
    for kind in ("fw", "bw", "grad"):
        headers = [line for line in text.splitlines() if line.startswith(f"| {kind} | first (")]
        assert len(headers) == 2, kind
        assert "| mid median | mid max | last (" in headers[0]
        rows = table_rows(text, "bf16") + table_rows(text, "fp16")
        assert rows
    # Per test and kind one row per variant; the cells are percentages as in the text tables.
    bf16_rows = table_rows(text, "bf16")
    assert len(bf16_rows) == 2 * 3
    assert all(len(row) == 5 and all(c.endswith("%") for c in row[1:]) for row in bf16_rows)
    assert len(table_rows(text, "fp16")) == 2 * 3
    # The alignment row of a GitHub table: names left, numbers right.
    assert "| :--- | ---: | ---: | ---: | ---: |" in text


def test_summary_first_and_last_columns_match_the_records(report: PrecisionReport) -> None:
    text = markdown_summary({NODEID: entry_of(report)})
    fw = report.records("bf16", "fw")
    header = next(line for line in text.splitlines() if line.startswith("| fw |"))
    assert f"first ({fw[0].name})" in header and f"last ({fw[-1].name})" in header
    row = table_rows(text, "bf16")[0]
    assert float(row[1].rstrip("%")) == pytest.approx(fw[0].rms_rel * 100, rel=1e-2)
    assert float(row[4].rstrip("%")) == pytest.approx(fw[-1].rms_rel * 100, rel=1e-2)


def test_summary_lists_worst_regression_first(report: PrecisionReport) -> None:
    fw = report.records("fp16", "fw")
    worst, second = fw[1], fw[0]
    # The baseline had smaller errors everywhere (the run got 1.5x worse), 4x / 2x smaller on two tensors.
    baseline = scaled(
        report,
        {("fp16", worst.name, "fw"): 0.25, ("fp16", second.name, "fw"): 0.5},
        default=1 / 1.5,
    )
    text = markdown_summary({NODEID: entry_of(report, "failed")}, {NODEID: baseline})
    assert "**Worst regressions** (5 of " in text
    assert "Largest improvements" not in text
    rows = change_rows(text)
    assert len(rows) == 5
    assert rows[0][:4] == ["fp16", worst.name, "fw", "rms_rel"]
    assert rows[0][6] == "4.00x"
    assert rows[1][:3] == ["fp16", second.name, "fw"]
    assert rows[1][6] == "2.00x"
    assert all(row[6] == "1.50x" for row in rows[2:])
    assert "worst ratio 4.00x" in text


def test_summary_lists_improvements_largest_first(report: PrecisionReport) -> None:
    grad = report.records("bf16", "grad")
    baseline = scaled(report, {("bf16", grad[0].name, "grad"): 10.0, ("bf16", grad[1].name, "grad"): 2.0})
    text = markdown_summary({NODEID: entry_of(report)}, {NODEID: baseline})
    assert "0 regression(s), 2 improvement(s)" in text
    assert "**Largest improvements** (2 of 2, largest first)" in text
    rows = change_rows(text)
    assert [row[1] for row in rows] == [grad[0].name, grad[1].name]
    assert [row[6] for row in rows] == ["0.10x", "0.50x"]


def test_summary_names_new_and_missing_variants(report: PrecisionReport) -> None:
    baseline = {"bf16": report.records("bf16"), "fp8": report.records("fp16")}
    text = markdown_summary({NODEID: entry_of(report)}, {NODEID: baseline})
    assert "fp16 (whole variant new)" in text
    assert "fp8 (whole variant missing)" in text


def test_summary_escapes_pipes_and_handles_empty_entries(report: PrecisionReport) -> None:
    text = markdown_summary({"t.py::test_x[a|b]": {"outcome": "skipped", "variants": {}}})
    assert "### `t.py::test_x[a|b]`: skipped" in text
    assert "No precision records." in text
    assert markdown_summary({}).startswith("## Precision report\n\n0 test(s): no tests.")


def test_summary_shows_the_nonfinite_origin(report: PrecisionReport) -> None:
    entry = entry_of(report, "failed", nonfinite_origin={"fp16": "model.layers.1.mlp (fw)"})
    assert "First NaN/Inf: fp16: `model.layers.1.mlp (fw)`." in markdown_summary({NODEID: entry})


def test_write_summary_file_and_github_step_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = tmp_path / "step_summary.md"
    step.write_text("earlier step\n", encoding="utf-8")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    path = write_summary(tmp_path / "out", "## first\n")
    assert path == tmp_path / "out" / SUMMARY_FILE
    assert path.read_text(encoding="utf-8") == "## first\n"
    write_summary(tmp_path / "out", "## second")
    assert path.read_text(encoding="utf-8") == "## second\n"  # summary.md is replaced ...
    appended = step.read_text(encoding="utf-8")  # ... the job summary is appended to
    assert appended.startswith("earlier step\n")
    assert appended.index("## first") < appended.index("## second")
    assert not list((tmp_path / "out").glob("*.precision-tmp"))


def test_write_summary_without_github(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    assert write_summary(tmp_path, "x").read_text(encoding="utf-8") == "x\n"
    assert [p.name for p in tmp_path.iterdir()] == [SUMMARY_FILE]


# -- plots ---------------------------------------------------------------------------------------------------


def test_plot_path_is_sanitised(tmp_path: Path) -> None:
    assert plot_path(tmp_path, NODEID) == tmp_path / "tests" / "test_model" / "test_llama_bf16.png"
    # Tests of one name in two files get two plots; odd characters and ".." never leave DIR.
    assert plot_path(tmp_path, "a/test_x.py::test_y") != plot_path(tmp_path, "b/test_x.py::test_y")
    assert plot_path(tmp_path, "../up dir/t.py::test[1]") == tmp_path / "up_dir" / "t" / "test_1.png"


def warnings_are_errors() -> None:
    """Inside warnings.catch_warnings(): every warning is an error, except pyparsing's PyparsingDeprecationWarning
    (pyparsing >= 3.3 deprecates the camelCase names that matplotlib < 3.10.7 calls while drawing text)."""
    warnings.simplefilter("error")
    deprecation = getattr(pytest.importorskip("pyparsing"), "PyparsingDeprecationWarning", None)
    if deprecation is not None:
        warnings.filterwarnings("ignore", category=deprecation)


def read_png(path: Path) -> Any:
    image = pytest.importorskip("matplotlib.image")
    return image.imread(str(path))


def test_plot_error_vs_depth(report: PrecisionReport, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    np = pytest.importorskip("numpy")
    baseline = scaled(report, {}, default=0.5)
    target = tmp_path / "plots" / "llama.png"
    with warnings.catch_warnings():
        warnings_are_errors()
        written = plot_error_vs_depth(report, target, baseline=baseline, title="tiny llama")
    assert written == target
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = read_png(target)
    assert pixels.shape[:2] == (480, 1500)
    rgb = pixels[..., :3]
    assert float(rgb.var()) > 0
    colours = np.unique((rgb.reshape(-1, 3) * 255).round().astype(int), axis=0)
    assert len(colours) > 20
    # The two variants' line colours (C0 blue, C1 orange) are drawn.
    blue, orange = np.array([31, 119, 180]), np.array([255, 127, 14])
    flat = (rgb.reshape(-1, 3) * 255).round()
    assert (np.abs(flat - blue).sum(axis=1) < 10).sum() > 50
    assert (np.abs(flat - orange).sum(axis=1) < 10).sum() > 50


def test_plot_leaves_matplotlib_global_state_alone(report: PrecisionReport, tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    backend = matplotlib.get_backend()
    params = dict(matplotlib.rcParams)
    plot_error_vs_depth(report, tmp_path / "a.png")
    assert matplotlib.get_backend() == backend
    assert dict(matplotlib.rcParams) == params
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        assert pyplot.get_fignums() == []


def test_plot_skips_zero_and_nonfinite_values(report: PrecisionReport, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = report.records("bf16")
    odd = [dataclasses.replace(r, rms_rel=[0.0, math.nan, math.inf, r.rms_rel][i % 4]) for i, r in enumerate(records)]
    zeros = PrecisionReport(reference=report.reference, device="cpu")
    zeros.add("bf16", report.runs["bf16"], odd, [])
    zeros.add("fp32", report.runs["bf16"], [dataclasses.replace(r, rms_rel=0.0) for r in records], [])
    with warnings.catch_warnings():
        warnings_are_errors()
        assert plot_error_vs_depth(zeros, tmp_path / "zeros.png") == tmp_path / "zeros.png"
    assert float(read_png(tmp_path / "zeros.png").var()) > 0


def test_plot_without_matplotlib(report: PrecisionReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert not matplotlib_available()
    assert plot_error_vs_depth(report, tmp_path / "none.png", baseline=scaled(report, {})) is None
    assert not (tmp_path / "none.png").exists()


def test_plot_without_matplotlib_with_submodules_cached(
    report: PrecisionReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A submodule imported earlier in the process must not hide that the package itself is unavailable.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_error_vs_depth(report, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
