"""The tolerance of each (tensor, metric) from the levels a test gives (call, marker, ini, command line, defaults),
and the JSON a report file records of them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import METRIC_DIRECTIONS
from pytest_precision.gate.tolerance import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    QUANTITIES,
    Tolerance,
    checked_level,
    checked_metric,
    checked_number,
    level_value,
    matches_key,
)


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

    base: Tolerance = Tolerance()  # noqa: RUF009  (Tolerance is a frozen dataclass: one shared default is safe)
    rtol: float | Mapping[str, float] | None = None
    atol: float | Mapping[str, float] | None = None
    per_tensor: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: {metric: {"rtol": .., "atol": ..}} of the session levels (ini, command line, marker), already merged.
    base_metrics: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    #: Added to every rtol: an environment-drift rule's allowance while the baseline's environment differs
    #: (see gate/drift.py); 0 otherwise.
    drift_rtol: float = 0.0

    def __post_init__(self) -> None:
        for name in QUANTITIES:
            checked_level(getattr(self, name), f"assert_precision_within({name}=...)")
        if not isinstance(self.per_tensor, Mapping):
            raise ConfigurationError(
                f"tolerances must be a dict {{tensor regex, kind or metric: {{'rtol': .., 'atol': ..}}}}, got "
                f"{type(self.per_tensor).__name__}"
            )
        for key, values in self.per_tensor.items():
            check_key(key, "tolerances")
            if not isinstance(values, Mapping):
                raise ConfigurationError(f"tolerances[{key!r}] must be a dict like {{'rtol': 0.2}}, got {values!r}")
            nested = key not in METRIC_DIRECTIONS  # a tensor key may hold per-metric entries
            for name, value in values.items():
                setting = f"tolerances[{key!r}][{name!r}]"
                if name in QUANTITIES:
                    checked_number(value, setting, minimum=0.0)
                elif nested and isinstance(name, str) and name in METRIC_DIRECTIONS:
                    checked_metric(name, setting)
                    _check_quantities(value, setting)
                else:
                    also = ", or metric names with their own {'rtol': ..}" if nested else ""
                    raise ConfigurationError(
                        f"tolerances[{key!r}]: unknown key {name!r}; use 'rtol' and/or 'atol'{also}"
                    )
            if not nested:
                checked_metric(key, f"tolerances[{key!r}]")
        checked_number(self.drift_rtol, "drift_rtol", minimum=0.0)
        for metric, values in self.base_metrics.items():
            checked_metric(metric, "per-metric tolerance")
            _check_quantities(values, f"per-metric tolerance {metric!r}")

    def for_metric(self, name: str, kind: str, metric: str | None) -> Tolerance:
        """The tolerance of `metric` on tensor `name` of `kind` (metric None: the tensor's own, for every
        metric without an entry of its own)."""
        entry: Mapping[str, Any] = {}
        for key, values in self.per_tensor.items():
            if key not in METRIC_DIRECTIONS and matches_key(key, name, kind):
                entry = values
                break
        by_metric: Mapping[str, Any] = {} if metric is None else self.per_tensor.get(metric, {})
        found = []
        for quantity in QUANTITIES:
            candidates = (
                level_value(getattr(self, quantity), metric),
                (entry.get(metric) or {}).get(quantity) if metric is not None else None,
                entry.get(quantity),
                by_metric.get(quantity),
                (self.base_metrics.get(metric) or {}).get(quantity) if metric is not None else None,
                getattr(self.base, quantity),
            )
            found.append(next(float(value) for value in candidates if value is not None))
        return Tolerance(rtol=found[0] + self.drift_rtol, atol=found[1])

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
            "drift_rtol": float(self.drift_rtol),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToleranceRules:
        """The rules `to_dict` wrote (also after json_ready: "inf" / "-inf" strings are read back; also the
        files of versions without per-metric tolerances)."""
        from pytest_precision.gate.baseline import restored_float

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
            drift_rtol=float(restored_float(data.get("drift_rtol", 0.0))),
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


def check_key(key: object, argument: str) -> None:
    """A tolerances/limits key: a kind or a regex, as a string that compiles."""
    if not isinstance(key, str):
        raise ConfigurationError(f"{argument}: key {key!r} must be a string (a kind or a tensor-name regex)")
    _compile(key, argument)


def _compile(key: str, argument: str) -> None:
    try:
        re.compile(key)
    except re.error as error:
        raise ConfigurationError(f"{argument}: {key!r} is not a valid regex ({error})") from None
