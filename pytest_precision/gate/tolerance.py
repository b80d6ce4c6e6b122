"""When is a tensor's error a regression: tolerances, their precedence, and absolute limits.

Regression rule, per tensor and gated metric, on the metric's error (its distance from perfect):
  lower is better  (rms, max, |bias|, residual): the error is the value (|value| for a signed metric)
  closer to one    (slope, ppl_ratio):           the error is |1 - value|
  higher is better, perfect 1 (cosine, correlation, top1_agreement, expert_agreement, ...): 1 - value
  higher is better, in decibels (sqnr_db):       the noise-to-signal amplitude 10^(-sqnr_db / 20)
and a tensor fails when error(obtained) > error(expected) * (1 + rtol) + atol. So rtol is the same promise
for every metric: rtol 2.1 allows 3.1x the baseline's error, whether that error is an rms_rel or 1 - cosine, and
no rtol, however large, accepts any value (a bound on the value, expected * (1 - rtol), is negative from
rtol 1 on, and at rtol 0.1 a cosine of 0.99999 would accept 0.9, 10,000x its error). atol is an absolute
allowance on that same error (1e-5 lets 1 - cosine reach 1e-5 from an exact baseline). SQNR is taken as an
amplitude, not a power, because 10^(-sqnr_db / 20) = sqrt(sum (y-x)^2 / sum x^2) is rms_rel itself: rtol and
atol on sqnr_db then mean what they mean on rms_rel (rtol 0.1 is 0.83 dB). 1 - cosine and 1 - correlation
grow as the square of an uncorrelated error's amplitude (1 - cosine ~ rms_rel^2 / 2), so the same rtol on them
is the tighter gate on the amplitude: 3.1x 1 - cosine is 1.76x rms_rel.
`nonfinite` fails whenever it rises above the baseline, whatever the tolerance.

Defaults (rtol 0.10, atol 1e-5 on rms_rel): the same code on the same machine reproduces a run bit for
bit on CPU, so a baseline moves only when numerics change. 10% lets another CPU's or GPU's kernels (other
blocking, other accumulation order) move bf16/fp16 errors of ~1e-3..1e-2 without failing, while a real
regression (a layer losing a mantissa bit doubles its error) fails. 1e-5 absolute (0.001% relative error)
absorbs fp32-level noise (~1e-7..1e-6) on tensors whose baseline error is zero or near it, such as an fp32 or
TF32-on-CPU variant, without hiding a bf16-sized (1e-3) error appearing there.

What a pass means: for every gated tensor and metric, the run's value is within the tolerance of the
baseline's, no tensor gained NaN/Inf, no tensor or variant is new or missing, and every limit holds.
A metric that is undefined (None: nothing was compared, or the reference is constant or all zeros) on one
side and a number on the other fails, in either direction: undefined in this run (the reference went
non-finite, every label is -100, the mask removed every position) or undefined in the baseline (refresh it).
Undefined on both sides passes: the tensor is the same kind of degenerate as when the baseline was written.

Tolerances and limits are checked where they are given (command line, ini, marker, call, `tolerances=`,
`limits=`): each must be a real number (not a bool, a string or None), never NaN; rtol and atol are >= 0.
`inf` is allowed and means "no bound": rtol=inf or atol=inf never fails that metric (nonfinite values,
undefined metrics and new or missing tensors still fail), a limit of inf (a maximum) or -inf (a minimum,
for correlation, cosine, sqnr_db) never fails. A limit on a metric a tensor leaves undefined fails
(log-probability-only metrics on rows that do not carry them are skipped).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Literal

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import DESCRIPTIVE_METRICS, METRIC_DIRECTIONS, SIGNED_METRICS
from pytest_precision.reports.tables import format_number

DEFAULT_RTOL = 0.10
DEFAULT_ATOL = 1e-5
DEFAULT_METRICS: tuple[str, ...] = ("rms_rel",)
#: With repeats, a tensor's tolerance is at least this many times the spread its runs showed: the spread is a
#: max - min over a handful of runs, which underestimates the range of run-to-run noise; 3x keeps a
#: non-deterministic kernel from failing the gate while a real regression, far larger, still fails.
NOISE_FACTOR = 3.0

Reason = Literal["regressed", "improved", "nonfinite", "limit", "missing", "new", "undefined"]


def checked_number(value: object, setting: str, *, minimum: float | None = None) -> float:
    """`value` as a float, or a ConfigurationError naming `setting`: not a real number (bool, str, None, a
    list), NaN, or below `minimum`. Infinities pass: their meaning is the caller's (see the module doc)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ConfigurationError(f"{setting} must be a number, got {value!r} ({type(value).__name__})")
    number = float(value)
    if math.isnan(number):
        raise ConfigurationError(f"{setting} is NaN; give a number (inf means no bound)")
    if minimum is not None and number < minimum:
        raise ConfigurationError(f"{setting} must be >= {minimum:g}, got {number:g}")
    return number


@dataclass(frozen=True)
class Tolerance:
    """A relative and an absolute tolerance, both >= 0 (inf: never fails on the metric)."""

    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL

    def __post_init__(self) -> None:
        checked_number(self.rtol, "rtol", minimum=0.0)
        checked_number(self.atol, "atol", minimum=0.0)

    @property
    def unbounded(self) -> bool:
        """rtol or atol is inf: the metric's value never fails (nor counts as an improvement)."""
        return math.isinf(self.rtol) or math.isinf(self.atol)


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
        """error(obtained) / error(expected), each the metric's distance from perfect (see metric_magnitude);
        None when undefined or when both errors are 0, inf when only the baseline's is."""
        if self.expected is None or self.obtained is None:
            return None
        expected, obtained = metric_magnitude(self.metric, self.expected), metric_magnitude(self.metric, self.obtained)
        if expected == 0:
            return math.inf if obtained > 0 else None
        return obtained / expected


#: Higher-is-better metrics measured in decibels (perfect: +inf dB); every other higher-is-better metric is a
#: fraction of perfect whose perfect value is 1 (a cosine, a correlation, a share of agreeing tokens or experts).
DECIBEL_METRICS = frozenset({"sqnr_db"})


def metric_magnitude(metric: str, value: float) -> float:
    """The error the gate compares for `metric` at `value`, its distance from perfect (see the module doc): the
    value of a lower-is-better metric, |value| of a signed one, |1 - value| for slope and ppl_ratio, 1 - value for
    a higher-is-better fraction (0 above 1: float rounding of a perfect cosine), 10^(-value / 20) for sqnr_db."""
    direction = METRIC_DIRECTIONS.get(metric)
    if direction == "unit":
        return abs(1.0 - value)
    if direction == "higher":
        if metric in DECIBEL_METRICS:
            return _amplitude(value)
        return max(1.0 - value, 0.0)
    if metric in SIGNED_METRICS:
        return abs(value)
    return value


def _amplitude(decibels: float) -> float:
    """The amplitude ratio 10^(-decibels / 20): 0 at +inf dB, inf at -inf dB and where it overflows."""
    try:
        return math.pow(10.0, -decibels / 20.0)
    except OverflowError:  # below about -6160 dB
        return math.inf


def value_of_error(metric: str, error: float) -> float:
    """The higher-is-better `metric`'s value at `error` (the inverse of metric_magnitude): 1 - error, or
    -20 log10(error) dB (+inf at an error of 0, -inf at an infinite one)."""
    if metric not in DECIBEL_METRICS:
        return 1.0 - error
    if error == 0:
        return math.inf
    return -math.inf if math.isinf(error) else -20.0 * math.log10(error)


def allowed_error(metric: str, expected: float, tolerance: Tolerance, spread: float = 0.0) -> float:
    """The largest error (metric_magnitude) of `metric` that still passes against `expected`: error(expected) *
    (1 + rtol) + atol (inf when unbounded; the count itself for nonfinite).

    A tensor measured with repeats whose runs differed (non-deterministic kernels) gets at least
    NOISE_FACTOR times that spread of tolerance.
    """
    if metric == "nonfinite":
        return expected
    if tolerance.unbounded:
        return math.inf
    magnitude = metric_magnitude(metric, expected)
    return max(magnitude * (1 + tolerance.rtol) + tolerance.atol, magnitude + NOISE_FACTOR * spread)


def allowed_value(metric: str, expected: float, tolerance: Tolerance, spread: float = 0.0) -> float:
    """The worst value of `metric` that still passes against `expected`, as a message shows it: a magnitude for
    lower-is-better, unit and signed metrics, the smallest passing value for a higher-is-better one (see
    allowed_error)."""
    allowed = allowed_error(metric, expected, tolerance, spread)
    if METRIC_DIRECTIONS.get(metric) == "higher":
        return value_of_error(metric, allowed)
    return allowed


def is_worse(metric: str, expected: float, obtained: float, tolerance: Tolerance, spread: float = 0.0) -> bool:
    """Whether `obtained` regressed past the tolerance of `expected`: its error above allowed_error."""
    if math.isnan(expected) or math.isnan(obtained) or (metric != "nonfinite" and tolerance.unbounded):
        return False
    return metric_magnitude(metric, obtained) > allowed_error(metric, expected, tolerance, spread)


def is_better(metric: str, expected: float, obtained: float, tolerance: Tolerance, spread: float = 0.0) -> bool:
    """Whether `obtained` improved past the tolerance: its error below error(expected) * (1 - rtol) - atol."""
    if metric == "nonfinite" or math.isnan(expected) or math.isnan(obtained) or tolerance.unbounded:
        return False
    magnitude = metric_magnitude(metric, expected)
    # inf * (1 - 1) is NaN (a baseline at -inf dB): no improvement can be claimed, and NaN compares False.
    return metric_magnitude(metric, obtained) < min(
        magnitude * (1 - tolerance.rtol) - tolerance.atol, magnitude - NOISE_FACTOR * spread
    )


def validated_metrics(metrics: Iterable[str] | str) -> list[str]:
    """The gated metrics as a list; one name given as a string is one metric; none at all is an error."""
    chosen = [metrics] if isinstance(metrics, str) else list(metrics)
    if not chosen:
        raise ConfigurationError("metrics: empty; name at least one metric to gate (default: rms_rel)")
    for metric in chosen:
        if not isinstance(metric, str) or metric not in METRIC_DIRECTIONS or metric in DESCRIPTIVE_METRICS:
            gateable = sorted(set(METRIC_DIRECTIONS) - DESCRIPTIVE_METRICS)
            raise ConfigurationError(f"metrics: unknown metric {metric!r}; gateable metrics: {', '.join(gateable)}")
    return chosen


def matches_key(key: str, record_name: str, kind: str) -> bool:
    return key == kind or re.search(key, record_name) is not None


#: The two quantities of a tolerance.
QUANTITIES = ("rtol", "atol")
#: Tolerances given per metric: {metric: value} for one quantity (rtol or atol).
PerMetric = Mapping[str, float]


def checked_metric(metric: object, setting: str) -> str:
    """A metric a tolerance may name: a gateable metric other than nonfinite (which takes no tolerance)."""
    if metric == "nonfinite":
        raise ConfigurationError(f"{setting}: nonfinite takes no tolerance (any rise above the baseline fails)")
    if not isinstance(metric, str) or metric not in METRIC_DIRECTIONS or metric in DESCRIPTIVE_METRICS:
        gateable = sorted(set(METRIC_DIRECTIONS) - DESCRIPTIVE_METRICS - {"nonfinite"})
        raise ConfigurationError(
            f"{setting}: unknown metric {metric!r}; metrics with a tolerance: {', '.join(gateable)}"
        )
    return metric


def checked_level(value: object, setting: str) -> float | dict[str, float] | None:
    """One level's rtol or atol: None (not given), a number >= 0 for every metric, or {metric: number}."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {
            checked_metric(metric, setting): checked_number(bound, f"{setting}[{metric!r}]", minimum=0.0)
            for metric, bound in value.items()
        }
    return checked_number(value, setting, minimum=0.0)


def level_value(level: float | Mapping[str, float] | None, metric: str | None) -> float | None:
    """The value a level gives `metric`: its number, or its entry for the metric (None: not given)."""
    if level is None:
        return None
    if not isinstance(level, Mapping):
        return float(level)
    return None if metric is None else level.get(metric)


#: A session level's rtol or atol: (a number for every metric or None, {metric: number}).
Level = tuple[float | None, dict[str, float]]


def merged_levels(lower: Level, higher: float | Mapping[str, float] | None) -> Level:
    """A level laid over a lower one: a number at the higher level replaces the lower level entirely (its
    per-metric entries too); per-metric entries of the higher level replace the lower's for those metrics."""
    if higher is None:
        return lower
    if isinstance(higher, Mapping):
        return lower[0], {**lower[1], **higher}
    return float(higher), {}


def parsed_level(text: str, setting: str) -> Level:
    """An ini or command-line rtol/atol: "0.2", "max_rel=0.5", or both ("0.2, max_rel=0.5 sqnr_db=0.01"),
    separated by commas or spaces. A number for every metric, or one metric's, given twice is an error: the
    last would silently win ("0.1 50", "max_rel=0.1 max_rel=50"), and which one was meant is anyone's guess."""
    number: float | None = None
    per_metric: dict[str, float] = {}
    for part in text.replace(",", " ").split():
        metric, equals, value = part.rpartition("=")
        if equals:
            metric = checked_metric(metric.strip(), setting)
        try:
            parsed = float(value)
        except ValueError:
            raise ConfigurationError(f"{setting} must be a number, got {text!r}") from None
        if math.isnan(parsed):
            raise ConfigurationError(f"{setting} is NaN; give a number >= 0 (inf means no bound)")
        if parsed < 0:
            raise ConfigurationError(f"{setting} must be >= 0, got {text!r}")
        if equals:
            if metric in per_metric:
                raise ConfigurationError(
                    f"{setting}: {metric} is given twice in {text!r}; give each metric's value once"
                )
            per_metric[metric] = parsed
        else:
            if number is not None:
                raise ConfigurationError(
                    f"{setting}: two numbers for every metric in {text!r}; give one (and METRIC=VALUE entries)"
                )
            number = parsed
    return number, per_metric


def base_of_levels(rtol: Level, atol: Level) -> tuple[Tolerance, dict[str, dict[str, float]]]:
    """A ToleranceRules' `base` and `base_metrics` from merged rtol and atol levels (default where no number)."""
    default = Tolerance()
    base = Tolerance(
        rtol=default.rtol if rtol[0] is None else rtol[0], atol=default.atol if atol[0] is None else atol[0]
    )
    per_metric: dict[str, dict[str, float]] = {}
    for quantity, (_, values) in (("rtol", rtol), ("atol", atol)):
        for metric, value in values.items():
            per_metric.setdefault(metric, {})[quantity] = value
    return base, per_metric


def level_text(level: Level) -> str:
    """The option text `parsed_level` reads back as `level`."""
    parts = [] if level[0] is None else [repr(level[0])]
    return " ".join(parts + [f"{metric}={value!r}" for metric, value in level[1].items()])


#: The most significant digits a value near 1 is shown with: beyond float64's ~16, digits are rounding noise.
_MAX_DIGITS = 15


def format_value(metric: str, value: float | None) -> str:
    """format_number, except a higher-is-better fraction near 1 (cosine, correlation, agreement), shown with
    enough digits that its distance from 1, the error the gate compares, keeps 3 significant digits: at 4
    digits a baseline of 0.99999 and an allowed 0.99998 both read "1"."""
    if value is None or METRIC_DIRECTIONS.get(metric) != "higher" or metric in DECIBEL_METRICS:
        return format_number(value)
    error = 1.0 - value
    if not 0 < error < 1e-2:
        return format_number(value)
    digits = min(3 - math.floor(math.log10(error)), _MAX_DIGITS)
    return f"{value:.{digits}g}"
