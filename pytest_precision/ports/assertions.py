"""The two gates of a port: it agrees with the reference implementation to fp32 rounding, and its low-precision error
stays within a factor of the reference implementation's. Under pytest, the fixtures of the same names also count as
gating the test's precision.run (no PrecisionUnassertedWarning)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pytest_precision.reports.ports import PORT_CHECK_LIMIT, agreement_failure, ratio_failure

if TYPE_CHECKING:
    from pytest_precision.reports.report import PrecisionReport


def assert_port_agrees(report: PrecisionReport, variant: str, *, limit: float = PORT_CHECK_LIMIT) -> None:
    """Fail unless every row of the fp32 port variant `variant` agrees with the reference to `limit` (rms_rel), naming
    the first row in execution order that does not: where the port diverges."""
    failure = agreement_failure(report, variant, limit=limit)
    if failure is not None:
        raise AssertionError(failure)


def assert_port_within(
    report: PrecisionReport,
    ours: str,
    theirs: str,
    *,
    factor: float | Mapping[str, float] = 2.0,
    floor: float = 1e-6,
) -> None:
    """Fail when a row's error (rms_rel against the fp32 reference) of `ours` is above `factor` times that of `theirs`
    (the same dtype on the reference implementation), naming the first such row in execution order and showing the
    side-by-side table. `factor`: one number, or {kind or name regex: factor, "*": the rest} (the loss row counts only
    when named); `floor`: the smallest error of `theirs` a ratio divides by (rows where both are exact agree)."""
    failure = ratio_failure(report, ours, theirs, factor=factor, floor=floor)
    if failure is not None:
        raise AssertionError(failure)
