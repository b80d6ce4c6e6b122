"""Packaging metadata: the license, the project URLs, the Python classifiers, the oldest- and newest-versions
environments."""

from __future__ import annotations

import configparser
import re
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
#: The extras whose requirements the `oldest` environment pins with the core dependencies (not dev's tools).
PINNED_EXTRAS = ("hf", "plot", "lowbit", "test")


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        data: dict[str, Any] = tomllib.load(file)
    return data["project"]


def declared_minimums(project: dict[str, Any]) -> dict[str, Version]:
    """Each requirement's `>=` bound from the dependencies and the pinned extras, by canonical name."""
    requirements = list(project["dependencies"])
    for extra in PINNED_EXTRAS:
        requirements += project["optional-dependencies"][extra]
    minimums: dict[str, Version] = {}
    for line in requirements:
        requirement = Requirement(line)
        bounds = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
        assert len(bounds) == 1, f"{line!r}: one '>=' minimum expected"
        name = canonicalize_name(requirement.name)
        # the same package in two extras declares one minimum
        assert minimums.setdefault(name, bounds[0]) == bounds[0], f"{name}: two different minimums"
    return minimums


def tox_environment(name: str) -> configparser.SectionProxy:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    return tox[f"testenv:{name}"]


def constraints_file(name: str) -> str:
    """The constraints file (relative to the root) that tox's environment `name` installs with."""
    match = re.search(r"PIP_CONSTRAINT\s*=\s*\{toxinidir\}/(\S+)", tox_environment(name)["setenv"])
    assert match, f"the {name} environment installs through a constraints file (PIP_CONSTRAINT)"
    return match.group(1)


def pins(name: str) -> dict[str, Version]:
    """The `name==version` lines of the constraints file that tox's environment `name` installs with."""
    pins: dict[str, Version] = {}
    for raw in (ROOT / constraints_file(name)).read_text().splitlines():
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{line!r}: an exact pin expected"
        pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def test_license_is_an_spdx_expression_with_its_file(project: dict[str, Any]) -> None:
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    # PEP 639: an SPDX expression rules out a "License ::" classifier
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_build_backend_understands_pep_639() -> None:
    with (ROOT / "pyproject.toml").open("rb") as file:
        requires = tomllib.load(file)["build-system"]["requires"]
    (setuptools,) = [Requirement(r) for r in requires if Requirement(r).name == "setuptools"]
    assert not setuptools.specifier.contains("76.9"), "setuptools >= 77 writes License-Expression"


def test_project_urls(project: dict[str, Any]) -> None:
    urls = project["urls"]
    for key in ("Homepage", "Documentation", "Changelog", "Issues"):
        assert urls[key].startswith("https://"), key


def test_python_classifiers_within_requires_python(project: dict[str, Any]) -> None:
    supported = SpecifierSet(project["requires-python"])
    versions = [
        c.rpartition(" :: ")[2]
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert versions, "one classifier per supported Python version"
    for version in versions:
        assert supported.contains(version), f"Python {version} is below requires-python {supported}"


def test_oldest_environment_pins_exactly_the_declared_minimums(project: dict[str, Any]) -> None:
    environment = tox_environment("oldest")
    assert "test" in environment["extras"].split()
    assert pins("oldest") == declared_minimums(project)


def test_newest_environment_pins_versions_the_declared_range_admits(project: dict[str, Any]) -> None:
    """Each newest pin is inside its declared range, newer than or equal to its minimum, for the same packages;
    no requirement has an upper bound, so installing the plugin never downgrades or upgrades a newer torch."""
    minimums = declared_minimums(project)
    newest = pins("newest")
    assert set(newest) == set(minimums)
    for name, version in newest.items():
        assert version >= minimums[name], name
    assert newest["torch"] > minimums["torch"]
    for line in [*project["dependencies"], *(r for e in PINNED_EXTRAS for r in project["optional-dependencies"][e])]:
        assert not [s for s in Requirement(line).specifier if s.operator in ("<", "<=", "==", "~=")], line


def test_ci_runs_the_suite_on_both_ends_of_the_range() -> None:
    """.ci/run runs the suite on each environment's constraints file through .ci/suite-on."""
    script = (ROOT / ".ci" / "run").read_text()
    for name in ("oldest", "newest"):
        assert f".ci/suite-on {name} {constraints_file(name)}" in script
    assert "PIP_CONSTRAINT" in (ROOT / ".ci" / "suite-on").read_text()


def test_changelog_has_an_unreleased_section() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## \[Unreleased\]$", text, re.MULTILINE)
    assert re.search(r"^## \[\d+\.\d+\.\d+\]", text, re.MULTILINE)
