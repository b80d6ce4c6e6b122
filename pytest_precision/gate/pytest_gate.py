"""The gate the project's pytest applies, asked of pytest itself: `python -m pytest --precision-resolved-gate FILE
[-c FILE] [--rootdir DIR] [-o NAME=VALUE] PATHS` in the current folder, with the user's environment.

pytest finds and reads its config file for PATHS as in a test run (pytest 8's and 9's rules, -c, --rootdir,
addopts, PYTEST_ADDOPTS, -o), loads the plugins and initial conftest.py files a test run loads, and the plugin
writes the values its session resolved (plugin/resolved_gate.py), then stops before collecting. So `diff` needs
no second reader of config files to keep in step with pytest. Where pytest refuses the configuration, the
refusal is pytest's own message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError

if TYPE_CHECKING:
    from pytest_precision.gate.tolerance import Level

#: Seconds pytest may take to configure (a conftest.py importing torch and transformers takes a few).
TIMEOUT_S = 300
#: The option of the plugin that writes the resolved gate (plugin/options.py).
RESOLVED_GATE_FLAG = "--precision-resolved-gate"


@dataclass(frozen=True)
class PytestGate:
    """What the project's pytest gates: each setting as the plugin's session resolved it (None / (None, {}):
    not set, the built-in default), where each was set, and the config file pytest read."""

    metrics: list[str] | None = None
    rtol: Level = (None, {})
    atol: Level = (None, {})
    drift_rtol: Mapping[str, float] = field(default_factory=dict)
    #: {"precision_rtol": "pytest.ini addopts -o precision_rtol", ...}; "built-in" where unset.
    sources: Mapping[str, str] = field(default_factory=dict)
    #: The config file as shown to the user ("none found" when pytest found none).
    config: str = "none found"
    pytest_version: str = ""

    def source(self, name: str) -> str:
        return self.sources.get(name, "built-in")


def pytest_command(paths: Sequence[Path], pytest_args: Sequence[str], target: Path) -> list[str]:
    """The pytest command line that writes the gate for `paths` to `target`. The paths are absolute, so that
    none reads as an option; pytest finds the config file from them as for test paths."""
    absolute = [os.path.abspath(path) for path in paths]
    return [sys.executable, "-m", "pytest", f"{RESOLVED_GATE_FLAG}={target}", *pytest_args, *absolute]


def ask_pytest(paths: Sequence[Path], pytest_args: Sequence[str] = ()) -> PytestGate:
    """The gate pytest resolves for `paths` (and `pytest_args`: -c, --rootdir, -o) in the current folder. A
    ConfigurationError carrying pytest's own message where pytest refuses the configuration."""
    with tempfile.TemporaryDirectory(prefix="pytest-precision-gate-") as folder:
        target = Path(folder) / "gate.json"
        command = pytest_command(paths, pytest_args, target)
        shown = " ".join(["python -m pytest", *pytest_args])
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, errors="replace", timeout=TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise ConfigurationError(
                f"`{shown}` did not finish configuring in {TIMEOUT_S} s, so the project's gate is unknown; give "
                "--metric, --rtol and --atol to compare without asking pytest"
            ) from None
        if done.returncode != 0 or not target.is_file():
            raise ConfigurationError(_refusal(shown, done))
        data = json.loads(target.read_text(encoding="utf-8"))
    return _gate(data)


def _refusal(shown: str, done: subprocess.CompletedProcess[str]) -> str:
    """One line: pytest's own error, and what to do."""
    lines = [line.strip() for line in f"{done.stderr}\n{done.stdout}".splitlines() if line.strip()]
    errors = []
    for line in lines:
        if line.startswith("ERROR: usage:"):  # argparse's usage line; its message follows as "...: error: ..."
            continue
        if line.startswith("ERROR"):
            errors.append(line.removeprefix("ERROR:").strip())
        elif ": error: " in line:
            errors.append(line.partition(": error: ")[2])
    # A UsageError is "ERROR: ..." lines; a refusal while finding the config file (setup.cfg with [pytest]) a
    # traceback whose last line is the message.
    text = "; ".join(errors or lines[-1:]) or "no output"
    if RESOLVED_GATE_FLAG in text:  # unrecognized argument: the plugin is not loaded
        text = (
            f"pytest here does not load pytest-precision, so no precision gate applies ({text}); load it "
            "(pip install, or -p pytest_precision.plugin where PYTEST_DISABLE_PLUGIN_AUTOLOAD is set)"
        )
    if len(text) > 600:
        text = text[:600] + " ..."
    return (
        f"pytest refuses the project's configuration, so its gate is unknown (`{shown}` in {Path.cwd()}, exit "
        f"{done.returncode}): {text}"
    )


def _level(value: Any) -> Level:
    number, per_metric = value
    return (None if number is None else float(number)), {str(k): float(v) for k, v in dict(per_metric).items()}


def _gate(data: Mapping[str, Any]) -> PytestGate:
    metrics = data.get("metrics")
    return PytestGate(
        metrics=None if metrics is None else [str(metric) for metric in metrics],
        rtol=_level(data["rtol"]),
        atol=_level(data["atol"]),
        drift_rtol={str(k): float(v) for k, v in dict(data.get("drift_rtol") or {}).items()},
        sources={str(k): str(v) for k, v in dict(data.get("sources") or {}).items()},
        config=str(data.get("config") or "none found"),
        pytest_version=str(data.get("pytest", "")),
    )
