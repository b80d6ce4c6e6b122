"""The failure message when several variants regress: each shows its first rows, the rest is pointed to."""

from __future__ import annotations

from plugin_testing import baseline_file, failure, project, run

from pytest_precision.cli.main import main as cli_main
from pytest_precision.outputs.plots import matplotlib_available

#: Two variants, both degraded (block 1 rounded to float8) once TINY_DEGRADE is set, gated on four metrics so
#: that each has far more failing rows than the table shows.
TWO_VARIANTS_TEST = """
import os

from pytest_precision import Variant
from tinymodel import coarse_block_1, tiny_batch, tiny_model


def test_two(precision, assert_precision_within):
    prepare = coarse_block_1 if os.environ.get("TINY_DEGRADE") else None
    variants = [Variant("bf16", dtype="bfloat16", prepare=prepare), Variant("fp16", dtype="float16", prepare=prepare)]
    report = precision.run(tiny_model(), tiny_batch(), variants=variants)
    assert_precision_within(report, metrics=["rms_rel", "rms_abs", "max_abs", "max_rel"])
"""


def test_two_regressed_variants_both_show_rows_and_the_report_files_are_named(pytester, monkeypatch, capsys):
    project(pytester, monkeypatch, test_two=TWO_VARIANTS_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    assert baseline_file(pytester, "test_two", "test_two").is_file()

    monkeypatch.setenv("TINY_DEGRADE", "1")
    result = run(pytester, "--precision-report", "out")
    result.assert_outcomes(failed=1)
    section = failure(result, "test_two")
    assert section[0].startswith("precision regressed: ") and "in 2 variant(s); first: bf16 blocks.1 (fw)" in section[0]
    rows_shown = [line.split() for line in section if line.startswith("  ") and line.split()[0] in ("bf16", "fp16")]
    assert [row[0] for row in rows_shown] == ["bf16"] * 10 + ["fp16"] * 10
    assert rows_shown[10][1:3] == ["blocks.1", "fw"]  # fp16's own first failing tensor
    more = [line for line in section if line.startswith("  ... ")]
    assert [line.split()[-2] for line in more] == ["bf16", "fp16"]
    hint = [line for line in section if "not shown;" in line]
    plot = "; the plot: out/test_two/test_two.png" if matplotlib_available() else ""
    left_out = sum(int(line.split()[1]) for line in more)
    rows = 46 * 4  # every gated tensor, four metrics
    assert hint == [
        f"  ({left_out} row(s) not shown; all rows: pytest-precision diff baselines/test_two/test_two.cpu.json "
        f"out/precision-report.json --limit {rows}, once the session has ended{plot})"
    ]
    # The command the hint gives lists every row the table left out.
    baseline = "baselines/test_two/test_two.cpu.json"
    assert cli_main(["diff", baseline, "out/precision-report.json", "--limit", str(rows)]) == 1
    worse = [line.split() for line in capsys.readouterr().out.splitlines() if line.endswith("WORSE")]
    assert len(worse) == left_out + 20
    assert {(row[0], row[1], row[2], row[3]) for row in worse} >= {
        (row[0], row[1], row[2], row[3]) for row in rows_shown
    }
    summary = (pytester.path / "out" / "summary.md").read_text()
    assert "test_two.py::test_two" in summary
    if matplotlib_available():
        assert (pytester.path / "out" / "test_two" / "test_two.png").is_file()


def test_without_a_report_folder_the_message_says_how_to_get_one(pytester, monkeypatch):
    project(pytester, monkeypatch, test_two=TWO_VARIANTS_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    monkeypatch.setenv("TINY_DEGRADE", "1")
    section = failure(run(pytester), "test_two")
    assert next(line for line in section if "not shown;" in line).endswith(
        "not shown; all rows: pytest-precision diff baselines/test_two/test_two.cpu.json DIR/precision-report.json "
        "--limit 184, after a rerun with --precision-report DIR, which also plots error against depth)"
    )
