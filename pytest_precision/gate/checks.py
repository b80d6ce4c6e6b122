"""A report held against its baseline (per tensor and gated metric, in the metric's direction; see
pytest_precision.gate.tolerance for the rule), against absolute limits, and for the metrics it must carry."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import KINDS, METRIC_DIRECTIONS, OPTIONAL_METRICS, ROUTING_GATED_METRICS, Record
from pytest_precision.gate.tolerance import (
    DEFAULT_METRICS,
    Violation,
    allowed_value,
    checked_number,
    is_better,
    is_worse,
    matches_key,
    metric_magnitude,
    validated_metrics,
)
from pytest_precision.gate.tolerance_rules import ToleranceRules, check_key


@dataclass(frozen=True)
class BaselineCheck:
    """The outcome of holding a report against its baseline."""

    violations: list[Violation]
    improvements: list[Violation]
    gated: int
    #: The largest obtained/expected ratio (in each metric's worse direction) over gated tensors.
    worst_ratio: float | None


def _spread(*records: Record) -> float:
    """The larger run-to-run spread of the baseline's and the run's record (0 when neither has one)."""
    values = [getattr(r, "spread", None) for r in records]
    return max((v for v in values if v is not None), default=0.0)


#: Relative metrics: undefined when the reference is all zeros (ref_rms == 0).
_RELATIVE = frozenset({"rms_rel", "max_rel", "bias_rel", "residual_rms_rel", "cosine"})
#: Metrics of the fit y ~ slope * x: undefined when the reference is constant (slope is None).
_FIT = frozenset({"slope", "correlation", "residual_rms_rel"})


def defined_value(record: Record, metric: str) -> float | None:
    """The metric's value, None when undefined (None or NaN)."""
    value = record.metric(metric)
    return None if value is None or math.isnan(value) else value


def undefined_by_reference(record: Record, metric: str) -> bool:
    """Whether `metric` is undefined for a reason of the reference alone, which no variant can change: a
    log-probability-only metric on a row that does not carry it, a relative metric of an all-zero reference,
    a fit metric of a constant reference (a scalar loss), or a tensor of no elements. Not when nothing was
    compared (non-finite reference, every label -100, every position masked) or the variant degenerated."""
    if metric in OPTIONAL_METRICS:
        return record.metric(metric) is None
    if record.count == 0:
        return math.prod(record.shape) == 0
    if metric in _RELATIVE and record.ref_rms == 0:
        return True
    return metric in _FIT and record.slope is None


def undefined_metrics(record: Record, metrics: Iterable[str]) -> list[str]:
    """The gated metrics of `record` that are undefined for a reason other than its reference: nothing to
    compare, so neither a gate nor a baseline can rest on them."""
    return [
        m
        for m in metrics
        if m != "nonfinite" and defined_value(record, m) is None and not undefined_by_reference(record, m)
    ]


def _undefined(variant: str, before: Record, record: Record, metric: str) -> Violation | None:
    """A violation when the metric is undefined on one side only, or in this run for no reason of its
    reference (see undefined_by_reference)."""
    old, new = defined_value(before, metric), defined_value(record, metric)
    if old is None and new is None and undefined_by_reference(record, metric):
        return None
    if old is not None and new is not None:
        return None
    return Violation(variant, record.name, record.kind, "undefined", metric, old, new)


@dataclass
class _Tally:
    violations: list[Violation] = field(default_factory=list)
    improvements: list[Violation] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)


def _check_tensor(
    variant: str, before: Record, record: Record, rules: ToleranceRules, metrics: Sequence[str], tally: _Tally
) -> None:
    """Hold one tensor of the run against its baseline record; add what is wrong or better to `tally`."""
    if record.nonfinite > before.nonfinite:
        tally.violations.append(
            Violation(
                variant,
                record.name,
                record.kind,
                "nonfinite",
                "nonfinite",
                before.nonfinite,
                record.nonfinite,
                before.nonfinite,
            )
        )
    spread = _spread(before, record)
    for metric in metrics:
        if metric == "nonfinite":
            continue
        undefined = _undefined(variant, before, record, metric)
        old, new = defined_value(before, metric), defined_value(record, metric)
        if undefined is not None:
            tally.violations.append(undefined)
        if old is None or new is None:
            continue
        tolerance = rules.for_metric(record.name, record.kind, metric)
        allowed = allowed_value(metric, old, tolerance, spread)
        found = Violation(variant, record.name, record.kind, "regressed", metric, old, new, allowed)
        if found.ratio is not None and math.isfinite(found.ratio):
            tally.ratios.append(found.ratio)
        if is_worse(metric, old, new, tolerance, spread):
            tally.violations.append(found)
        elif is_better(metric, old, new, tolerance, spread):
            tally.improvements.append(dataclasses.replace(found, reason="improved"))


def row_metrics(record: Record, metrics: Sequence[str]) -> Sequence[str]:
    """The metrics `record` is gated on: `metrics`, and on a routing row also ROUTING_GATED_METRICS."""
    if record.kind.removesuffix("_isolated") != "routing":
        return metrics
    return [*metrics, *(m for m in ROUTING_GATED_METRICS if m not in metrics)]


def check_against_baseline(
    expected: Mapping[str, Sequence[Record]],
    obtained: Mapping[str, Sequence[Record]],
    rules: ToleranceRules,
    metrics: Iterable[str] = DEFAULT_METRICS,
) -> BaselineCheck:
    """Regressions and improvements of `obtained` against `expected` (records per variant)."""
    gated_metrics = validated_metrics(metrics)
    tally = _Tally()
    gated = 0
    for variant in list(obtained) + [v for v in expected if v not in obtained]:
        if variant not in expected:
            tally.violations.append(Violation(variant, "*", "*", "new"))
            continue
        if variant not in obtained:
            tally.violations.append(Violation(variant, "*", "*", "missing"))
            continue
        baseline_rows = {(r.name, r.kind): r for r in expected[variant]}
        seen: set[tuple[str, str]] = set()
        for record in obtained[variant]:
            key = (record.name, record.kind)
            seen.add(key)
            before = baseline_rows.get(key)
            if before is None:
                tally.violations.append(Violation(variant, record.name, record.kind, "new"))
                continue
            gated += 1
            _check_tensor(variant, before, record, rules, row_metrics(record, gated_metrics), tally)
        tally.violations += [
            Violation(variant, name, kind, "missing") for (name, kind) in baseline_rows if (name, kind) not in seen
        ]
    worst = max(tally.ratios) if tally.ratios else None
    return BaselineCheck(tally.violations, tally.improvements, gated, worst)


def validated_limits(limits: object) -> dict[str, dict[str, float]]:
    """`limits` checked: {tensor regex or kind: {gateable metric: bound}}, every bound a number, not NaN, and
    >= 0 where it bounds a magnitude (every metric but correlation, cosine, sqnr_db and the like)."""
    if not isinstance(limits, Mapping):
        raise ConfigurationError(
            f"limits must be a dict {{tensor regex or kind: {{metric: bound}}}}, got {type(limits).__name__}"
        )
    checked: dict[str, dict[str, float]] = {}
    for key, bounds in limits.items():
        check_key(key, "limits")
        if not isinstance(bounds, Mapping) or not bounds:
            raise ConfigurationError(
                f"limits[{key!r}] must be a non-empty dict like {{'rms_rel': 0.05}}, got {bounds!r}"
            )
        validated_metrics([str(m) if not isinstance(m, str) else m for m in bounds])
        checked[key] = {
            metric: checked_number(
                bound,
                f"limits[{key!r}][{metric!r}]",
                minimum=None if METRIC_DIRECTIONS[metric] == "higher" else 0.0,
            )
            for metric, bound in bounds.items()
        }
    return checked


def _breaks_limit(metric: str, value: float, bound: float) -> bool:
    """A maximum of the magnitude (|value|, |1 - slope|) or, for higher-is-better metrics, a minimum."""
    if METRIC_DIRECTIONS[metric] == "higher":
        return value < bound
    return metric_magnitude(metric, value) > bound


def check_limits(obtained: Mapping[str, Sequence[Record]], limits: object) -> list[Violation]:
    """Absolute limits that hold without a baseline: {tensor regex or kind: {metric: bound}}.

    A bound is a maximum for lower-is-better metrics (|value| for bias, |1 - slope| for slope) and a
    minimum for correlation, cosine and sqnr_db; inf (a maximum) or -inf (a minimum) is no bound. A metric
    undefined for a reason other than the reference (see undefined_by_reference) breaks its limit.
    """
    violations: list[Violation] = []
    for key, bounds in validated_limits(limits).items():
        matched: list[Record] = []
        for variant, records in obtained.items():
            for record in records:
                if not matches_key(key, record.name, record.kind):
                    continue
                matched.append(record)
                for metric, bound in bounds.items():
                    value = defined_value(record, metric)
                    if value is None and undefined_by_reference(record, metric):
                        continue
                    if value is None or _breaks_limit(metric, value, bound):
                        violations.append(
                            Violation(variant, record.name, record.kind, "limit", metric, None, value, bound)
                        )
        if not matched:
            raise ConfigurationError(
                f"limits: {key!r} matches no tensor name or kind of this report (kinds: {', '.join(KINDS)}; "
                "names are matched with re.search)"
            )
        for metric in uncarried_metrics(matched, bounds):
            raise ConfigurationError(f"limits[{key!r}][{metric!r}]: {_not_carried(metric)}")
    return violations


def uncarried_metrics(records: Iterable[Record], metrics: Iterable[str]) -> list[str]:
    """The optional metrics (log-probability, range statistics) that none of `records` carries: a gate or
    limit on them would check nothing and pass."""
    present = list(records)
    return [m for m in metrics if m in OPTIONAL_METRICS and all(r.metric(m) is None for r in present)]


def _not_carried(metric: str) -> str:
    from pytest_precision.numbers.range_stats import RANGE_METRICS

    if metric in RANGE_METRICS:
        return "no tensor it applies to carries it: range statistics need compare(..., range_stats=True)"
    return "no tensor it applies to carries it (log-probability metrics are on logprob rows of causal LMs only)"


def check_carried(obtained: Mapping[str, Sequence[Record]], metrics: Iterable[str]) -> None:
    """A ConfigurationError when a gated metric is carried by no record of the run (see uncarried_metrics)."""
    for metric in uncarried_metrics((r for rows in obtained.values() for r in rows), metrics):
        raise ConfigurationError(f"metrics: {metric!r} is gated, but {_not_carried(metric)}")
