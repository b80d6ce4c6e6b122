"""Percent columns and the error-propagation summary."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest

from pytest_precision.base.records import Record, TensorError
from pytest_precision.reports.tables import percent_column, propagation


def decimals(text: str) -> int:
    number = text.removesuffix("%")
    return len(number.partition(".")[2])


def needed_decimals(percent: float) -> int:
    """The fewest decimals that show two significant digits of `percent` (> 0)."""
    places = 0
    while abs(percent) * 10**places < 10:
        places += 1
    return places


@pytest.mark.parametrize(
    "values",
    [
        [0.5, 0.0000123],
        [0.5, 0.25],
        [0.01, 0.002, 0.0003],
        [-0.00045, 0.2, None, 0.0],
        [1e-9, 3.0],
        [0.0, 0.0],
        [123.0, 0.5],
    ],
)
def test_percent_column_properties(values: list[float | None]) -> None:
    cells = percent_column(values)
    assert len(cells) == len(values)
    numeric = [(v, c) for v, c in zip(values, cells, strict=True) if v is not None]
    assert all(c.endswith("%") for _, c in numeric)
    places = {decimals(c) for _, c in numeric}
    assert len(places) == 1, f"decimals differ within a column: {cells}"
    (place,) = places
    for value, cell in numeric:
        assert float(cell[:-1]) == pytest.approx(value * 100, abs=0.51 * 10**-place), cell
    nonzero = [abs(v) * 100 for v, _ in numeric if v != 0]
    if nonzero:
        assert place == max(3, needed_decimals(min(nonzero)))
    for value, cell in zip(values, cells, strict=True):
        if value is None:
            assert cell == "n/a"


def test_percent_column_example() -> None:
    cells = percent_column([0.5, 0.0000123])
    assert cells[1] == "0.0012%"
    assert cells[0] == "50.0000%"


def test_percent_column_two_significant_digits_of_smallest() -> None:
    cells = percent_column([0.7, 0.0000987])
    assert cells[1] == "0.0099%"
    cells = percent_column([0.7, 0.000123, 0.0456])
    assert cells == ["70.000%", "0.012%", "4.560%"]


def test_percent_column_none_and_non_finite() -> None:
    assert percent_column([None]) == ["n/a"]
    assert percent_column([None, 0.01]) == ["n/a", "1.000%"]
    cells = percent_column([math.inf, 0.001])
    assert cells[1] == "0.100%"
    assert "inf" in cells[0]


def make_record(name: str, value: float | None, metric: str = "rms_rel") -> Record:
    fields = {f.name: None for f in dataclasses.fields(TensorError)}
    fields.update(count=1, nonfinite=0)
    fields[metric] = value
    return Record.from_error(name, "fw", (1,), TensorError(**fields))


def test_propagation_even_middle() -> None:
    values = [0.1, 0.3, 0.2, 0.5, 0.4, 0.9]
    records = [make_record(f"m{i}", v) for i, v in enumerate(values)]
    summary, names = propagation(records)
    assert summary == [0.1, pytest.approx(statistics.median([0.3, 0.2, 0.5, 0.4])), 0.5, 0.9]
    assert summary[1] == pytest.approx(0.35)
    assert names == ["m0", "m5"]


def test_propagation_odd_middle_and_none() -> None:
    values = [2.0, 5.0, None, 1.0, 3.0, 4.0]
    records = [make_record(f"m{i}", v) for i, v in enumerate(values)]
    summary, names = propagation(records)
    assert summary == [2.0, 3.0, 5.0, 4.0]
    assert names == ["m0", "m5"]


def test_propagation_uses_the_given_metric() -> None:
    records = [make_record(f"m{i}", v, "max_rel") for i, v in enumerate([1.0, 7.0, 3.0, 2.0])]
    assert propagation(records, "max_rel")[0] == [1.0, 5.0, 7.0, 2.0]
    assert propagation(records)[0] == [None, None, None, None]


def test_propagation_short_inputs() -> None:
    assert propagation([make_record("a", 1.0), make_record("b", 2.0)]) == ([1.0, None, None, 2.0], ["a", "b"])
    assert propagation([make_record("a", 1.0)]) == ([1.0, None, None, 1.0], ["a", "a"])
    assert propagation([]) == ([None, None, None, None], ["-", "-"])


def routing_record(name: str, agreement: float | None, tokens: int, flip_margin: float | None) -> Record:
    fields = {f.name: None for f in dataclasses.fields(TensorError)}
    fields.update(count=1, nonfinite=0)
    return Record.from_error(
        name, "routing", (tokens, 2), TensorError(**fields), expert_agreement=agreement, flip_margin_median=flip_margin
    )


def test_the_routing_table_counts_flips_per_router_and_variant() -> None:
    from pytest_precision.base.records import RunInfo
    from pytest_precision.outputs.summary import propagation_tables
    from pytest_precision.reports.report import PrecisionReport
    from pytest_precision.reports.tables import routing_table

    run = RunInfo(
        variant={"name": "fp32"}, parameter_dtypes={}, buffer_dtypes={}, input_shapes={}, token_count=None, backend={}
    )
    report = PrecisionReport(reference=run, device="cpu")
    report.add(
        "bf16", run, [routing_record("l0.gate", 1.0, 200, None), routing_record("l1.gate", 0.98, 200, 0.0042)], []
    )
    report.add("bf16_replay", run, [routing_record("l0.gate", 1.0, 200, None)], [])
    report.add("dense", run, [make_record("l0", 0.1)], [])
    lines = routing_table(report)
    assert lines[0].startswith("routing: tokens whose top-k experts agree")
    assert lines[1].split() == ["routing", "bf16", "bf16_replay"]  # variants without routing rows are left out
    assert lines[2].split() == ["l0.gate", "100.0%", "(0", "flips)", "100.0%", "(0", "flips)"]
    assert lines[3].split() == ["l1.gate", "98.0%", "(4", "flips,", "margin", "0.0042)", "-"]
    assert "| l1.gate | 98.0% (4 flips, margin 0.0042) | - |" in propagation_tables(report)
    report.add("one", run, [routing_record("l0.gate", 0.995, 200, 0.1)], [])
    assert "99.5% (1 flip, margin 0.1)" in "\n".join(routing_table(report))
    assert routing_table(PrecisionReport(reference=run, device="cpu")) == []
