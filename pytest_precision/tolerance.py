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

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Literal

from .errors import ConfigurationError
from .metrics import DESCRIPTIVE_METRICS, METRIC_DIRECTIONS, OPTIONAL_METRICS, SIGNED_METRICS
from .report import KINDS, Record

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
    if tolerance.unbounded:
        return -math.inf if direction == "higher" else math.inf
    noise = NOISE_FACTOR * spread
    if direction == "higher":
        return min(_scaled(expected, 1 - tolerance.rtol) - tolerance.atol, expected - noise)
    magnitude = _magnitude(metric, expected)
    return max(magnitude * (1 + tolerance.rtol) + tolerance.atol, magnitude + noise)


def _scaled(value: float, factor: float) -> float:
    """value * factor, with 0 for a zero factor even when value is infinite (sqnr_db of an exact tensor)."""
    return 0.0 if factor == 0 else value * factor


def is_worse(metric: str, expected: float, obtained: float, tolerance: Tolerance, spread: float = 0.0) -> bool:
    """Whether `obtained` regressed past the tolerance of `expected` in the metric's direction."""
    if math.isnan(expected) or math.isnan(obtained) or (metric != "nonfinite" and tolerance.unbounded):
        return False
    allowed = allowed_value(metric, expected, tolerance, spread)
    if METRIC_DIRECTIONS.get(metric, "lower") == "higher":
        return obtained < allowed
    return _magnitude(metric, obtained) > allowed


def is_better(metric: str, expected: float, obtained: float, tolerance: Tolerance, spread: float = 0.0) -> bool:
    """Whether `obtained` improved past the tolerance: below expected * (1 - rtol) - atol (mirrored)."""
    if metric == "nonfinite" or math.isnan(expected) or math.isnan(obtained) or tolerance.unbounded:
        return False
    noise = NOISE_FACTOR * spread
    if METRIC_DIRECTIONS.get(metric, "lower") == "higher":
        return obtained > max(expected * (1 + tolerance.rtol) + tolerance.atol, expected + noise)
    magnitude = _magnitude(metric, expected)
    return _magnitude(metric, obtained) < min(magnitude * (1 - tolerance.rtol) - tolerance.atol, magnitude - noise)


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


def _matches(key: str, record_name: str, kind: str) -> bool:
    return key == kind or re.search(key, record_name) is not None


#: The two quantities of a tolerance.
QUANTITIES = ("rtol", "atol")
#: Tolerances given per metric: {metric: value} for one quantity (rtol or atol).
PerMetric = Mapping[str, float]


def _checked_metric(metric: object, setting: str) -> str:
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
            _checked_metric(metric, setting): checked_number(bound, f"{setting}[{metric!r}]", minimum=0.0)
            for metric, bound in value.items()
        }
    return checked_number(value, setting, minimum=0.0)


def _level_value(level: float | Mapping[str, float] | None, metric: str | None) -> float | None:
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
            metric = _checked_metric(metric.strip(), setting)
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


@dataclass(frozen=True)
class ToleranceRules:
    """The tolerance of each (tensor, metric), from the first of these that gives one, rtol and atol apart:

      1. the call's `rtol=` / `atol=` (a number: every metric; a dict: the metrics it names);
      2. `tolerances=`: the first tensor key that matches (a kind, or a regex found in the tensor's name),
         its entry for the metric ({"max_rel": {"rtol": 0.5}}), then its own "rtol" / "atol";
      3. `tolerances=`, a key that is a metric name ({"max_rel": {"rtol": 0.5}}): that metric on every tensor;
      4. the session's per-metric values (`base_metrics`: ini / command line, then the marker);
      5. the session's number (`base`: ini / command line, then the marker, then the default).

    Per-tensor keys are tried in order; the first that matches a tensor is its entry, and later tensor keys
    are not consulted for it. A key equal to a metric name is a metric key, never a regex.
    """

    base: Tolerance = Tolerance()
    rtol: float | Mapping[str, float] | None = None
    atol: float | Mapping[str, float] | None = None
    per_tensor: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: {metric: {"rtol": .., "atol": ..}} of the session levels (ini, command line, marker), already merged.
    base_metrics: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in QUANTITIES:
            checked_level(getattr(self, name), f"assert_precision_within({name}=...)")
        if not isinstance(self.per_tensor, Mapping):
            raise ConfigurationError(
                f"tolerances must be a dict {{tensor regex, kind or metric: {{'rtol': .., 'atol': ..}}}}, got "
                f"{type(self.per_tensor).__name__}"
            )
        for key, values in self.per_tensor.items():
            _check_key(key, "tolerances")
            if not isinstance(values, Mapping):
                raise ConfigurationError(f"tolerances[{key!r}] must be a dict like {{'rtol': 0.2}}, got {values!r}")
            nested = key not in METRIC_DIRECTIONS  # a tensor key may hold per-metric entries
            for name, value in values.items():
                setting = f"tolerances[{key!r}][{name!r}]"
                if name in QUANTITIES:
                    checked_number(value, setting, minimum=0.0)
                elif nested and isinstance(name, str) and name in METRIC_DIRECTIONS:
                    _checked_metric(name, setting)
                    _check_quantities(value, setting)
                else:
                    also = ", or metric names with their own {'rtol': ..}" if nested else ""
                    raise ConfigurationError(
                        f"tolerances[{key!r}]: unknown key {name!r}; use 'rtol' and/or 'atol'{also}"
                    )
            if not nested:
                _checked_metric(key, f"tolerances[{key!r}]")
        for metric, values in self.base_metrics.items():
            _checked_metric(metric, "per-metric tolerance")
            _check_quantities(values, f"per-metric tolerance {metric!r}")

    def for_metric(self, name: str, kind: str, metric: str | None) -> Tolerance:
        """The tolerance of `metric` on tensor `name` of `kind` (metric None: the tensor's own, for every
        metric without an entry of its own)."""
        entry: Mapping[str, Any] = {}
        for key, values in self.per_tensor.items():
            if key not in METRIC_DIRECTIONS and _matches(key, name, kind):
                entry = values
                break
        by_metric: Mapping[str, Any] = {} if metric is None else self.per_tensor.get(metric, {})
        found = []
        for quantity in QUANTITIES:
            candidates = (
                _level_value(getattr(self, quantity), metric),
                (entry.get(metric) or {}).get(quantity) if metric is not None else None,
                entry.get(quantity),
                by_metric.get(quantity),
                (self.base_metrics.get(metric) or {}).get(quantity) if metric is not None else None,
                getattr(self.base, quantity),
            )
            found.append(next(float(value) for value in candidates if value is not None))
        return Tolerance(rtol=found[0], atol=found[1])

    def for_tensor(self, name: str, kind: str) -> Tolerance:
        """The tensor's tolerance for metrics that no entry names."""
        return self.for_metric(name, kind, None)

    def named_metrics(self) -> set[str]:
        """The metrics the call's own tolerances name (rtol / atol dicts, `tolerances=` metric keys and
        entries): a tolerance for a metric the gate does not check is a mistake worth an error."""
        named = {m for level in (self.rtol, self.atol) if isinstance(level, Mapping) for m in level}
        for key, values in self.per_tensor.items():
            if key in METRIC_DIRECTIONS:
                named.add(key)
            named.update(name for name in values if name not in QUANTITIES)
        return named

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (infinities as floats; json_ready writes them as "inf"); per-tensor keys as an ordered
        list of pairs, so that first-match order survives sorted JSON."""
        return {
            "base": {"rtol": float(self.base.rtol), "atol": float(self.base.atol)},
            "base_metrics": {m: {q: float(v) for q, v in values.items()} for m, values in self.base_metrics.items()},
            "rtol": _level_json(self.rtol),
            "atol": _level_json(self.atol),
            "tolerances": [[key, _entry_json(values)] for key, values in self.per_tensor.items()],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToleranceRules:
        """The rules `to_dict` wrote (also after json_ready: "inf" / "-inf" strings are read back; also the
        files of versions without per-metric tolerances)."""
        from .baseline import restored_float

        def level(value: Any) -> float | dict[str, float] | None:
            if value is None:
                return None
            if isinstance(value, Mapping):
                return {str(m): restored_float(v) for m, v in value.items()}
            return float(restored_float(value))

        def entry(values: Mapping[str, Any]) -> dict[str, Any]:
            return {
                str(k): {q: restored_float(x) for q, x in v.items()} if isinstance(v, Mapping) else restored_float(v)
                for k, v in values.items()
            }

        base = data.get("base") or {}
        return cls(
            base=Tolerance(
                rtol=restored_float(base.get("rtol", DEFAULT_RTOL)), atol=restored_float(base.get("atol", DEFAULT_ATOL))
            ),
            rtol=level(data.get("rtol")),
            atol=level(data.get("atol")),
            per_tensor={str(key): entry(values) for key, values in data.get("tolerances") or []},
            base_metrics={str(m): entry(values) for m, values in (data.get("base_metrics") or {}).items()},
        )


def _check_quantities(values: object, setting: str) -> None:
    """A {"rtol": .., "atol": ..} dict (either key may be absent), each a number >= 0."""
    if not isinstance(values, Mapping) or not values:
        raise ConfigurationError(f"{setting} must be a dict like {{'rtol': 0.2}}, got {values!r}")
    unknown = sorted(str(k) for k in set(values) - set(QUANTITIES))
    if unknown:
        raise ConfigurationError(f"{setting}: unknown key(s) {', '.join(unknown)}; use 'rtol' and/or 'atol'")
    for quantity, value in values.items():
        checked_number(value, f"{setting}[{quantity!r}]", minimum=0.0)


def _level_json(level: float | Mapping[str, float] | None) -> float | dict[str, float] | None:
    if level is None:
        return None
    if isinstance(level, Mapping):
        return {m: float(v) for m, v in level.items()}
    return float(level)


def _entry_json(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: {q: float(x) for q, x in v.items()} if isinstance(v, Mapping) else float(v) for k, v in values.items()}


def _check_key(key: object, argument: str) -> None:
    """A tolerances/limits key: a kind or a regex, as a string that compiles."""
    if not isinstance(key, str):
        raise ConfigurationError(f"{argument}: key {key!r} must be a string (a kind or a tensor-name regex)")
    _compile(key, argument)


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
            _check_tensor(variant, before, record, rules, gated_metrics, tally)
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
        _check_key(key, "limits")
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
    return _magnitude(metric, value) > bound


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
                if not _matches(key, record.name, record.kind):
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
    from .metrics import RANGE_METRICS

    if metric in RANGE_METRICS:
        return "no tensor it applies to carries it: range statistics need compare(..., range_stats=True)"
    return "no tensor it applies to carries it (log-probability metrics are on logprob rows of causal LMs only)"


def check_carried(obtained: Mapping[str, Sequence[Record]], metrics: Iterable[str]) -> None:
    """A ConfigurationError when a gated metric is carried by no record of the run (see uncarried_metrics)."""
    for metric in uncarried_metrics((r for rows in obtained.values() for r in rows), metrics):
        raise ConfigurationError(f"metrics: {metric!r} is gated, but {_not_carried(metric)}")
