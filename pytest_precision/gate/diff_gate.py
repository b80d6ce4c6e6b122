"""What `pytest-precision diff` gates: the metrics, rtol and atol, each from the first of these that sets it:

  1. the command line (--metric, --rtol, --atol);
  2. for a test of a session report that recorded the gate it ran (its "gate" entry), that gate: its metrics
     where 1 names none, its tolerances where 1 sets neither rtol nor atol. It is what the test's gate checked
     (a call's metrics= and tolerances over the config file's), so it outranks the config file;
  3. what the project's pytest resolves, asked of pytest itself (pytest_gate.py): precision_metrics,
     precision_rtol, precision_atol from its config file, addopts, PYTEST_ADDOPTS, and the -c, --rootdir and
     -o that `diff` passes on; pytest's own refusal of the configuration is an error;
  4. built-in: rms_rel at rtol 0.1, atol 1e-5, the plugin's defaults.

So a review (`diff --against main`) checks by default what the project's gate checks, not less.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import PrecisionError

if TYPE_CHECKING:
    from pytest_precision.gate.tolerance import Level
    from pytest_precision.gate.tolerance_rules import ToleranceRules
    from pytest_precision.reports.report import PrecisionReport

#: Where a part of the gate came from when nothing set it.
BUILT_IN = "built-in"
#: Where a part of the gate came from when the command line set it.
METRIC_FLAG, RTOL_FLAG, ATOL_FLAG = "--metric", "--rtol", "--atol"


@dataclass(frozen=True)
class DiffOptions:
    """What every mode of `diff` compares and shows, and where each part of the gate came from."""

    metrics: Sequence[str]
    tolerances: ToleranceRules
    limit: int
    #: A flag (--metric), where pytest found the setting ("pytest.ini precision_metrics") or BUILT_IN.
    metrics_from: str = BUILT_IN
    rtol_from: str = BUILT_IN
    atol_from: str = BUILT_IN
    #: The config file pytest read, as shown to the user ("" when pytest was not asked).
    config: str = ""
    #: Options of one test, taken from the gate its session report recorded.
    recorded: bool = False

    def describe(self) -> str:
        """ "rtol 0.1", and the metrics with their own rtol: "rtol 0.1 (max_rel 0.5)"; a test's recorded gate
        also names its metrics."""
        text = _quantity(self.tolerances, "rtol")
        if self.recorded:
            text += f" on {', '.join(self.metrics)} (the gate its session report recorded)"
        return text

    def gate_line(self) -> str:
        """One line: what was gated, where each part came from, and which pytest config file was read."""
        config = self.config or "not asked (--metric, --rtol and --atol given)"
        return (
            f"gate: metrics {', '.join(self.metrics)} ({self.metrics_from}); "
            f"{_quantity(self.tolerances, 'rtol')} ({self.rtol_from}); "
            f"{_quantity(self.tolerances, 'atol')} ({self.atol_from}); pytest config: {config}"
        )

    def for_test(self, gate: object, where: str) -> DiffOptions:
        """These options for a test whose session report recorded `gate` (its entry's "gate": the tolerance
        rules and metrics it ran with): the recorded metrics where the command line names none, the recorded
        tolerances where it sets neither rtol nor atol. `where` names the test in errors."""
        from pytest_precision.gate.tolerance import validated_metrics
        from pytest_precision.gate.tolerance_rules import ToleranceRules

        if not isinstance(gate, Mapping):
            return self
        changes: dict[str, Any] = {}
        try:
            if self.metrics_from != METRIC_FLAG and gate.get("metrics"):
                changes["metrics"] = validated_metrics(gate["metrics"])
            if self.rtol_from != RTOL_FLAG and self.atol_from != ATOL_FLAG:
                changes["tolerances"] = ToleranceRules.from_dict(gate)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PrecisionError(f"{where}: its recorded gate is malformed ({error})") from None
        return dataclasses.replace(self, recorded=True, **changes) if changes else self


def _quantity(rules: ToleranceRules, quantity: str) -> str:
    """ "rtol 0.1", with the metrics that have their own: "rtol 0.1 (max_rel 0.5)"."""
    own = [f"{metric} {values[quantity]:g}" for metric, values in rules.base_metrics.items() if quantity in values]
    return f"{quantity} {getattr(rules.base, quantity):g}" + (f" ({', '.join(own)})" if own else "")


def gate_options(
    paths: Sequence[Path],
    metrics: Sequence[str] | None,
    rtol: Level | None,
    atol: Level | None,
    limit: int,
    pytest_args: Sequence[str] = (),
) -> DiffOptions:
    """The options of `diff` on `paths`: `metrics`, `rtol` and `atol` as given on the command line (None: not
    given), else what the project's pytest resolves for `paths` and `pytest_args` (-c, --rootdir, -o), else the
    built-in ones (see the module doc). pytest is not asked when the command line sets all three."""
    from pytest_precision.base.records import METRIC_DIRECTIONS
    from pytest_precision.gate.pytest_gate import PytestGate, ask_pytest
    from pytest_precision.gate.tolerance import DEFAULT_METRICS, base_of_levels
    from pytest_precision.gate.tolerance_rules import ToleranceRules

    if metrics:
        unknown = [m for m in metrics if m not in METRIC_DIRECTIONS]
        if unknown:
            raise PrecisionError(
                f"--metric: unknown metric(s) {', '.join(unknown)}; choose from {', '.join(METRIC_DIRECTIONS)}"
            )
    asked = not (metrics and rtol is not None and atol is not None)
    project = ask_pytest(paths, pytest_args) if asked else PytestGate(config="")
    chosen, metrics_from = list(metrics or project.metrics or DEFAULT_METRICS), METRIC_FLAG
    if not metrics:
        metrics_from = project.source("precision_metrics") if project.metrics else BUILT_IN
    levels: dict[str, Level] = {}
    sources: dict[str, str] = {}
    for quantity, given in (("rtol", rtol), ("atol", atol)):
        if given is not None:
            levels[quantity], sources[quantity] = given, f"--{quantity}"
        else:
            levels[quantity] = getattr(project, quantity)
            unset = levels[quantity] == (None, {})
            sources[quantity] = BUILT_IN if unset else project.source(f"precision_{quantity}")
    base, per_metric = base_of_levels(levels["rtol"], levels["atol"])
    return DiffOptions(
        chosen,
        ToleranceRules(base=base, base_metrics=per_metric),
        limit,
        metrics_from=metrics_from,
        rtol_from=sources["rtol"],
        atol_from=sources["atol"],
        config=project.config,
    )


def recorded_gates(path: Path) -> dict[str, object]:
    """{test id: its "gate" entry} of a session report (empty for a baseline file, which records none)."""
    from pytest_precision.gate.report_files import _read_json

    data = _read_json(path)
    tests = data.get("tests") if "variants" not in data else None
    if not isinstance(tests, Mapping):
        return {}
    return {
        str(nodeid): entry["gate"]
        for nodeid, entry in tests.items()
        if isinstance(entry, Mapping) and entry.get("gate") is not None
    }


def check_carried(reports: Iterable[PrecisionReport], options: DiffOptions) -> None:
    """A PrecisionError when a compared metric is carried by no record of any compared file: the diff would
    compare nothing and call it unchanged."""
    from pytest_precision.gate.checks import uncarried_metrics
    from pytest_precision.numbers.range_stats import RANGE_METRICS

    records = [record for report in reports for variant in report.variants for record in report.records(variant)]
    for metric in uncarried_metrics(records, options.metrics):
        where = (
            "range statistics are measured with compare(..., range_stats=True) only"
            if metric in RANGE_METRICS
            else "log-probability metrics are on logprob rows of causal LMs, cross-engine ones (rho, rms_e_*) in "
            "cross-engine reports"
        )
        raise PrecisionError(
            f"{options.metrics_from}: no tensor of the compared files holds {metric} ({where}); compare a "
            "metric they hold"
        )
