"""The failure message's table: every failing variant shows its first rows, the rest is counted and pointed to."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_precision.base.records import Record, TensorError
from pytest_precision.gate.checks import check_against_baseline
from pytest_precision.gate.tolerance import Violation
from pytest_precision.gate.tolerance_rules import ToleranceRules
from pytest_precision.plugin.messages import (
    FULL_LIST_HINT,
    MAX_ROWS,
    MIN_ROWS_PER_VARIANT,
    format_value,
    full_list_hint,
    improvement_message,
    limit_message,
    regression_message,
    row_shares,
    violation_table,
)


def regressed(variant: str, count: int) -> list[Violation]:
    """`count` regressed rms_rel rows of `variant`, tensor layers.<i> in execution order."""
    return [
        Violation(variant, f"layers.{i}", "fw", "regressed", "rms_rel", 0.01, 0.02 + i / 1000, 0.011)
        for i in range(count)
    ]


def body(lines: list[str]) -> list[list[str]]:
    """The table's rows (not its header, the "..." lines or the hint), split on whitespace."""
    return [line.split() for line in lines[1:] if not line.lstrip().startswith(("...", "("))]


def test_two_failing_variants_each_show_their_first_rows_and_their_count_left() -> None:
    lines = violation_table([*regressed("bf16", 60), *regressed("fp16", 45)])
    rows = body(lines)
    assert [row[:2] for row in rows] == [["bf16", f"layers.{i}"] for i in range(10)] + [
        ["fp16", f"layers.{i}"] for i in range(10)
    ]
    assert "  ... 50 more bf16 row(s)" in lines
    assert "  ... 35 more fp16 row(s)" in lines
    assert lines.index("  ... 50 more bf16 row(s)") == 11  # right after bf16's rows, before fp16's
    assert lines[-1] == f"  (85 row(s) not shown; {FULL_LIST_HINT})"


def test_a_variant_with_few_rows_leaves_its_share_to_the_others() -> None:
    lines = violation_table([*regressed("bf16", 2), *regressed("fp16", 40)])
    rows = body(lines)
    assert [row[0] for row in rows] == ["bf16"] * 2 + ["fp16"] * (MAX_ROWS - 2)
    assert "  ... 22 more fp16 row(s)" in lines
    assert not [line for line in lines if "more bf16" in line]


def test_many_failing_variants_each_keep_a_minimum_of_rows() -> None:
    names = [f"v{i}" for i in range(12)]
    lines = violation_table([v for name in names for v in regressed(name, 5)])
    rows = body(lines)
    assert len(rows) == MIN_ROWS_PER_VARIANT * 12 > MAX_ROWS
    assert {name: sum(row[0] == name for row in rows) for name in names} == dict.fromkeys(names, 3)


def test_a_table_that_fits_has_no_count_and_no_hint() -> None:
    lines = violation_table(regressed("bf16", MAX_ROWS))
    assert len(body(lines)) == MAX_ROWS
    assert not [line for line in lines if "more" in line or "not shown" in line]


@pytest.mark.parametrize(
    "sizes, budget, shares",
    [([100, 2], 20, [18, 2]), ([1, 1, 1], 20, [1, 1, 1]), ([7, 7, 7], 20, [7, 7, 6]), ([], 20, []), ([5], 0, [0])],
)
def test_row_shares(sizes: list[int], budget: int, shares: list[int]) -> None:
    assert row_shares(sizes, budget) == shares


def test_every_message_with_a_table_points_to_the_full_list() -> None:
    violations = [*regressed("bf16", 30), *regressed("fp16", 30)]
    order: dict[tuple[str, str, str], int] = {}
    where = "every row in out/summary.md"
    messages = [
        regression_message(violations, 60, Path("b.json"), "t.py::t", order, full_list=where),
        improvement_message(violations, Path("b.json"), "t.py::t", order, full_list=where),
        limit_message(violations, order, full_list=where),
    ]
    for message in messages:
        assert "  ... 20 more fp16 row(s)" in message.splitlines()
        assert f"  (40 row(s) not shown; {where})" in message.splitlines()


def test_the_full_list_hint_names_the_command_that_lists_every_row() -> None:
    baseline, out = Path("baselines/t/t.cpu.json"), Path("out")
    assert full_list_hint(out, baseline, 132, Path("out/t/t.png")) == (
        "all rows: pytest-precision diff baselines/t/t.cpu.json out/precision-report.json --limit 132, once the "
        "session has ended; the plot: out/t/t.png"
    )
    assert full_list_hint(out, baseline, 132, None).endswith("--limit 132, once the session has ended")
    assert full_list_hint(None, baseline, 7, None) == (
        "all rows: pytest-precision diff baselines/t/t.cpu.json DIR/precision-report.json --limit 7, after a "
        "rerun with --precision-report DIR, which also plots error against depth"
    )
    # Limits hold without a baseline: the session report's records are the full list.
    assert full_list_hint(out, None, 7, None) == "every record in out/precision-report.json, once the session has ended"


def test_names_are_left_aligned_and_numbers_right_aligned_under_their_headers() -> None:
    lines = violation_table([*regressed("bf16", 3), *regressed("fp16_fp32_head", 3)])
    header = lines[0]
    for column in ("baseline", "obtained", "ratio", "allowed"):
        end = header.index(column) + len(column)
        assert all(line[end - 1] != " " and (len(line) == end or line[end] == " ") for line in lines[1:])
    for column in ("variant", "tensor", "kind", "metric"):
        start = header.index(column)
        assert all(line[start] != " " and line[start - 1] == " " for line in lines[1:])


# --- the headline's counts: a part of a whole, with what is in only one side counted apart (issue 34 item 12) --


def _row(name: str, rms_rel: float = 0.01) -> Record:
    error = TensorError(
        count=4, ref_rms=1.0, rms_abs=rms_rel, rms_rel=rms_rel, max_abs=None, max_rel=None, bias_abs=None,
        bias_rel=None, correlation=None, slope=None, residual_rms_rel=None, cosine=None, sqnr_db=None, nonfinite=0,
    )  # fmt: skip
    return Record.from_error(name, "fw", (4,), error)


def headline(baseline: dict[str, list[Record]], run: dict[str, list[Record]]) -> str:
    """The first line of the regression message the gate gives `run` against `baseline`."""
    check = check_against_baseline(baseline, run, ToleranceRules())
    return regression_message(check.violations, check.gated, Path("b.json"), "t.py::t", {}).splitlines()[0]


def test_the_headline_counts_failing_tensors_among_those_compared_and_the_rest_apart() -> None:
    baseline = {"bf16": [_row(f"layers.{i}") for i in range(4)], "fp16": [_row("layers.0")]}
    # layers.1 regressed, layers.2 and .3 are gone, layers.9 is new, and the whole fp16 variant is gone.
    run = {"bf16": [_row("layers.0"), _row("layers.1", 0.5), _row("layers.9")]}
    assert headline(baseline, run) == (
        "precision regressed: 1 / 2 tensors (50.0%) in 2 variant(s), and 2 tensor(s) and 1 variant(s) missing from "
        "this run, 1 tensor(s) new (not in the baseline); first: bf16 layers.1 (fw)"
    )


def test_renamed_tensors_count_as_missing_and_new_not_as_a_fraction_above_one() -> None:
    # Every tensor renamed: none compared ("18 / 0 tensors" before), never more failing than compared.
    baseline = {"bf16": [_row(f"old.{i}") for i in range(3)]}
    run = {"bf16": [_row(f"new.{i}") for i in range(3)]}
    assert headline(baseline, run).startswith(
        "precision regressed: no tensor in both the baseline and this run in 1 variant(s), and 3 tensor(s) missing "
        "from this run, 3 tensor(s) new (not in the baseline); first: "
    )
    # Some renamed, some compared: 4 of 4 compared failed would read 100%, not (4 + 4 + 4) / 4 = 300%.
    baseline = {"bf16": [_row(f"layers.{i}") for i in range(4)] + [_row(f"old.{i}") for i in range(4)]}
    run = {"bf16": [_row(f"layers.{i}", 0.5) for i in range(4)] + [_row(f"new.{i}") for i in range(4)]}
    assert headline(baseline, run).startswith(
        "precision regressed: 4 / 4 tensors (100.0%) in 1 variant(s), and 4 tensor(s) missing from this run, "
        "4 tensor(s) new (not in the baseline); first: "
    )


@pytest.mark.parametrize(
    ("metric", "value", "shown"),
    [
        ("cosine", 0.99999, "0.99999"),
        ("cosine", 0.9999789, "0.9999789"),  # 1 - cosine: 2.11e-05
        ("correlation", 0.999, "0.999"),
        ("cosine", 0.9, "0.9"),
        ("cosine", 1.0, "1"),
        ("cosine", 1.0 - 1e-17, "1"),
        ("sqnr_db", 39.17, "39.17"),
        ("rms_rel", 0.0123456, "0.01235"),
    ],
)
def test_values_near_one_keep_three_digits_of_their_distance_from_one(metric: str, value: float, shown: str) -> None:
    assert format_value(metric, value) == shown


def test_a_cosine_row_shows_baseline_obtained_and_allowed_apart_and_the_ratio_of_errors() -> None:
    before = Record.from_error("layers.0", "fw", (4,), _cosine(0.99999))
    after = Record.from_error("layers.0", "fw", (4,), _cosine(0.9999))
    check = check_against_baseline({"bf16": [before]}, {"bf16": [after]}, ToleranceRules(), ["cosine"])
    (row,) = body(violation_table(check.violations))
    # allowed 1 - (1e-5 * 1.1 + 1e-5) = 0.999979; the error grew 10x.
    assert row[3:] == ["cosine", "0.99999", "0.9999", "10.00x", "0.999979"]


def _cosine(value: float) -> TensorError:
    return TensorError(
        count=4, ref_rms=1.0, rms_abs=0.01, rms_rel=0.01, max_abs=None, max_rel=None, bias_abs=None,
        bias_rel=None, correlation=None, slope=None, residual_rms_rel=None, cosine=value, sqnr_db=None, nonfinite=0,
    )  # fmt: skip
