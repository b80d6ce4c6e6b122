"""The project's pytest configuration file, found and read as pytest finds and reads it, without importing pytest:
`pytest-precision diff` gates by default what the project's gate checks (its precision_* settings).

Lookup (pytest's `determine_setup` without -c or --rootdir): from the common folder of the paths given upward, the
first folder holding one of CONFIG_NAMES that has a pytest section; when none does (and no setup.py is on the
way), each path's own folder upward; a pyproject.toml without a pytest table is the config file when nothing else
is found. pytest.toml / .pytest.toml and pyproject's native [tool.pytest] table are read where pytest >= 9 reads
them. A setting in `addopts` (`--precision-metrics=...`) wins over the ini key, as the command line does.
"""

from __future__ import annotations

import importlib
import os
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_precision.base.errors import ConfigurationError

#: The ini keys of the precision gate and the flags that set them on the command line (and in addopts).
GATE_SETTINGS: dict[str, str] = {
    "precision_metrics": "--precision-metrics",
    "precision_rtol": "--precision-rtol",
    "precision_atol": "--precision-atol",
}

#: The pytest config file names in pytest's order of precedence within one folder; the first two since pytest 9.
CONFIG_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")

Settings = dict[str, Any]


@dataclass(frozen=True)
class IniFile:
    """A pytest config file (None: none found) and its pytest settings."""

    path: Path | None
    settings: Mapping[str, Any] = field(default_factory=dict)

    def shown(self) -> str:
        """The file as the user knows it: relative to the current folder when inside it."""
        if self.path is None:
            return "none found"
        try:
            return self.path.relative_to(Path.cwd()).as_posix()
        except ValueError:
            return str(self.path)

    def gate_setting(self, name: str) -> tuple[str, str] | None:
        """(text, where it was set) of gate setting `name` (a GATE_SETTINGS key); None when unset. `addopts`
        wins over the ini key, as pytest's command line does. An empty value is a ConfigurationError, as the
        plugin's: read as unset, it would drop the setting for the built-in default."""
        flag = GATE_SETTINGS[name]
        found = _from_addopts(self.settings.get("addopts"), flag)
        where = f"{self.shown()} addopts {flag}"
        if found is None and name in self.settings:
            found, where = _text(self.settings[name]), f"{self.shown()} {name}"
        if found is None:
            return None
        if not found.strip():
            raise ConfigurationError(f"{where} is empty: give it a value, or remove it for the built-in default")
        return found, where


def _text(value: object) -> str:
    """A setting's value as option text: a TOML list of names or numbers joined by spaces."""
    if isinstance(value, (list, tuple)):
        return " ".join(str(item) for item in value)
    return str(value)


def _from_addopts(addopts: object, flag: str) -> str | None:
    """The value `addopts` gives `flag` (--flag=VALUE or --flag VALUE; the last one, as argparse keeps it)."""
    if isinstance(addopts, str):
        arguments = shlex.split(addopts)
    elif isinstance(addopts, (list, tuple)):  # a TOML list
        arguments = [str(argument) for argument in addopts]
    else:
        return None
    found = None
    for index, argument in enumerate(arguments):
        if argument == flag and index + 1 < len(arguments):
            found = arguments[index + 1]
        elif argument.startswith(f"{flag}="):
            found = argument.removeprefix(f"{flag}=")
    return found


def _pytest_major() -> int:
    """The installed pytest's major version (9 when it cannot be told: read the newest names)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("pytest").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 9


def _toml(path: Path) -> dict[str, Any]:
    module: Any = None
    for name in ("tomllib", "tomli"):  # tomli: Python 3.10, where pytest itself depends on it
        try:
            module = importlib.import_module(name)
            break
        except ImportError:
            continue
    if module is None:
        raise ConfigurationError(f"{path}: reading TOML needs Python 3.11 or the tomli package (pip install tomli)")
    try:
        document: dict[str, Any] = module.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, module.TOMLDecodeError) as error:
        raise ConfigurationError(f"{path}: not a readable TOML file ({error})") from None
    return document


def _ini_section(path: Path, section: str) -> Settings | None:
    import iniconfig

    try:
        parsed = iniconfig.IniConfig(str(path))
    except (OSError, UnicodeDecodeError, iniconfig.ParseError) as error:
        raise ConfigurationError(f"{path}: not a readable ini file ({error})") from None
    return dict(parsed[section].items()) if section in parsed else None


def _pytest_toml(path: Path) -> Settings | None:
    table = _toml(path).get("pytest")
    return dict(table) if isinstance(table, Mapping) else {}


def _pytest_ini(path: Path) -> Settings | None:
    return _ini_section(path, "pytest") or {}


def _pyproject(path: Path) -> Settings | None:
    tool = _toml(path).get("tool")
    table = tool.get("pytest") if isinstance(tool, Mapping) else None
    if not isinstance(table, Mapping):
        return None
    ini_options = table.get("ini_options")
    if isinstance(ini_options, Mapping):
        return {key: value if isinstance(value, list) else str(value) for key, value in ini_options.items()}
    native = {key: value for key, value in table.items() if key != "ini_options"}
    return native if native and _pytest_major() >= 9 else None


def _tox(path: Path) -> Settings | None:
    return _ini_section(path, "pytest")


def _setup_cfg(path: Path) -> Settings | None:
    return _ini_section(path, "tool:pytest")


LOADERS: dict[str, Callable[[Path], Settings | None]] = {
    "pytest.toml": _pytest_toml,
    ".pytest.toml": _pytest_toml,
    "pytest.ini": _pytest_ini,
    ".pytest.ini": _pytest_ini,
    "pyproject.toml": _pyproject,
    "tox.ini": _tox,
    "setup.cfg": _setup_cfg,
}


def _locate(folders: Iterable[Path]) -> IniFile:
    """The first config file holding pytest settings from each folder upward; else the first pyproject.toml seen
    (pytest's config file even without a pytest table); else none."""
    names = [name for name in CONFIG_NAMES if _pytest_major() >= 9 or not name.endswith("pytest.toml")]
    pyproject: Path | None = None
    for folder in folders:
        for base in (folder, *folder.parents):
            for name in names:
                candidate = base / name
                if not candidate.is_file():
                    continue
                if name == "pyproject.toml" and pyproject is None:
                    pyproject = candidate
                settings = LOADERS[name](candidate)
                if settings is not None:
                    return IniFile(candidate, settings)
    return IniFile(pyproject)


def _common_folder(folders: Sequence[Path], cwd: Path) -> Path:
    if not folders:
        return cwd
    try:
        return Path(os.path.commonpath([str(f) for f in folders]))
    except ValueError:  # paths on different drives
        return folders[0]


def find_ini_file(paths: Sequence[Path], cwd: Path | None = None) -> IniFile:
    """The config file pytest would read when given `paths` in `cwd` (default: the current folder)."""
    cwd = Path.cwd() if cwd is None else cwd
    absolute = [Path(os.path.abspath(cwd / path)) for path in paths]
    folders = [path if path.is_dir() else path.parent for path in absolute if path.exists()]
    ancestor = _common_folder(folders, cwd)
    found = _locate([ancestor])
    # pytest looks from each path's own folder only when the common one found nothing and no setup.py above
    # it marks a project root (paths in two projects: their common folder may be /).
    setup_py = any((base / "setup.py").is_file() for base in (ancestor, *ancestor.parents))
    if found.path is None and not setup_py and folders != [ancestor]:
        found = _locate(folders)
    return found
