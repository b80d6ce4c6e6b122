"""When is a tensor's error a regression: tolerances, their precedence, and absolute limits.

Regression rule, per tensor and gated metric, in the metric's direction:
  lower is better  (rms, max, |bias|, residual): fail when obtained > expected * (1 + rtol) + atol
  higher is better (correlation, cosine, sqnr):  fail when obtained < expected * (1 - rtol) - atol
  closer to one    (slope, as |1 - slope|):      fail when |1 - obtained| > |1 - expected| * (1 + rtol) + atol
`nonfinite` fails whenever it rises above the baseline, whatever the tolerance.

Defaults (rtol 0.10, atol 1e-5 on rms_rel): the same code on the same machine reproduces a run bit for
bit on CPU, so a baseline moves only when numerics change. 10% lets another CPU's or GPU's kernels (other
blocking, other accumulation order) move bf16/fp16 errors of ~1e-3..1e-2 without failing, while a real
regression (a layer losing a mantissa bit doubles its error) fails. 1e-5 absolute (0.001% relative error)
absorbs fp32-level noise (~1e-7..1e-6) on tensors whose baseline error is zero or near it, such as an fp32 or
TF32-on-CPU variant, without hiding a bf16-sized (1e-3) error appearing there.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigurationError
from .metrics import DESCRIPTIVE_METRICS, METRIC_DIRECTIONS, SIGNED_METRICS
from .report import Record

DEFAULT_RTOL = 0.10
DEFAULT_ATOL = 1e-5
DEFAULT_METRICS: tuple[str, ...] = ("rms_rel",)
#: With repeats, a tensor's tolerance is at least this many times the spread its runs showed: the spread is a
#: max - min over a handful of runs, which underestimates the range of run-to-run noise; 3x keeps a
#: non-deterministic kernel from failing the gate while a real regression, far larger, still fails.
NOISE_FACTOR = 3.0

Reason = Literal["regressed", "improved", "nonfinite", "limit", "missing", "new"]


@dataclass(frozen=True)
class Tolerance:
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL


@dataclass(frozen=True)
class Violation:
    """One failing check: a tensor (or a whole variant, name "*") and what was wrong with it."""

    variant: str
    name: str
    kind: str
    reason: Reason
    metric: str = ""
    expected: float | None = None
    obtained: float | None = None
    allowed: float | None = None

    @property
    def ratio(self) -> float | None:
        """obtained / expected in the metric's "worse" sense (None when undefined)."""
        if self.expected is None or self.obtained is None:
            return None
        direction = METRIC_DIRECTIONS.get(self.metric, "lower")
        expected, obtained = _magnitude(self.metric, self.expected), _magnitude(self.metric, self.obtained)
        if direction == "higher":
            expected, obtained = obtained, expected
        if expected == 0:
            return math.inf if obtained > 0 else None
        return obtained / expected


def _magnitude(metric: str, value: float) -> float:
    if METRIC_DIRECTIONS.get(metric) == "unit":
        return abs(1.0 - value)
    if metric in SIGNED_METRICS:
        return abs(value)
    return value


def allowed_value(metric: str, expected: float, tolerance: Tolerance, spread: float = 0.0) -> float:
    """The worst value of `metric` that still passes against `expected` (a magnitude for unit/signed).

    A tensor measured with repeats whose runs differed (non-deterministic kernels) gets at least
    NOISE_FACTOR times that spread of tolerance.
    """
    direction = METRIC_DIRECTIONS.get(metric, "lower")
    if metric == "nonfinite":
        return expected
    noise = NOISE_FACTOR * spread
    if direction == "higher":
        return min(expected * (1 - tolerance.rtol) - tolerance.atol, expected - noise)
    magnitude = _magnitude(metric, expected)
    return max(magnitude * (1 + tolerance.rtol) + tolerance.atol, magnitude + noise)


def is_worse(metric: str, expected: float, obtained: float, tolerance: Tolerance, spread: float = 0.0) -> bool:
    """Whether `obtained` regressed past the tolerance of `expected` in the metric's direction."""
    if math.isnan(expected) or math.isnan(obtained):
        return False
    allowed = allowed_value(metric, expected, tolerance, spread)
    if METRIC_DIRECTIONS.get(metric, "lower") == "higher":
        return obtained < allowed
    return _magnitude(metric, obtained) > allowed


def is_better(metric: str, expected: float, obtained: float, tolerance: Tolerance, spread: float = 0.0) -> bool:
    """Whether `obtained` improved past the tolerance: below expected * (1 - rtol) - atol (mirrored)."""
    if metric == "nonfinite" or math.isnan(expected) or math.isnan(obtained):
        return False
    noise = NOISE_FACTOR * spread
    if METRIC_DIRECTIONS.get(metric, "lower") == "higher":
        return obtained > max(expected * (1 + tolerance.rtol) + tolerance.atol, expected + noise)
    magnitude = _magnitude(metric, expected)
    return _magnitude(metric, obtained) < min(magnitude * (1 - tolerance.rtol) - tolerance.atol, magnitude - noise)


def validated_metrics(metrics: Iterable[str]) -> list[str]:
    chosen = list(metrics)
    for metric in chosen:
        if metric not in METRIC_DIRECTIONS or metric in DESCRIPTIVE_METRICS:
            gateable = sorted(set(METRIC_DIRECTIONS) - DESCRIPTIVE_METRICS)
            raise ConfigurationError(f"metrics: unknown metric {metric!r}; gateable metrics: {', '.join(gateable)}")
    return chosen


def _matches(key: str, record_name: str, kind: str) -> bool:
    return key == kind or re.search(key, record_name) is not None


@dataclass(frozen=True)
class ToleranceRules:
    """Tolerance precedence: call kwargs > per-tensor regexes > marker > ini > default (the `base`)."""

    base: Tolerance = Tolerance()
    rtol: float | None = None
    atol: float | None = None
    per_tensor: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, values in self.per_tensor.items():
            unknown = sorted(set(values) - {"rtol", "atol"})
            if unknown:
                raise ConfigurationError(
                    f"tolerances[{key!r}]: unknown key(s) {', '.join(unknown)}; use 'rtol' and/or 'atol'"
                )
            _compile(key, "tolerances")

    def for_tensor(self, name: str, kind: str) -> Tolerance:
        rtol, atol = self.base.rtol, self.base.atol
        for key, values in self.per_tensor.items():
            if _matches(key, name, kind):
                rtol = values.get("rtol", rtol)
                atol = values.get("atol", atol)
                break
        return Tolerance(
            rtol=self.rtol if self.rtol is not None else rtol,
            atol=self.atol if self.atol is not None else atol,
        )


def _compile(key: str, argument: str) -> None:
    try:
        re.compile(key)
    except re.error as error:
        raise ConfigurationError(f"{argument}: {key!r} is not a valid regex ({error})") from None


@dataclass(frozen=True)
class BaselineCheck:
    """The outcome of holding a report against its baseline."""

    violations: list[Violation]
    improvements: list[Violation]
    gated: int
    #: The largest obtained/expected ratio (in each metric's worse direction) over gated tensors.
    worst_ratio: float | None


def _spread(*records: Record) -> float:
    values = [getattr(r, "spread", None) for r in records]
    return max((v for v in values if v is not None), default=0.0)


def check_against_baseline(
    expected: Mapping[str, Sequence[Record]],
    obtained: Mapping[str, Sequence[Record]],
    rules: ToleranceRules,
    metrics: Iterable[str] = DEFAULT_METRICS,
) -> BaselineCheck:
    """Regressions and improvements of `obtained` against `expected` (records per variant)."""
    gated_metrics = validated_metrics(metrics)
    violations: list[Violation] = []
    improvements: list[Violation] = []
    ratios: list[float] = []
    gated = 0
    for variant in list(obtained) + [v for v in expected if v not in obtained]:
        if variant not in expected:
            violations.append(Violation(variant, "*", "*", "new"))
            continue
        if variant not in obtained:
            violations.append(Violation(variant, "*", "*", "missing"))
            continue
        baseline_rows = {(r.name, r.kind): r for r in expected[variant]}
        seen: set[tuple[str, str]] = set()
        for record in obtained[variant]:
            key = (record.name, record.kind)
            seen.add(key)
            before = baseline_rows.get(key)
            if before is None:
                violations.append(Violation(variant, record.name, record.kind, "new"))
                continue
            gated += 1
            if record.nonfinite > before.nonfinite:
                violations.append(
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
            tolerance = rules.for_tensor(record.name, record.kind)
            spread = _spread(before, record)
            for metric in gated_metrics:
                if metric == "nonfinite":
                    continue
                old, new = before.metric(metric), record.metric(metric)
                if old is None or new is None:
                    continue
                found = Violation(
                    variant,
                    record.name,
                    record.kind,
                    "regressed",
                    metric,
                    old,
                    new,
                    allowed_value(metric, old, tolerance, spread),
                )
                if found.ratio is not None and math.isfinite(found.ratio):
                    ratios.append(found.ratio)
                if is_worse(metric, old, new, tolerance, spread):
                    violations.append(found)
                elif is_better(metric, old, new, tolerance, spread):
                    improvements.append(dataclasses.replace(found, reason="improved"))
        violations += [
            Violation(variant, name, kind, "missing") for (name, kind) in baseline_rows if (name, kind) not in seen
        ]
    return BaselineCheck(violations, improvements, gated, max(ratios) if ratios else None)


def check_limits(
    obtained: Mapping[str, Sequence[Record]], limits: Mapping[str, Mapping[str, float]]
) -> list[Violation]:
    """Absolute limits that hold without a baseline: {tensor regex or kind: {metric: bound}}.

    A bound is a maximum for lower-is-better metrics (|value| for bias, |1 - slope| for slope) and a
    minimum for correlation, cosine and sqnr_db.
    """
    violations: list[Violation] = []
    for key, bounds in limits.items():
        _compile(key, "limits")
        validated_metrics(bounds)
        matched = False
        for variant, records in obtained.items():
            for record in records:
                if not _matches(key, record.name, record.kind):
                    continue
                matched = True
                for metric, bound in bounds.items():
                    value = record.metric(metric)
                    if value is None:
                        continue
                    if METRIC_DIRECTIONS[metric] == "higher":
                        failed = value < bound
                    else:
                        failed = _magnitude(metric, value) > bound
                    if failed or math.isnan(value):
                        violations.append(
                            Violation(variant, record.name, record.kind, "limit", metric, None, value, bound)
                        )
        if not matched:
            raise ConfigurationError(
                f"limits: {key!r} matches no tensor name or kind of this report (kinds: fw, logprob, loss, bw, grad; "
                "names are matched with re.search)"
            )
    return violations
