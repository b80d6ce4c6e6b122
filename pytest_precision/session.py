"""The plugin's per-session state and the baseline check workflow behind `assert_precision_within`."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .environment import DRIFT_DEFAULTS, DRIFT_FIELDS
from .errors import BaselineError, ConfigurationError, PrecisionError

if TYPE_CHECKING:
    from .references import Reference, ReferenceCache
    from .report import PrecisionReport
    from .tolerance import Level, Tolerance

#: ini / command-line option names.
OPTION_BASELINE_DIR = "precision_baseline_dir"
OPTION_RTOL = "precision_rtol"
OPTION_ATOL = "precision_atol"
OPTION_TABLES = "precision_tables"
OPTION_STRICT = "precision_strict"
OPTION_PRUNE = "precision_prune"
OPTION_REPORT = "precision_report"
OPTION_METRICS = "precision_metrics"
OPTION_UPDATE_MODE = "precision_update_mode"
OPTION_FAIL_STALE = "precision_fail_stale"
#: What --update-baselines rewrites: every file whose numbers moved (all), only files whose test fails or
#: that are missing (failing), only missing files (missing).
UPDATE_MODES = ("all", "failing", "missing")
#: dest of --precision-update and --update-baselines (not "update_baselines": a conftest or plugin that
#: defines its own --update-baselines gets that dest by default, and must not switch this plugin's mode).
OPTION_UPDATE = "precision_update"
#: The flag that refreshes baselines in this process, as failure messages print it: --precision-update when
#: another plugin or conftest owns --update-baselines (set by the plugin at configure time).
UPDATE_FLAGS = ["--update-baselines"]

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


def option(config: pytest.Config, name: str) -> Any:
    """The command-line value when given, else the ini value (every option but --update-baselines has one).

    An empty value given on purpose (`--precision-metrics "$M"` or `-o precision_metrics=$M` with M unset, an
    empty ini line) is a UsageError naming the option: read as "not given" it would drop the ini's value for
    the built-in default, and a gate would quietly check less. (The ini twins of text options default to None,
    so that only a value someone wrote can be empty.)
    """
    value = config.getoption(name)
    given = f"--{name.replace('_', '-')}"
    if value is None:
        value, given = config.getini(name), f"ini {name} (in {config.inipath or 'the ini file'} or -o)"
    if isinstance(value, str) and not value.strip():
        raise pytest.UsageError(
            f"{given} is empty (an unset variable?): give it a value, or leave it out for the default "
            f"(the ini's {name}, else the built-in one)"
        )
    return value


def _level_option(config: pytest.Config, name: str) -> Level:
    """A tolerance option (command line, else ini): "0.2", "max_rel=0.5" or both ("0.2 max_rel=0.5"), each a
    number >= 0 or inf (no bound), never NaN."""
    value = option(config, name)
    if value in (None, ""):
        return None, {}
    from .tolerance import parsed_level

    try:
        return parsed_level(str(value), name)
    except ConfigurationError as error:
        raise pytest.UsageError(str(error)) from None


def _metrics_option(config: pytest.Config) -> list[str] | None:
    """--precision-metrics / ini precision_metrics: the gated metrics of calls that name none."""
    value = option(config, OPTION_METRICS)
    if value in (None, ""):
        return None
    from .tolerance import validated_metrics

    try:
        return validated_metrics(str(value).replace(",", " ").split())
    except ConfigurationError as error:
        raise pytest.UsageError(f"{OPTION_METRICS}: {error}") from None


def _update_mode(config: pytest.Config) -> str:
    given = config.getoption(OPTION_UPDATE_MODE)
    if given is not None and not config.getoption(OPTION_UPDATE):
        raise pytest.UsageError(
            f"--precision-update-mode={given} chooses what {UPDATE_FLAGS[0]} rewrites; add {UPDATE_FLAGS[0]}"
        )
    mode = str(given or config.getini(OPTION_UPDATE_MODE) or "all").strip()
    if mode not in UPDATE_MODES:
        raise pytest.UsageError(f"{OPTION_UPDATE_MODE} must be one of {', '.join(UPDATE_MODES)}, got {mode!r}")
    return mode


def _report_dir(config: pytest.Config) -> Path | None:
    value = option(config, OPTION_REPORT)
    if not value:
        return None
    directory = Path(value)
    directory = directory if directory.is_absolute() else Path(config.invocation_params.dir) / directory
    if _is_file(directory):
        raise pytest.UsageError(
            f"--precision-report (or ini precision_report) {value}: {directory} is a file, not a folder; "
            "name a folder for precision-report.json and summary.md"
        )
    return directory


def _is_file(path: Path) -> bool:
    """Whether something other than a folder is at `path` (a path the OS refuses to look at is not)."""
    try:
        return path.exists() and not path.is_dir()
    except OSError:
        return False


def is_folder(path: Path) -> bool:
    """Path.is_dir, False also where the OS refuses to look (a name too long)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes", "on")


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
        if _is_file(directory):
            raise pytest.UsageError(
                f"--precision-baseline-dir (or ini precision_baseline_dir): {directory} is a file, not a folder"
            )
        return cls(
            rootpath=config.rootpath,
            baseline_dir=directory,
            update=bool(config.getoption(OPTION_UPDATE)),
            gpu=bool(config.getoption("precision_gpu")),
            show_tables=_truthy(option(config, OPTION_TABLES)),
            rtol=_level_option(config, OPTION_RTOL),
            atol=_level_option(config, OPTION_ATOL),
            metrics=_metrics_option(config),
            update_mode=_update_mode(config),
            fail_stale=_truthy(option(config, OPTION_FAIL_STALE)),
            strict=_truthy(option(config, OPTION_STRICT)),
            prune=_truthy(option(config, OPTION_PRUNE)),
            report_dir=_report_dir(config),
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
        from . import distributed

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

        from . import distributed

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
        from . import baseline as baselines
        from . import messages
        from .environment import device_key, environment, provenance
        from .tolerance import (
            DEFAULT_METRICS,
            ToleranceRules,
            check_against_baseline,
            check_carried,
            check_limits,
            undefined_metrics,
            validated_metrics,
        )

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
        self._note_drift(shown, loaded.data.get("environment") or {}, report)
        result = check_against_baseline(loaded.records(), obtained, rules, gated_metrics)
        if result.worst_ratio is not None:
            item.user_properties.append(("precision_worst_ratio", f"{result.worst_ratio:.6g}"))
        parts = []
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
            )
        if limit_violations:
            limit_list = self._full_list_hint(item.nodeid, None, rows)
            parts.append(messages.limit_message(limit_violations, order, full_list=limit_list))
        if result.improvements and self.strict:
            parts.append(messages.improvement_message(result.improvements, shown, nodeid, order, full_list=full_list))
        if self.update and self.update_mode == "failing" and parts:
            return update()  # the rewritten file holds this run's numbers: nothing improved against it
        if result.improvements and not self.strict:
            self.improvements[nodeid] = len({(v.variant, v.name, v.kind) for v in result.improvements})
        if self.update and self.update_mode == "failing":
            return "kept", None
        return ("failed", "\n".join(parts)) if parts else ("passed", None)

    def _full_list_hint(self, nodeid: str, baseline: Path | None, rows: int) -> str:
        """Where a failure message's left-out rows are (messages.full_list_hint): this session's report files
        when it writes some, or how to get them."""
        from . import messages
        from .plots import matplotlib_available, plot_path

        report_dir = None if self.report_dir is None else self._shown(self.report_dir)
        plot = None
        if self.report_dir is not None and matplotlib_available():
            plot = self._shown(plot_path(self.report_dir, nodeid))
        return messages.full_list_hint(report_dir, baseline, rows, plot)

    def _note_drift(self, shown: Path, recorded: Mapping[str, Any], report: PrecisionReport) -> None:
        """Remember, once per file, which environment fields differ from the baseline's (never a failure)."""
        from .environment import environment

        current = environment(report.device, {}, report.distributed)
        differences = []
        for name in DRIFT_FIELDS:
            if name not in recorded and name not in DRIFT_DEFAULTS:
                continue
            then = recorded.get(name, DRIFT_DEFAULTS.get(name))
            if then != current.get(name):
                differences.append(f"{name}: {then!r} in the baseline, {current.get(name)!r} now")
        if differences:
            self.drift.setdefault(os.fspath(shown), differences)

    def recorded_loss_scales(self, item: pytest.Item, stem: str | None, device: str) -> dict[str, float]:
        """{variant: loss scale} recorded in the test's baseline file; empty when there is none to read
        (a missing or unreadable file is reported by the gate itself)."""
        from . import baseline as baselines
        from .environment import device_key

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
        from .tolerance import level_text

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
        from . import baseline as baselines
        from .atomic_files import write_atomically

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
        from .tolerance import base_of_levels, checked_level, merged_levels

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

    def summary_lines(self, stale: list[Path] | None = None) -> list[str]:
        """The terminal summary: outcome counts, then improvements, environment warnings and stale files."""
        order = ("written", "updated", "unchanged", "kept", "passed", "failed", "missing")
        parts = [f"{self.outcomes[k]} {k}" for k in order if self.outcomes[k]]
        lines = [f"precision note: {note}" for note in self.notes]
        if parts:
            mode = "update" if self.update else "compare"
            lines.append(f"precision baselines ({mode}, {self._shown(self.baseline_dir)}): {', '.join(parts)}")
        if self.improvements:
            from .messages import refresh_command  # not imported by sessions without precision tests
        for nodeid, count in sorted(self.improvements.items()):
            lines.append(
                f"precision improved: {nodeid}: {count} tensor(s) beyond tolerance; tighten the baseline with: "
                f"{refresh_command(nodeid)}"
            )
        for path, differences in sorted(self.drift.items()):
            lines.append(f"precision environment differs from {path} (numbers may move): {'; '.join(differences)}")
        if stale:
            action = "deleted (--precision-prune)" if self.prune else "no test uses them; delete with --precision-prune"
            lines.append(f"precision stale baselines: {len(stale)} ({action}):")
            lines += [f"  {self._shown(path)}" for path in stale]
        lines += [f"precision error: {error}" for error in self.errors]
        return lines

    def stale_baselines(self) -> list[Path]:
        """Baseline files no collected test owns, after a full run.

        Only the plugin's own files count (baselines.owned_document: its name pattern, its schema and a test
        id); anything else in the folder is never stale. A test that ran its check owns the files it used
        (and those for other devices); a test that was collected but skipped, deselected or stopped before
        its check owns every file recording its id; a file whose test lies in a module or folder that could
        not be fully collected (`protected`) is kept.
        """
        if not is_folder(self.baseline_dir):
            return []
        from .baseline import owned_document, parse_baseline_name
        from .environment import device_key

        current_device = device_key(self.device)
        stale = []
        for path in sorted(self.baseline_dir.rglob("*.json")):
            if str(path) in self.used_paths:
                continue
            data = owned_document(path)
            if data is None:
                continue  # not the plugin's file (or unreadable: its own test reports it)
            test = data["test"]
            name = parse_baseline_name(path.name)
            file_device = name[1] if name else None
            if test in self.collected and (test not in self.checked or file_device != current_device):
                continue
            if self.is_protected(test):
                continue
            stale.append(path)
        return stale

    def is_protected(self, test: str) -> bool:
        """Whether `test` lies in a module or folder this run could not fully collect."""
        return any(
            prefix == "" or test == prefix or test.startswith((f"{prefix}::", f"{prefix}/"))
            for prefix in self.protected
        )

    def write_report(self, stale: list[Path] | None = None) -> Path | None:
        """The session report: one JSON file with the session's environment (versions, device, ISA, GPU, CUDA,
        commit, date), stale baseline files and environment drift, and every precision test's outcome and
        records; summary.md and the plots beside it."""
        if self.report_dir is None:
            return None
        from .atomic_files import write_atomically
        from .baseline import json_ready
        from .environment import session_environment

        path = self.report_dir / "precision-report.json"
        document = {
            "schema_version": 1,
            "baseline_dir": os.fspath(self.baseline_dir),
            "environment": session_environment(self.rootpath, self.device),
            "stale": [os.fspath(self._shown(p)) for p in stale or []],
            "drift": self.drift,
            "tests": self.tests,
        }
        write_atomically(path, json.dumps(json_ready(document), indent=1, sort_keys=True, allow_nan=False) + "\n")
        self._write_summary_and_plots(document)
        return path

    def _write_summary_and_plots(self, document: Mapping[str, Any]) -> None:
        """DIR/summary.md (also appended to $GITHUB_STEP_SUMMARY) and, with matplotlib, one PNG per test,
        linked from the test's section of summary.md."""
        from .baseline import load_baseline
        from .plots import matplotlib_available, plot_error_vs_depth, plot_path
        from .summary import markdown_summary, report_from_entry, write_summary

        assert self.report_dir is not None
        baselines: dict[str, Any] = {}
        for nodeid, entry in self.tests.items():
            try:
                baselines[nodeid] = load_baseline(Path(entry["baseline"]), "").records()
            except (PrecisionError, KeyError):
                continue  # missing or unreadable: the test itself reports it
        self.plots_skipped = not matplotlib_available()
        plotted = (
            [] if self.plots_skipped else [n for n, e in self.tests.items() if "variants" in e and "reference" in e]
        )
        plots = {nodeid: plot_path(self.report_dir, nodeid) for nodeid in plotted}
        text = markdown_summary(
            self.tests,
            baselines,
            environment=document["environment"],
            plots={nodeid: path.relative_to(self.report_dir).as_posix() for nodeid, path in plots.items()},
            stale=document["stale"],
            drift=self.drift,
        )
        write_summary(self.report_dir, text)
        for nodeid, plot in plots.items():
            plot_error_vs_depth(
                report_from_entry(self.tests[nodeid]), plot, baseline=baselines.get(nodeid), title=nodeid
            )


SESSION_KEY = pytest.StashKey[PrecisionSession]()


#: The session's memoized reference runs (see PrecisionRunner.cache).
REFERENCE_CACHE_KEY = pytest.StashKey["ReferenceCache"]()


class PrecisionRunner:
    """The `precision` fixture: `precision.run(model, inputs, variants=[...], **compare_kwargs)`, or
    `ref = precision.reference(model, inputs)` then `precision.run(ref, variants=[...])`."""

    def __init__(self, item: pytest.Item, device: str, session: PrecisionSession) -> None:
        self._item = item
        self._session = session
        self.device = device

    @property
    def cache(self) -> ReferenceCache:
        """The session-wide cache of reference runs, created on first use (one per process)."""
        from .references import ReferenceCache

        stash = self._item.config.stash
        cache = stash.get(REFERENCE_CACHE_KEY, None)
        if cache is None:
            cache = stash[REFERENCE_CACHE_KEY] = ReferenceCache()
        return cache

    @staticmethod
    def _fail_on_bad_stem(baseline: object) -> None:
        __tracebackhide__ = True
        from .baseline import checked_stem

        try:
            checked_stem(baseline)
        except ConfigurationError as error:
            message = f"ConfigurationError: {error}"
        pytest.fail(message, pytrace=False)

    def reference(self, model: Any, inputs: Any, **reference_kwargs: Any) -> Reference:
        """`pytest_precision.reference` on the session's device, memoized in the session's cache."""
        __tracebackhide__ = True
        from .references import reference

        reference_kwargs.setdefault("device", self.device)
        reference_kwargs.setdefault("cache", self.cache)
        try:
            return reference(model, inputs, **reference_kwargs)
        except PrecisionError as error:
            message = f"{type(error).__name__}: {error}"
        pytest.fail(message, pytrace=False)

    def run(
        self,
        model: Any,
        inputs: Any = None,
        variants: Any = None,
        *,
        baseline: str | None = None,
        **compare_kwargs: Any,
    ) -> PrecisionReport:
        """`pytest_precision.compare` on the session's device; the tables are kept for --precision-tables.

        `model` may be a Reference (from `precision.reference`); otherwise the reference run is memoized in
        the session's cache (same model object, parameter values, inputs and options: computed once).
        Comparing against a baseline, fp16 variants reuse the loss scale recorded there (unless `loss_scale=`
        is given), so a gradient crossing a power of two cannot make the gate flap; `baseline` names the
        stem when the test passes one to assert_precision_within too.
        """
        __tracebackhide__ = True
        from .baseline import stem_problem
        from .comparison import compare
        from .references import Reference

        if baseline is not None and (not isinstance(baseline, str) or stem_problem(baseline) is not None):
            self._fail_on_bad_stem(baseline)
        try:
            isolate = marker_isolate(self._item)
        except ConfigurationError as error:
            pytest.fail(f"{type(error).__name__}: {error}", pytrace=False)
        if isolate is not None:
            compare_kwargs.setdefault("isolate", isolate)
        if isinstance(model, Reference):
            device = str(compare_kwargs.get("device") or model.device)
        else:
            compare_kwargs.setdefault("device", self.device)
            compare_kwargs.setdefault("cache", self.cache)
            device = str(compare_kwargs["device"])
        if "loss_scale" not in compare_kwargs and not self._session.update:
            scales = self._session.recorded_loss_scales(self._item, baseline, device)
            from . import distributed

            if distributed.active():  # rank 0's file decides, on every rank
                scales = distributed.exchange(scales)[0]
            if scales:
                compare_kwargs["loss_scale"] = scales
        try:
            report = compare(model, inputs, variants, **compare_kwargs)
        except PrecisionError as error:
            message = f"{type(error).__name__}: {error}"
        else:
            self._item.stash.setdefault(TABLES_KEY, []).append(report.format(full=False))
            self._item.stash.setdefault(ASSERTED_KEY, False)
            return report
        pytest.fail(message, pytrace=False)
