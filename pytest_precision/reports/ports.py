"""Two implementations in one report: the port check (fp32 against fp32: does every row agree to rounding, and if not,
which comes first) and the precision check (our low-precision error against the reference implementation's, row by
row, as a ratio)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import Record

if TYPE_CHECKING:
    from pytest_precision.base.records import ReportData

#: fp32's unit roundoff, 2^-24: the port check states each row's error in these units.
FP32_ROUNDOFF = 2.0**-24
#: The port check's default limit on a row's rms_rel: about 1700 units of fp32 rounding. Two faithful implementations
#: differ by the order of their operations (a fused kernel, another attention), which stays within a few hundred units
#: through a small model; a port bug (a norm epsilon, a rotary base, a head order, a scale) is far above.
PORT_CHECK_LIMIT = 1e-4
#: Rows the port check and the ratio gate read, in execution order: forward, log-probs and loss, backward, gradients.
CHECKED_KINDS = ("fw", "logprob", "loss", "bw", "grad")


@dataclass(frozen=True)
class PortVerdict:
    """The port check of one fp32 variant running another implementation."""

    variant: str
    implementation: str
    limit: float
    #: The first row (execution order) whose rms_rel is above the limit, or not finite; None: every row agrees.
    first: Record | None
    #: The row with the largest rms_rel (None: no row has one).
    largest: Record | None
    rows: int

    @property
    def agrees(self) -> bool:
        return self.first is None and self.rows > 0

    def __str__(self) -> str:
        head = f"port check {self.variant} ({self.implementation} against the reference implementation, fp32)"
        if self.rows == 0:
            return f"{head}: no row to compare"
        if self.first is None:
            worst = self.largest
            where = "" if worst is None else f"; largest {_error(worst)} at {worst.name} ({worst.kind})"
            return f"{head}: agrees to rounding in all {self.rows} rows (limit rms_rel {self.limit:.0e}{where})"
        return (
            f"{head}: first divergence at {self.first.name} ({self.first.kind}): {_error(self.first)}, above the "
            f"limit {self.limit:.0e} ({self.limit / FP32_ROUNDOFF:.0f} u)"
        )


def _error(record: Record) -> str:
    value = record.rms_rel
    if value is None or not math.isfinite(value):
        return f"rms_rel {value} ({record.nonfinite} non-finite)" if record.nonfinite else f"rms_rel {value}"
    return f"rms_rel {value:.3g} = {value / FP32_ROUNDOFF:.3g} u"


def port_variants(report: ReportData) -> list[str]:
    """The report's variants that ran another implementation."""
    return [name for name in report.variants if report.runs[name].port]


def _checked_rows(report: ReportData, variant: str) -> list[Record]:
    return [r for kind in CHECKED_KINDS for r in report.records(variant, kind)]


def port_verdict(report: ReportData, variant: str, *, limit: float = PORT_CHECK_LIMIT) -> PortVerdict:
    """The port check of `variant`: the first row in execution order above `limit` (rms_rel), if any."""
    _positive(limit, "limit")
    run = report.runs.get(variant)
    if run is None or not run.port:
        raise ConfigurationError(
            f"port check: {variant!r} is not a variant of this report running another implementation (those: "
            f"{', '.join(port_variants(report)) or 'none'})"
        )
    dtype = run.variant.get("dtype")
    if dtype not in ("float32", "float64"):
        raise ConfigurationError(
            f"port check: {variant!r} runs in {dtype}; the port check compares a port run in fp32 with the reference, "
            f"to rounding. For a {dtype} port, hold its error to the reference implementation's in {dtype}: "
            "assert_port_within(report, ours, theirs, factor=...)"
        )
    rows = _checked_rows(report, variant)
    first = next((r for r in rows if _above(r, limit)), None)
    finite = [r for r in rows if r.rms_rel is not None and math.isfinite(r.rms_rel)]
    largest = max(finite, key=lambda r: r.rms_rel or 0.0, default=None)
    return PortVerdict(variant, str(run.port.get("name")), limit, first, largest, len(rows))


def _above(record: Record, limit: float) -> bool:
    if record.nonfinite:
        return True
    value = record.rms_rel
    if value is None:
        return record.rms_abs is not None and record.rms_abs > 0  # the reference is zero, the port is not
    return not math.isfinite(value) or value > limit


@dataclass(frozen=True)
class RatioRow:
    """One row of the precision check: our error and the reference implementation's, and their ratio."""

    name: str
    kind: str
    ours: float | None
    theirs: float | None
    ratio: float
    limit: float


def ratio_rows(
    report: ReportData, ours: str, theirs: str, *, factor: float | Mapping[str, float] = 2.0, floor: float = 1e-6
) -> list[RatioRow]:
    """Per row both variants have, in execution order: ours / max(theirs, floor) of rms_rel, with the row's limit
    (`factor`: one number, or a dict whose keys are kinds ("fw", "bw", "grad", "logprob", "loss") or full-match regexes
    of row names, and "*" for the rest: a name's entry wins over its kind's). The loss row, one scalar whose error is a
    sum of signed per-token errors (a ratio of two such sums is noise), counts only when `factor` names "loss".
    Non-finite errors give an infinite ratio."""
    for name in (ours, theirs):
        if name not in report.runs:
            raise ConfigurationError(
                f"port ratio: no variant {name!r} in this report; variants: {', '.join(report.variants)}"
            )
    _positive(floor, "floor")
    limits = _limits(factor)
    theirs_rows = {(r.name, r.kind): r for r in _checked_rows(report, theirs)}
    rows = []
    for record in _checked_rows(report, ours):
        other = theirs_rows.get((record.name, record.kind))
        if other is None or (record.kind == "loss" and "loss" not in limits):
            continue
        ratio = _ratio(record, other, floor)
        rows.append(RatioRow(record.name, record.kind, record.rms_rel, other.rms_rel, ratio, _limit(limits, record)))
    return rows


def _ratio(ours: Record, theirs: Record, floor: float) -> float:
    mine, other = ours.rms_rel, theirs.rms_rel
    if ours.nonfinite or (mine is not None and not math.isfinite(mine)):
        return math.inf
    if mine is None:
        return 1.0
    if other is None or not math.isfinite(other):
        return 0.0 if theirs.nonfinite or other is not None else mine / floor
    return mine / max(other, floor)


def _limits(factor: float | Mapping[str, float]) -> dict[str, float]:
    if isinstance(factor, Mapping):
        limits = {}
        for key, value in factor.items():
            if not isinstance(key, str):
                raise ConfigurationError(f"port ratio: factor keys are kinds or name regexes, got {key!r}")
            if key not in CHECKED_KINDS and key != "*":
                try:
                    re.compile(key)
                except re.error as error:
                    raise ConfigurationError(f"port ratio: factor key {key!r} is not a valid regex ({error})") from None
            limits[key] = math.inf if value == math.inf else _positive(value, f"factor[{key!r}]")
        if "*" not in limits:
            raise ConfigurationError(
                f"port ratio: factor {dict(factor)!r} names no limit for the rows none of its keys name; add '*' (use "
                "math.inf to leave them ungated)"
            )
        return limits
    return {"*": _positive(factor, "factor")}


def _limit(limits: Mapping[str, float], record: Record) -> float:
    for key, value in limits.items():
        if key not in CHECKED_KINDS and key != "*" and re.fullmatch(key, record.name):
            return value
    return limits.get(record.kind, limits["*"])


def _positive(value: object, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"port ratio: {argument} must be a finite number above 0, got {value!r}")
    return float(value)


def side_by_side(report: ReportData, ours: str, theirs: str, rows: list[RatioRow] | None = None) -> list[str]:
    """The precision check as a table: each row's rms_rel for both implementations and the ratio."""
    from pytest_precision.reports.tables import render

    rows = ratio_rows(report, ours, theirs) if rows is None else rows
    body = [
        [
            f"{r.name} ({r.kind})",
            _number(r.ours),
            _number(r.theirs),
            f"{r.ratio:.2f}" if math.isfinite(r.ratio) else "inf",
        ]
        for r in rows
    ]
    return render([f"{ours} vs {theirs}", f"{ours} rms_rel", f"{theirs} rms_rel", "ratio"], body)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def partner(report: ReportData, variant: str) -> str | None:
    """The variant of the report running the reference implementation the same way as `variant` (its spec but for the
    name and the implementation), for the report's side-by-side lines; None when there is none."""
    spec = {k: v for k, v in report.runs[variant].variant.items() if k not in ("name", "implementation")}
    for other in report.variants:
        run = report.runs[other]
        if run.port:
            continue
        if {k: v for k, v in run.variant.items() if k != "name"} == spec:
            return other
    return None


def port_lines(report: ReportData) -> list[str]:
    """Per port variant: the implementation, its weights check, the unmapped modules of either side; for an fp32 port
    the port check's verdict; with a partner variant, the ratio of the errors (median and largest)."""
    lines = []
    for variant in port_variants(report):
        facts = report.runs[variant].port or {}
        lines.append(
            f"  {variant}: implementation {facts.get('name')} ({facts.get('class')}), {facts.get('weights_checked')} "
            "parameters equal to the reference's through the map"
        )
        for side, key in (("reference", "unmapped_reference"), ("implementation", "unmapped_implementation")):
            names = facts.get(key) or []
            if names:
                shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
                lines.append(f"    unmapped {side} modules (no rows): {shown}")
        if report.runs[variant].variant.get("dtype") == "float32" and _plain_fp32(report.runs[variant].variant):
            lines.append(f"    {port_verdict(report, variant)}")
        other = partner(report, variant)
        if other is not None:
            rows = [r for r in ratio_rows(report, variant, other) if math.isfinite(r.ratio)]
            if rows:
                ratios = sorted(r.ratio for r in rows)
                worst = max(rows, key=lambda r: r.ratio)
                lines.append(
                    f"    against {other}: rms_rel ratio median {ratios[len(ratios) // 2]:.2f}, largest "
                    f"{worst.ratio:.2f} at {worst.name} ({worst.kind})"
                )
    return lines


def _plain_fp32(spec: Mapping[str, object]) -> bool:
    """Whether a run computes in IEEE fp32 throughout (no autocast, TF32 or low-bit format)."""
    return (
        not spec.get("autocast")
        and spec.get("matmul_precision", "highest") == "highest"
        and not any(spec.get(k) for k in ("fp8_training", "quantize", "weight_storage"))
    )


def agreement_failure(report: ReportData, variant: str, *, limit: float = PORT_CHECK_LIMIT) -> str | None:
    """Why the fp32 port variant `variant` does not agree with the reference to `limit` (its port check, naming the
    first row in execution order above it), or None when it does."""
    verdict = port_verdict(report, variant, limit=limit)
    return None if verdict.agrees else str(verdict)


def ratio_failure(
    report: ReportData, ours: str, theirs: str, *, factor: float | Mapping[str, float] = 2.0, floor: float = 1e-6
) -> str | None:
    """Why `ours` is not within `factor` of `theirs`'s error in every row (naming the first row above its limit, with
    the side-by-side table), or None when it is; see ratio_rows."""
    rows = ratio_rows(report, ours, theirs, factor=factor, floor=floor)
    if not rows:
        return f"port ratio {ours} vs {theirs}: the two variants share no row to compare"
    failing = [r for r in rows if not r.ratio <= r.limit]
    if not failing:
        return None
    first = failing[0]
    ratio = f"{first.ratio:.2f}" if math.isfinite(first.ratio) else "inf"
    return (
        f"port ratio {ours} vs {theirs}: {first.name} ({first.kind}) has rms_rel {_number(first.ours)} against "
        f"{_number(first.theirs)}, {ratio}x, above the limit {first.limit:g}x ({len(failing)} of {len(rows)} rows "
        "above their limit)\n" + "\n".join(side_by_side(report, ours, theirs, rows))
    )
