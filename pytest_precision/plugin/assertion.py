"""`assert_precision_within`, importable for use inside a running test (the fixture of that name is the
same function bound to the test)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import pytest

from pytest_precision.plugin.session import SESSION_KEY

if TYPE_CHECKING:
    from pytest_precision.reports.report import PrecisionReport

#: The test being run, set by the plugin around each test's protocol.
CURRENT_ITEM: ContextVar[pytest.Item | None] = ContextVar("pytest_precision_current_item", default=None)


def assert_precision_within(
    report: PrecisionReport,
    *,
    baseline: str | None = None,
    rtol: float | Mapping[str, float] | None = None,
    atol: float | Mapping[str, float] | None = None,
    metrics: Iterable[str] | None = None,
    tolerances: Mapping[str, Mapping[str, Any]] | None = None,
    limits: Mapping[str, Mapping[str, float]] | None = None,
) -> None:
    """Fail the running test when `report` regressed against its baseline file or breaks `limits`.

    baseline: the file stem (default: the test's name with class and parameters).
    rtol, atol: override every other tolerance; a number for every metric or {metric: number}. metrics: the
    gated metrics (default: ini precision_metrics, else rms_rel; nonfinite is always gated). tolerances:
    {tensor regex or kind: {"rtol": .., "atol": .., metric: {"rtol": ..}}} and {metric: {"rtol": ..}}; the
    precedence is ToleranceRules'. limits: {tensor regex or kind: {metric: bound}}, absolute bounds that hold
    without a baseline.
    """
    __tracebackhide__ = True
    item = CURRENT_ITEM.get()
    if item is None:
        raise RuntimeError(
            "assert_precision_within must be called inside a running pytest test with the pytest-precision "
            "plugin active (or use the assert_precision_within fixture)"
        )
    item.config.stash[SESSION_KEY].check(
        item,
        report,
        baseline=baseline,
        rtol=rtol,
        atol=atol,
        metrics=metrics,
        tolerances=tolerances,
        limits=limits,
    )
