"""The plugin's per-session state and the baseline check workflow behind `assert_precision_within`."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_precision.base.errors import BaselineError, ConfigurationError, PrecisionError
from pytest_precision.plugin.options import (
    OPTION_ATOL,
    OPTION_BASELINE_DIR,
    OPTION_FAIL_STALE,
    OPTION_PRUNE,
    OPTION_RTOL,
    OPTION_STRICT,
    OPTION_TABLES,
    OPTION_UPDATE,
    UPDATE_FLAGS,
    drift_rtol_option,
    is_regular_file,
    level_option,
    metrics_option,
    option,
    report_dir_option,
    truthy,
    update_mode,
)

if TYPE_CHECKING:
    from pytest_precision.gate.drift import DriftAllowance
    from pytest_precision.gate.tolerance import Level, Tolerance
    from pytest_precision.reports.report import PrecisionReport


STEMS_KEY = pytest.StashKey[set[str]]()
TABLES_KEY = pytest.StashKey[list[str]]()
#: Set to False by precision.run and to True by assert_precision_within: False after the test's call
#: means a comparison that nothing gated (see unasserted_run).
ASSERTED_KEY = pytest.StashKey[bool]()


class PrecisionUnassertedWarning(pytest.PytestWarning):
    """A test ran `precision.run` but never called `assert_precision_within`: its numbers gate nothing."""


#: The keywords of @pytest.mark.precision.
MARKER_KEYWORDS = ("rtol", "atol", "isolate")


def marker_isolate(item: pytest.Item) -> bool | None:
    """@pytest.mark.precision(isolate=...): the default `isolate` of the test's precision.run calls."""
    marker = item.get_closest_marker("precision")
    if marker is None or "isolate" not in marker.kwargs:
        return None
    value = marker.kwargs["isolate"]
    if not isinstance(value, bool):
        raise ConfigurationError(f"@pytest.mark.precision(isolate=...) must be True or False, got {value!r}")
    return value


def unasserted_run(item: pytest.Item) -> str | None:
    """The message for a test whose precision.run result nothing gated, else None."""
    if item.stash.get(ASSERTED_KEY, True):
        return None
    return (
        f"{item.nodeid} ran precision.run but never called assert_precision_within, so no baseline or limit "
        "gates its numbers: pass the report to assert_precision_within(report) (or call "
        "pytest_precision.compare directly when the test checks the report itself)"
    )


@dataclass
class PrecisionSession:
    """Options read once, and the outcome counts shown in the terminal summary."""

    rootpath: Path
    baseline_dir: Path
    update: bool
    gpu: bool
    show_tables: bool
    #: The ini / command-line tolerances: (number or None, {metric: number}).
    rtol: Level = field(default_factory=lambda: (None, {}))
    atol: Level = field(default_factory=lambda: (None, {}))
    #: The environment-drift rules (ini / command line): {environment field: extra rtol}; see gate/drift.py.
    drift_rtol: dict[str, float] = field(default_factory=dict)
    #: The ini / command-line gated metrics (None: DEFAULT_METRICS).
    metrics: list[str] | None = None
    update_mode: str = "all"
    fail_stale: bool = False
    strict: bool = False
    prune: bool = False
    report_dir: Path | None = None
    device: str = "cpu"
    outcomes: Counter[str] = field(default_factory=Counter)
    path_owners: dict[Path, str] = field(default_factory=dict)
    #: What xdist workers hand the controller (see export/merge): all JSON-ready.
    improvements: dict[str, int] = field(default_factory=dict)
    drift: dict[str, list[str]] = field(default_factory=dict)
    used_paths: set[str] = field(default_factory=set)
    checked: set[str] = field(default_factory=set)
    collected: set[str] = field(default_factory=set)
    tests: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Test-id prefixes (module, folder or "" for all) whose tests may not all have been collected: a
    #: collection error, a module-level skip, an ignored path. Their baselines are never stale.
    protected: set[str] = field(default_factory=set)
    #: Problems found after the tests ran (two tests sharing a file across workers, a report that could not
    #: be written): shown in the terminal summary, and they fail the run.
    errors: list[str] = field(default_factory=list)
    #: One-line notes for the terminal summary (e.g. --update-baselines owned by another plugin).
    notes: list[str] = field(default_factory=list)
    plots_skipped: bool = False

    @classmethod
    def from_config(cls, config: pytest.Config) -> PrecisionSession:
        directory = Path(option(config, OPTION_BASELINE_DIR) or "baselines")
        if not directory.is_absolute():
            directory = config.rootpath / directory
        if is_regular_file(directory):
            raise pytest.UsageError(
                f"--precision-baseline-dir (or ini precision_baseline_dir): {directory} is a file, not a folder"
            )
        return cls(
            rootpath=config.rootpath,
            baseline_dir=directory,
            update=bool(config.getoption(OPTION_UPDATE)),
            gpu=bool(config.getoption("precision_gpu")),
            show_tables=truthy(option(config, OPTION_TABLES)),
            rtol=level_option(config, OPTION_RTOL),
            atol=level_option(config, OPTION_ATOL),
            drift_rtol=drift_rtol_option(config),
            metrics=metrics_option(config),
            update_mode=update_mode(config),
            fail_stale=truthy(option(config, OPTION_FAIL_STALE)),
            strict=truthy(option(config, OPTION_STRICT)),
            prune=truthy(option(config, OPTION_PRUNE)),
            report_dir=report_dir_option(config),
            device="cuda" if config.getoption("precision_gpu") else "cpu",
        )

    def export(self) -> dict[str, Any]:
        """This process's results, for an xdist worker to send to the controller."""
        return {
            "outcomes": dict(self.outcomes),
            "improvements": self.improvements,
            "drift": self.drift,
            "used_paths": sorted(self.used_paths),
            "checked": sorted(self.checked),
            "collected": sorted(self.collected),
            "protected": sorted(self.protected),
            "path_owners": {os.fspath(path): nodeid for path, nodeid in self.path_owners.items()},
            "tests": self.tests,
        }

    def merge(self, data: Mapping[str, Any]) -> None:
        """Add a worker's exported results to this (controller's) session."""
        self.outcomes.update(data.get("outcomes", {}))
        self.improvements.update(data.get("improvements", {}))
        self.drift.update(data.get("drift", {}))
        self.used_paths.update(data.get("used_paths", []))
        self.checked.update(data.get("checked", []))
        self.collected.update(data.get("collected", []))
        self.protected.update(data.get("protected", []))
        for path, nodeid in data.get("path_owners", {}).items():
            owner = self.path_owners.setdefault(Path(path), nodeid)
            if owner != nodeid:
                self.errors.append(
                    f"{owner} and {nodeid} (on different xdist workers) share the baseline file "
                    f"{self._shown(Path(path))}; give one of them its own baseline='...'"
                )
        for nodeid, entry in data.get("tests", {}).items():
            self.tests.setdefault(nodeid, {}).update(entry)

    def check(
        self,
        item: pytest.Item,
        report: PrecisionReport,
        *,
        baseline: str | None = None,
        rtol: float | Mapping[str, float] | None = None,
        atol: float | Mapping[str, float] | None = None,
        metrics: Iterable[str] | None = None,
        tolerances: Mapping[str, Mapping[str, Any]] | None = None,
        limits: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        """Hold `report` against the test's baseline (or write it with --update-baselines) and its limits.
        Under torch.distributed, rank 0 alone reads and writes the file and every rank gets its verdict."""
        __tracebackhide__ = True
        item.stash[ASSERTED_KEY] = True
        from pytest_precision.distributed import ranks as distributed

        if distributed.active():
            outcome, message = self._gate_on_rank_zero(item, report, baseline, rtol, atol, metrics, tolerances, limits)
        else:
            outcome, message = self._gated(item, report, baseline, rtol, atol, metrics, tolerances, limits)
        self.outcomes[outcome] += 1
        self.tests.setdefault(item.nodeid, {})["baseline_outcome"] = outcome
        # Failed outside the except block, so the message is not chained to the error and shows once.
        if message is not None:
            pytest.fail(message, pytrace=False)

    def _gated(self, item: pytest.Item, report: PrecisionReport, *arguments: Any) -> tuple[str, str | None]:
        """_gate, a PrecisionError as a failed outcome."""
        try:
            return self._gate(item, report, *arguments)
        except PrecisionError as error:
            return "failed", f"{type(error).__name__}: {error}"

    def _gate_on_rank_zero(self, item: pytest.Item, report: PrecisionReport, *arguments: Any) -> tuple[str, str | None]:
        """Rank 0's verdict on every rank, after checking that every rank holds the same report."""
        import hashlib

        from pytest_precision.distributed import ranks as distributed

        digest = hashlib.sha256(json.dumps(report.to_dict(), sort_keys=True, default=repr).encode()).hexdigest()
        verdict: tuple[str, str | None] | None = None
        with distributed.failures_shared():
            if distributed.rank() == 0:
                verdict = self._gated(item, report, *arguments)
        everyone = distributed.exchange((digest, verdict))
        differing = [str(index) for index, (other, _) in enumerate(everyone) if other != everyone[0][0]]
        if differing:
            return "failed", (
                f"the ranks' reports differ (rank(s) {', '.join(differing)} against rank 0): every rank must compare "
                "the same model and variants, each on its own part of the data"
            )
        outcome, message = everyone[0][1]
        return outcome, message

    def _gate(
        self,
        item: pytest.Item,
        report: PrecisionReport,
        baseline: str | None,
        rtol: float | Mapping[str, float] | None,
        atol: float | Mapping[str, float] | None,
        metrics: Iterable[str] | None,
        tolerances: Mapping[str, Mapping[str, Any]] | None,
        limits: Mapping[str, Mapping[str, float]] | None,
    ) -> tuple[str, str | None]:
        """(outcome, failure message or None) of one check."""
        from pytest_precision.gate import baseline as baselines
        from pytest_precision.gate.checks import check_against_baseline, check_carried, check_limits, undefined_metrics
        from pytest_precision.gate.compile_check import compile_failure
        from pytest_precision.gate.drift import drift_allowance, environment_differences
        from pytest_precision.gate.lowbit_check import lowbit_failure
        from pytest_precision.gate.tolerance import DEFAULT_METRICS, validated_metrics
        from pytest_precision.gate.tolerance_rules import ToleranceRules
        from pytest_precision.plugin import messages
        from pytest_precision.reports.environment import device_key, environment, provenance

        if baseline is not None:
            stem = baselines.checked_stem(baseline)
        else:
            stem = baselines.baseline_stem(item.nodeid)
            if baselines.stem_problem(stem) is not None:  # baseline_stem avoids these; a last guard
                raise ConfigurationError(
                    f"{item.nodeid} makes the baseline name {stem!r}: {baselines.stem_problem(stem)}; "
                    "pass baseline='...' to assert_precision_within"
                )
        used = item.stash.setdefault(STEMS_KEY, set())
        if stem in used:
            raise ConfigurationError(
                f"assert_precision_within called twice in {item.nodeid} with baseline stem {stem!r}; give each "
                "call its own baseline='...'"
            )
        used.add(stem)
        path = baselines.baseline_path(self.baseline_dir, self._test_file(item), stem, device_key(report.device))
        self.used_paths.add(str(path))
        self.checked.add(item.nodeid)
        self.tests[item.nodeid] = {
            "baseline": os.fspath(self._shown(path)),
            "reference": report.reference.to_dict(),
            "variants": report.to_dict()["variants"],
            "nonfinite_origin": dict(getattr(report, "nonfinite_origin", {})),
        }
        owner = self.path_owners.setdefault(path, item.nodeid)
        if owner != item.nodeid:
            raise ConfigurationError(
                f"{item.nodeid} and {owner} would share the baseline file {self._shown(path)}; give one of them "
                "its own baseline='...' (test names that differ only in characters a file name cannot hold "
                "sanitise to the same file)"
            )
        base, base_metrics = self._base_tolerances(item)
        rules = ToleranceRules(
            base=base,
            rtol=rtol,
            atol=atol,
            per_tensor={} if tolerances is None else tolerances,
            base_metrics=base_metrics,
        )
        gated_metrics = validated_metrics(metrics if metrics is not None else self.metrics or DEFAULT_METRICS)
        ungated = sorted(rules.named_metrics() - set(gated_metrics))
        if ungated:
            raise ConfigurationError(
                f"assert_precision_within: tolerances for {', '.join(ungated)}, which the gate does not check "
                f"(it gates {', '.join(gated_metrics)}); add them to metrics=[...] or drop their tolerances"
            )
        # What the gate used, so that summary.md lists the gate's own regressions (see summary.section_lines).
        self.tests[item.nodeid]["gate"] = {**rules.to_dict(), "metrics": gated_metrics}
        obtained = {v: report.records(v) for v in report.variants}
        check_carried(obtained, gated_metrics)
        order = {(variant, r.name, r.kind): i for variant, rows in obtained.items() for i, r in enumerate(rows)}
        limit_violations = check_limits(obtained, {} if limits is None else limits)
        nodeid = self._cwd_nodeid(item)
        shown = self._shown(path)

        def update() -> tuple[str, str | None]:
            nonfinite = [(v, r) for v, rows in obtained.items() for r in rows if r.nonfinite]
            if nonfinite:
                return "failed", messages.nonfinite_message(nonfinite, shown)
            undefined = [(v, r, undefined_metrics(r, gated_metrics)) for v, rows in obtained.items() for r in rows]
            if any(names for _, _, names in undefined):
                return "failed", messages.undefined_message([u for u in undefined if u[2]], shown)
            if limit_violations:
                # Limits hold without a baseline: a run that breaks them is not written as the expectation.
                return "failed", messages.limit_message(limit_violations, order) + f"\nNot written: {shown}"
            where = {**environment(report.device, self._flags(report), report.distributed), **provenance(self.rootpath)}
            document = baselines.document(report, item.nodeid, where)
            return self._write(path, document), None

        if self.update and (self.update_mode == "all" or not path.exists()):
            return update()
        if not path.exists():
            missing = messages.missing_baseline_message(shown, nodeid)
            if limit_violations:
                missing += "\n" + messages.limit_message(limit_violations, order)
            return "missing", missing
        try:
            loaded = baselines.load_baseline(path, messages.refresh_command(nodeid), shown=shown)
        except PrecisionError:
            if self.update and self.update_mode == "failing":
                return update()  # a corrupt or old file fails its test: rewrite it
            raise
        recorded, current = loaded.data.get("environment") or {}, environment(report.device, {}, report.distributed)
        differences = environment_differences(recorded, current)
        allowance = drift_allowance(self.drift_rtol, recorded, current)
        self._note_drift(shown, differences, allowance)
        if allowance is not None:
            rules = dataclasses.replace(rules, drift_rtol=allowance.rtol)
            self.tests[item.nodeid]["gate"] = {**rules.to_dict(), "metrics": gated_metrics}
        result = check_against_baseline(loaded.records(), obtained, rules, gated_metrics)
        if result.worst_ratio is not None:
            item.user_properties.append(("precision_worst_ratio", f"{result.worst_ratio:.6g}"))
        # Fewer or other modules converted below 16 bits measure something else (their error may even fall).
        lowbit = lowbit_failure(loaded.data, report, str(shown), messages.refresh_command(nodeid))
        # A compiled variant that compiled other regions, other settings or broke its graphs ran other code.
        compiled = compile_failure(loaded.data, report, str(shown), messages.refresh_command(nodeid))
        # Either one: the run measured other code than its baseline did (and an improvement is not one then).
        measured_otherwise = [text for text in (lowbit, compiled) if text is not None]
        parts = list(measured_otherwise)
        rows = result.gated * len(gated_metrics)
        full_list = self._full_list_hint(item.nodeid, shown, rows)
        if result.violations:
            parts.append(
                messages.regression_message(
                    result.violations,
                    result.gated,
                    shown,
                    nodeid,
                    order,
                    getattr(report, "nonfinite_origin", {}),
                    full_list=full_list,
                )
                + messages.drift_note(differences, allowance)
            )
        if limit_violations:
            limit_list = self._full_list_hint(item.nodeid, None, rows)
            parts.append(messages.limit_message(limit_violations, order, full_list=limit_list))
        if result.improvements and self.strict:
            parts.append(messages.improvement_message(result.improvements, shown, nodeid, order, full_list=full_list))
        if self.update and self.update_mode == "failing" and parts:
            return update()  # the rewritten file holds this run's numbers: nothing improved against it
        if result.improvements and not self.strict and not measured_otherwise:
            self.improvements[nodeid] = len({(v.variant, v.name, v.kind) for v in result.improvements})
        if self.update and self.update_mode == "failing":
            return "kept", None
        return ("failed", "\n".join(parts)) if parts else ("passed", None)

    def _full_list_hint(self, nodeid: str, baseline: Path | None, rows: int) -> str:
        """Where a failure message's left-out rows are (messages.full_list_hint): this session's report files
        when it writes some, or how to get them."""
        from pytest_precision.outputs.plots import matplotlib_available, plot_path
        from pytest_precision.plugin import messages

        report_dir = None if self.report_dir is None else self._shown(self.report_dir)
        plot = None
        if self.report_dir is not None and matplotlib_available():
            plot = self._shown(plot_path(self.report_dir, nodeid))
        return messages.full_list_hint(report_dir, baseline, rows, plot)

    def _note_drift(self, shown: Path, differences: list[str], allowance: DriftAllowance | None) -> None:
        """Remember, once per file, which environment fields differ from the baseline's (never a failure by
        itself) and the drift rule that widened its tolerances."""
        noted = self.drift.setdefault(os.fspath(shown), list(differences)) if differences else None
        if allowance is not None:
            noted = self.drift.setdefault(os.fspath(shown), []) if noted is None else noted
            if allowance.describe() not in noted:
                noted.append(allowance.describe())

    def recorded_loss_scales(self, item: pytest.Item, stem: str | None, device: str) -> dict[str, float]:
        """{variant: loss scale} recorded in the test's baseline file; empty when there is none to read
        (a missing or unreadable file is reported by the gate itself)."""
        from pytest_precision.gate import baseline as baselines
        from pytest_precision.reports.environment import device_key

        path = baselines.baseline_path(
            self.baseline_dir, self._test_file(item), stem or baselines.baseline_stem(item.nodeid), device_key(device)
        )
        if not path.is_file():
            return {}
        try:
            return baselines.load_baseline(path, "").loss_scales()
        except PrecisionError:
            return {}  # a corrupt file (a loss scale that is no power of two, ...): the gate fails on it

    def forwarded_options(self) -> list[str]:
        """This session's precision options as command-line arguments, for the ranks the marker launches."""
        arguments = ["--precision-baseline-dir", os.fspath(self.baseline_dir)]
        if self.update:
            arguments.append(UPDATE_FLAGS[0])
        if self.gpu:
            arguments.append("--precision-gpu")
        if self.strict:
            arguments.append("--precision-strict")
        from pytest_precision.gate.tolerance import level_text

        for flag, level in (("--precision-rtol", self.rtol), ("--precision-atol", self.atol)):
            if level != (None, {}):
                arguments += [flag, level_text(level)]
        if self.metrics is not None:
            arguments += ["--precision-metrics", ",".join(self.metrics)]
        if self.update:
            arguments += ["--precision-update-mode", self.update_mode]
        if self.fail_stale:
            arguments.append("--precision-fail-stale")
        return arguments

    def _write(self, path: Path, document: dict[str, Any]) -> str:
        """Write the baseline unless its numbers did not move; the outcome: written, updated or unchanged.
        A file that cannot be written (read-only folder, a folder in its place, a name too long) is a
        BaselineError naming it and the OS error."""
        from pytest_precision.base.atomic_files import write_atomically
        from pytest_precision.gate import baseline as baselines

        try:
            if path.is_file() and baselines.numbers_unchanged(path, document):
                return "unchanged"
            outcome = "updated" if path.exists() else "written"
            write_atomically(path, baselines.render(document))
        except OSError as error:
            where = error.filename2 or error.filename
            reason = f"{error.strerror or error}" + (f": {where}" if where else "")
            raise BaselineError(
                f"cannot write precision baseline {self._shown(path)} ({reason}); make its folder writable "
                "and the path free for a file, or choose another folder with --precision-baseline-dir"
            ) from None
        return outcome

    @staticmethod
    def _flags(report: PrecisionReport) -> dict[str, Any]:
        return dict(report.reference.backend["settings"])

    def _base_tolerances(self, item: pytest.Item) -> tuple[Tolerance, dict[str, dict[str, float]]]:
        """The session levels merged: the default, under the ini / command line, under the test's marker.
        (number for every metric, {metric: {"rtol": .., "atol": ..}})."""
        from pytest_precision.gate.tolerance import base_of_levels, checked_level, merged_levels

        marker = item.get_closest_marker("precision")
        levels = {"rtol": self.rtol, "atol": self.atol}
        if marker is not None:
            unknown = sorted(set(marker.kwargs) - set(MARKER_KEYWORDS))
            if unknown or marker.args:
                raise ConfigurationError(
                    f"@pytest.mark.precision takes the keywords {', '.join(MARKER_KEYWORDS)} only, got "
                    f"{marker.args or unknown}"
                )
            for quantity in levels:
                given = checked_level(marker.kwargs.get(quantity), f"@pytest.mark.precision({quantity}=...)")
                levels[quantity] = merged_levels(levels[quantity], given)
        return base_of_levels(levels["rtol"], levels["atol"])

    def _test_file(self, item: pytest.Item) -> str:
        try:
            return os.fspath(item.path.relative_to(self.rootpath))
        except ValueError:
            return item.path.name

    @staticmethod
    def _cwd_nodeid(item: pytest.Item) -> str:
        """The node id as a command typed where pytest was started can use it (node ids are rootdir-relative)."""
        _, separator, rest = item.nodeid.partition("::")
        try:
            relative = os.path.relpath(item.path, item.config.invocation_params.dir)
        except ValueError:
            return item.nodeid
        return f"{relative}{separator}{rest}"

    def _shown(self, path: Path) -> Path:
        try:
            return path.relative_to(Path.cwd())
        except ValueError:
            return path

    def is_protected(self, test: str) -> bool:
        """Whether `test` lies in a module or folder this run could not fully collect."""
        return any(
            prefix == "" or test == prefix or test.startswith((f"{prefix}::", f"{prefix}/"))
            for prefix in self.protected
        )


SESSION_KEY = pytest.StashKey[PrecisionSession]()
