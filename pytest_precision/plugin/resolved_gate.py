"""--precision-resolved-gate FILE: the gate this pytest configuration resolves to, written as JSON, and no test
run. `pytest-precision diff` asks pytest this way, so that it gates what pytest gates by construction: pytest
finds and reads the config file (-c, --rootdir, addopts, PYTEST_ADDOPTS, -o, pytest 8's and 9's rules) and the
values come from the constructor the plugin's session uses (PrecisionSession.from_config)."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_precision.base.atomic_files import write_atomically
from pytest_precision.plugin.options import (
    OPTION_ATOL,
    OPTION_DRIFT_RTOL,
    OPTION_METRICS,
    OPTION_RESOLVED_GATE,
    OPTION_RTOL,
)

#: The settings that make up the gate `diff` applies, in the order its gate line names them.
GATE_SETTINGS = (OPTION_METRICS, OPTION_RTOL, OPTION_ATOL, OPTION_DRIFT_RTOL)


def write_resolved_gate(config: pytest.Config) -> int | None:
    """With --precision-resolved-gate FILE: write the resolved gate there and return 0 (pytest stops before
    configuring a session or collecting); else None (pytest goes on). A bad setting is pytest's UsageError,
    as in a test run."""
    target = config.getoption(OPTION_RESOLVED_GATE)
    if target is None:
        return None
    from pytest_precision.plugin.session import PrecisionSession

    session = PrecisionSession.from_config(config)
    resolved: dict[str, Any] = {
        "pytest": pytest.__version__,
        "config": _shown(config, config.inipath),
        "metrics": session.metrics,
        "rtol": list(session.rtol),
        "atol": list(session.atol),
        "drift_rtol": session.drift_rtol,
        "sources": {name: _source(config, name) for name in GATE_SETTINGS},
    }
    path = Path(target)
    path = path if path.is_absolute() else Path(config.invocation_params.dir) / path
    write_atomically(path, json.dumps(resolved))
    return 0


def _shown(config: pytest.Config, path: Path | None) -> str:
    """A config file as the user knows it: relative to the invocation folder when inside it."""
    if path is None:
        return "none found"
    try:
        return path.relative_to(config.invocation_params.dir).as_posix()
    except ValueError:
        return str(path)


def _source(config: pytest.Config, name: str) -> str:
    """Where setting `name` was set: "pytest.ini precision_rtol", "pytest.ini addopts -o precision_rtol",
    "PYTEST_ADDOPTS --precision-rtol", ...; "built-in" when nowhere."""
    flag = f"--{name.replace('_', '-')}"
    ini = _shown(config, config.inipath)
    # pytest parses ini addopts, then PYTEST_ADDOPTS, then the command line: the last one given wins.
    places = [
        ("command line", [str(argument) for argument in config.invocation_params.args]),
        ("PYTEST_ADDOPTS", shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))),
        (f"{ini} addopts", [str(argument) for argument in config.getini("addopts")]),
    ]
    if config.getoption(name) is not None:
        where = next((place for place, arguments in places if _gives_flag(arguments, flag)), "pytest arguments")
        return f"{where} {flag}"
    if config.getini(name) is None:
        return "built-in"
    if not _overridden(config, name):
        return f"{ini} {name}"
    where = next((place for place, arguments in places if _overrides(arguments, name)), "pytest arguments")
    return f"{where} -o {name}"


def _overridden(config: pytest.Config, name: str) -> bool:
    """Whether pytest took ini value `name` from an -o rather than the config file: pytest 9 records each
    value's origin; pytest 8 keeps the -o list (there, an -o in addopts does not override)."""
    values = getattr(config, "_inicfg", None)
    if isinstance(values, dict) and name in values and hasattr(values[name], "origin"):
        return bool(values[name].origin == "override")
    overrides = getattr(config, "_override_ini", ())
    return any(str(override).partition("=")[0].strip() == name for override in overrides)


def _gives_flag(arguments: Sequence[str], flag: str) -> bool:
    return any(argument == flag or argument.startswith(f"{flag}=") for argument in arguments)


def _overrides(arguments: Sequence[str], name: str) -> bool:
    """Whether `arguments` hold -o NAME=..., -oNAME=..., --override-ini NAME=... or --override-ini=NAME=..."""
    for index, argument in enumerate(arguments):
        following = arguments[index + 1] if index + 1 < len(arguments) else ""
        if argument in ("-o", "--override-ini") and following.startswith(f"{name}="):
            return True
        if argument.startswith((f"-o{name}=", f"--override-ini={name}=")):
            return True
    return False
