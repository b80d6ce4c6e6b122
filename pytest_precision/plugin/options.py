"""The plugin's command-line options and their ini twins: declared, then read (a given option wins over its
ini twin; `default=None` keeps "not given" visible)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_precision.base.errors import ConfigurationError

if TYPE_CHECKING:
    from pytest_precision.gate.tolerance import Level


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
OPTION_DRIFT_RTOL = "precision_drift_rtol"
#: --precision-resolved-gate FILE (no ini twin): write the resolved gate as JSON and stop (resolved_gate.py).
OPTION_RESOLVED_GATE = "precision_resolved_gate"
#: What --update-baselines rewrites: every file whose numbers moved (all), only files whose test fails or
#: that are missing (failing), only missing files (missing).
UPDATE_MODES = ("all", "failing", "missing")
#: dest of --precision-update and --update-baselines (not "update_baselines": a conftest or plugin that
#: defines its own --update-baselines gets that dest by default, and must not switch this plugin's mode).
OPTION_UPDATE = "precision_update"
#: The flag that refreshes baselines in this process, as failure messages print it: --precision-update when
#: another plugin or conftest owns --update-baselines (set by the plugin at configure time).
UPDATE_FLAGS = ["--update-baselines"]
#: Set when another plugin or a conftest defines --update-baselines: this plugin then answers to
#: --precision-update only.
ALIAS_TAKEN_KEY = pytest.StashKey[bool]()

GROUP = "precision"
UPDATE_ALIAS = "--update-baselines"
UPDATE_HELP = "write precision baselines instead of comparing against them (no ini twin, on purpose)"


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


def level_option(config: pytest.Config, name: str) -> Level:
    """A tolerance option (command line, else ini): "0.2", "max_rel=0.5" or both ("0.2 max_rel=0.5"), each a
    number >= 0 or inf (no bound), never NaN."""
    value = option(config, name)
    if value in (None, ""):
        return None, {}
    from pytest_precision.gate.tolerance import parsed_level

    try:
        return parsed_level(str(value), name)
    except ConfigurationError as error:
        raise pytest.UsageError(str(error)) from None


def drift_rtol_option(config: pytest.Config) -> dict[str, float]:
    """--precision-drift-rtol / ini precision_drift_rtol: {environment field: extra rtol} (empty: no rules)."""
    value = option(config, OPTION_DRIFT_RTOL)
    if value in (None, ""):
        return {}
    from pytest_precision.gate.drift import parsed_drift_rtol

    try:
        return parsed_drift_rtol(str(value), OPTION_DRIFT_RTOL)
    except ConfigurationError as error:
        raise pytest.UsageError(str(error)) from None


def metrics_option(config: pytest.Config) -> list[str] | None:
    """--precision-metrics / ini precision_metrics: the gated metrics of calls that name none."""
    value = option(config, OPTION_METRICS)
    if value in (None, ""):
        return None
    from pytest_precision.gate.tolerance import validated_metrics

    try:
        return validated_metrics(str(value).replace(",", " ").split())
    except ConfigurationError as error:
        raise pytest.UsageError(f"{OPTION_METRICS}: {error}") from None


def update_mode(config: pytest.Config) -> str:
    given = config.getoption(OPTION_UPDATE_MODE)
    if given is not None and not config.getoption(OPTION_UPDATE):
        raise pytest.UsageError(
            f"--precision-update-mode={given} chooses what {UPDATE_FLAGS[0]} rewrites; add {UPDATE_FLAGS[0]}"
        )
    mode = str(given or config.getini(OPTION_UPDATE_MODE) or "all").strip()
    if mode not in UPDATE_MODES:
        raise pytest.UsageError(f"{OPTION_UPDATE_MODE} must be one of {', '.join(UPDATE_MODES)}, got {mode!r}")
    return mode


def report_dir_option(config: pytest.Config) -> Path | None:
    value = option(config, OPTION_REPORT)
    if not value:
        return None
    directory = Path(value)
    directory = directory if directory.is_absolute() else Path(config.invocation_params.dir) / directory
    if is_regular_file(directory):
        raise pytest.UsageError(
            f"--precision-report (or ini precision_report) {value}: {directory} is a file, not a folder; "
            "name a folder for precision-report.json and summary.md"
        )
    return directory


def is_regular_file(path: Path) -> bool:
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


def truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def add_options(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    group = parser.getgroup(GROUP, "numerical precision gates (pytest-precision)")
    # --update-baselines is added after the initial conftests (pytest_load_initial_conftests), so that a
    # conftest or plugin defining it wins the name instead of failing with an argparse conflict; loaded
    # from a conftest's pytest_plugins, this plugin comes too late for that hook and adds it now.
    if getattr(pluginmanager, "_conftest_plugins", None) and not add_update_alias(parser):
        config = pluginmanager.get_plugin("pytestconfig")
        if isinstance(config, pytest.Config):
            config.stash[ALIAS_TAKEN_KEY] = True
    group.addoption(
        "--precision-update",
        action="store_true",
        default=False,
        dest=OPTION_UPDATE,
        help=f"like {UPDATE_ALIAS}, always available (when another plugin or conftest owns {UPDATE_ALIAS})",
    )
    group.addoption(
        "--precision-gpu",
        action="store_true",
        default=None,
        dest="precision_gpu",
        help="run precision tests on CUDA and run tests marked precision_gpu (error if no CUDA device)",
    )
    group.addoption(
        "--precision-baseline-dir",
        default=None,
        dest=OPTION_BASELINE_DIR,
        metavar="DIR",
        help="folder of baseline files, relative to rootdir (default: baselines)",
    )
    group.addoption(
        "--precision-update-mode",
        default=None,
        dest=OPTION_UPDATE_MODE,
        choices=UPDATE_MODES,
        help=f"what {UPDATE_ALIAS} rewrites: all files whose numbers moved (default), failing (only files whose "
        "test fails, and missing ones), missing (only missing files)",
    )
    group.addoption(
        "--precision-rtol",
        default=None,
        dest=OPTION_RTOL,
        metavar="RTOL",
        help="default relative tolerance (0.10); per metric as METRIC=RTOL, e.g. '0.1 max_rel=0.5'",
    )
    group.addoption(
        "--precision-drift-rtol",
        default=None,
        dest=OPTION_DRIFT_RTOL,
        metavar="RULES",
        help="environment-drift rules: extra rtol while the baseline's environment differs in a field, e.g. "
        "'torch=2.0' (fields: torch, transformers, numpy, python, device, cpu_capability, threads, cuda, cudnn)",
    )
    group.addoption(
        "--precision-atol",
        default=None,
        dest=OPTION_ATOL,
        metavar="ATOL",
        help="default absolute tolerance (1e-5); per metric as METRIC=ATOL, e.g. '1e-5 max_abs=1e-3'",
    )
    group.addoption(
        "--precision-metrics",
        default=None,
        dest=OPTION_METRICS,
        metavar="METRICS",
        help="metrics gated when a test names none, comma-separated (default rms_rel)",
    )
    group.addoption(
        "--precision-fail-stale",
        action="store_true",
        default=None,
        dest=OPTION_FAIL_STALE,
        help="fail the session when baseline files no test uses remain (after a full run; also --precision-strict)",
    )
    group.addoption(
        "--precision-tables",
        action="store_true",
        default=None,
        dest=OPTION_TABLES,
        help="print each precision test's error-propagation tables in the terminal summary",
    )
    group.addoption(
        "--precision-strict",
        action="store_true",
        default=None,
        dest=OPTION_STRICT,
        help="fail a test whose error improved beyond tolerance, until its baseline is tightened, and fail the "
        "session on stale baseline files",
    )
    group.addoption(
        "--precision-prune",
        action="store_true",
        default=None,
        dest=OPTION_PRUNE,
        help="delete baseline files no test uses (after a full run only)",
    )
    group.addoption(
        "--precision-report",
        default=None,
        dest=OPTION_REPORT,
        metavar="DIR",
        help="write DIR/precision-report.json: every precision test's outcome, baseline and records",
    )
    group.addoption(
        "--precision-resolved-gate",
        default=None,
        dest=OPTION_RESOLVED_GATE,
        metavar="FILE",
        help="write the gate this configuration resolves to (metrics, rtol, atol, drift rules, where each was "
        "set) to FILE as JSON and exit without running tests; pytest-precision diff asks pytest this way",
    )
    parser.addini("precision_gpu", "like --precision-gpu", type="bool", default=False)
    parser.addini(OPTION_STRICT, "like --precision-strict", type="bool", default=False)
    parser.addini(OPTION_PRUNE, "like --precision-prune", type="bool", default=False)
    parser.addini(OPTION_REPORT, "like --precision-report", default=None)
    parser.addini(OPTION_BASELINE_DIR, "like --precision-baseline-dir", default="baselines")
    parser.addini(OPTION_RTOL, "like --precision-rtol", default=None)
    parser.addini(OPTION_ATOL, "like --precision-atol", default=None)
    parser.addini(OPTION_DRIFT_RTOL, "like --precision-drift-rtol", default=None)
    parser.addini(OPTION_TABLES, "like --precision-tables", type="bool", default=False)
    parser.addini(OPTION_METRICS, "like --precision-metrics (space- or comma-separated)", default=None)
    parser.addini(OPTION_UPDATE_MODE, "like --precision-update-mode (all, failing, missing)", default="all")
    parser.addini(OPTION_FAIL_STALE, "like --precision-fail-stale", type="bool", default=False)


def add_update_alias(parser: pytest.Parser) -> bool:
    """Add --update-baselines (first in this plugin's help group) unless it is taken; whether it was added."""
    # pytest < 9 keeps a conftest's own parser.addoption(...) in parser._anonymous, outside parser._groups.
    groups = [*parser._groups, getattr(parser, "_anonymous", None)]
    taken = {name for group in groups if group is not None for argument in group.options for name in argument.names()}
    if UPDATE_ALIAS in taken:
        return False
    group = parser.getgroup(GROUP)
    group.addoption(UPDATE_ALIAS, action="store_true", default=False, dest=OPTION_UPDATE, help=UPDATE_HELP)
    # Shown first in --help, where it always was. pytest >= 9 also keeps an argparse group whose own list sets
    # the order; before 9 the options list alone does.
    group.options.insert(0, group.options.pop())
    argparse_group = getattr(group, "_arggroup", None)
    if argparse_group is not None:
        actions = argparse_group._group_actions
        actions.insert(0, actions.pop())
    return True
