"""Environment-drift rules: how much more relative error a gate allows when the run's environment differs from
its baseline's in a named field ("torch=2.0": a baseline recorded on another torch allows rtol + 2.0).

Numbers move between torch releases (other kernels, other summation orders) without any change of the user's
code. A rule widens every tolerance only while that field differs, says so in the output, and leaves the gate
as tight as before in the environment the baselines were recorded in; refreshing the baselines ends it. The
extra rtol scales each metric's error, its distance from perfect (1 - cosine, the SQNR's amplitude; see
gate/tolerance.py), so "torch=2.0" allows 3.1x the baseline's error on every metric and never accepts anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.reports.environment import DRIFT_DEFAULTS, DRIFT_FIELDS

#: The environment fields a drift rule may name: those that move numbers without a change of the user's code.
DRIFT_RULE_FIELDS = ("torch", "transformers", "numpy", "python", "device", "cpu_capability", "threads", "cuda", "cudnn")


def environment_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """ "name: then in the baseline, now now" for each DRIFT_FIELDS field that differs (a field the baseline does
    not hold counts as its DRIFT_DEFAULTS value, or, without one, as not differing)."""
    differences = []
    for name in DRIFT_FIELDS:
        if name not in recorded and name not in DRIFT_DEFAULTS:
            continue
        then = recorded.get(name, DRIFT_DEFAULTS.get(name))
        if then != current.get(name):
            differences.append(f"{name}: {then!r} in the baseline, {current.get(name)!r} now")
    return differences


def parsed_drift_rtol(text: str, setting: str) -> dict[str, float]:
    """ "torch=2.0 transformers=0.5" (spaces or commas between rules) -> {field: extra rtol}, each field one of
    DRIFT_RULE_FIELDS and each value a finite number >= 0."""
    rules: dict[str, float] = {}
    for part in text.replace(",", " ").split():
        field, equals, value = part.partition("=")
        if not equals or field not in DRIFT_RULE_FIELDS:
            raise ConfigurationError(
                f"{setting}: {part!r} is not FIELD=RTOL with FIELD one of {', '.join(DRIFT_RULE_FIELDS)} "
                "(e.g. 'torch=2.0')"
            )
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise ConfigurationError(f"{setting}: {part!r}: the extra rtol must be a finite number >= 0")
        if field in rules:
            raise ConfigurationError(f"{setting}: {field} is given twice")
        rules[field] = number
    return rules


@dataclass(frozen=True)
class DriftAllowance:
    """The extra rtol a gate allows, and the differing fields that grant it: (field, baseline's, now)."""

    rtol: float
    fields: tuple[tuple[str, Any, Any], ...]

    def describe(self, setting: str = "precision_drift_rtol") -> str:
        """One line for the output: what differs and how much the tolerances widened."""
        what = "; ".join(f"{name}: {then!r} in the baseline, {now!r} now" for name, then, now in self.fields)
        return f"tolerances widened by rtol +{self.rtol:g} ({setting}) for {what}"


def drift_allowance(
    rules: Mapping[str, float], recorded: Mapping[str, Any], current: Mapping[str, Any]
) -> DriftAllowance | None:
    """The allowance the rules grant for a baseline environment `recorded` seen from `current`: the largest
    rule among the fields that differ (None when no ruled field differs). A field the baseline does not hold
    (a file from before it was recorded) counts as not differing."""
    fields = []
    for name, extra in rules.items():
        if name not in recorded:
            continue
        then = recorded[name]
        if then != current.get(name) and extra > 0:
            fields.append((name, then, current.get(name), extra))
    if not fields:
        return None
    return DriftAllowance(max(extra for *_, extra in fields), tuple((n, t, c) for n, t, c, _ in fields))
