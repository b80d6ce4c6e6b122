"""gate.lowbit_check: the format and the modules a low-bit variant converted, against its baseline's."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_precision.gate.lowbit_check import lowbit_change, lowbit_changes, lowbit_message

FP8 = "fp8 training, rowwise recipe"
NAMES = ["m.layers.0.down", "m.layers.0.up", "m.layers.1.down", "m.layers.1.up"]


def lowbit(names: list[str] | None, count: int | None = None, format: str = FP8) -> dict[str, Any]:
    block: dict[str, Any] = {"format": format, "kernels": "emulated", "torchao": "0.18.0"}
    block["modules"] = len(names) if count is None and names is not None else count
    if names is not None:
        block["module_names"] = names
    return block


@pytest.mark.parametrize(
    ("recorded", "obtained", "expected"),
    [
        (None, None, None),
        (lowbit(NAMES), lowbit(list(NAMES)), None),
        ({**lowbit(NAMES), "kernels": "native", "torchao": "0.9.0"}, lowbit(NAMES), None),  # the environment's
        (
            lowbit(NAMES),
            lowbit(["m.layers.0.up"]),
            "variant 'v': the baseline's fp8 training converted 4 modules, this run 1: missing m.layers.0.down, "
            "m.layers.1.down, m.layers.1.up",
        ),
        (
            lowbit(NAMES[:2]),
            lowbit([NAMES[0], "m.head"]),
            "variant 'v': the baseline's fp8 training converted 2 modules, this run 2: missing m.layers.0.up; "
            "added m.head",
        ),
        (
            lowbit(NAMES),
            lowbit(NAMES, format="fp8 training, tensorwise recipe"),
            "variant 'v': the baseline's format was fp8 training, rowwise recipe, this run's is fp8 training, "
            "tensorwise recipe",
        ),
        (
            None,
            lowbit(NAMES),
            f"variant 'v': the baseline's run converted no module, this run 4 module(s) to {FP8}",
        ),
        (
            lowbit(NAMES, format="quantized inference, Int8WeightOnlyConfig()"),
            None,
            "variant 'v': the baseline's run converted 4 module(s) to quantized inference, Int8WeightOnlyConfig(), "
            "this run no module",
        ),
        (lowbit(None, count=4), lowbit(NAMES), None),  # an old baseline: the same count
        (
            lowbit(None, count=4),
            lowbit(NAMES[:3]),
            "variant 'v': the baseline's fp8 training converted 4 modules, this run 3 (the baseline records no "
            "module names: refresh the baseline to record module names)",
        ),
    ],
)
def test_a_change_of_format_or_modules_is_named(
    recorded: dict[str, Any] | None, obtained: dict[str, Any] | None, expected: str | None
) -> None:
    assert lowbit_change("v", recorded, obtained) == expected


def test_a_long_list_of_names_is_cut() -> None:
    many = [f"m.{i:02d}" for i in range(10)]
    line = lowbit_change("v", lowbit(many), lowbit([]))
    assert line is not None and line.endswith("missing m.00, m.01, m.02, m.03, m.04, m.05, ... 4 more")


def test_only_variants_in_both_are_compared_and_the_message_has_the_fix() -> None:
    lines = lowbit_changes({"a": lowbit(NAMES), "gone": lowbit(NAMES)}, {"new": lowbit([]), "a": lowbit(NAMES[:1])})
    assert len(lines) == 1 and lines[0].startswith("variant 'a': ")
    text = lowbit_message(lines, "baselines/t/x.cpu.json", "pytest t.py::x --update-baselines").splitlines()
    assert text[0] == "low-bit conversion changed (1 variant): the run did not measure what its baseline measured"
    assert text[-2:] == [
        "Baseline: baselines/t/x.cpu.json",
        "If the change is intended, refresh it: pytest t.py::x --update-baselines",
    ]
