"""Ports by name: a variants file (or `Variant(implementation="name")`) selects one from a fixed set, the ports this
package ships and the entry points installed packages declare; a name never imports a module it spells."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pytest_precision import ConfigurationError, Variant, compare
from pytest_precision.cli.variants_file import load_variants_file
from pytest_precision.engine import port_registry
from pytest_precision.ports import Port


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


class Renamed(nn.Module):
    """Net with other module names: a port of it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def renamed_port() -> Port:
    return Port(
        model=lambda reference: Renamed(),
        modules={"a": "first", "b": "second"},
        parameters={
            "a.weight": "first.weight",
            "a.bias": "first.bias",
            "b.weight": "second.weight",
            "b.bias": "second.bias",
        },
        name="renamed",
    )


class Entry:
    """An installed package's entry point (importlib.metadata.EntryPoint's load and value)."""

    def __init__(self, value: str, load: Any) -> None:
        self.value = value
        self._load = load

    def load(self) -> Any:
        return self._load()


def failing() -> Any:
    raise ImportError("No module named 'ours'")


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This package's own entry point (torchtune_llama, from its installed metadata) and three a package declares."""
    entries = {
        **port_registry._installed(),
        "renamed": Entry("ours.ports:renamed_port", lambda: renamed_port),
        "broken": Entry("ours.missing:port", failing),
        "not_a_port": Entry("ours.ports:something", lambda: 42),
    }
    monkeypatch.setattr(port_registry, "_installed", lambda: entries)


def write(path: Path, entries: Any) -> Path:
    path.write_text(json.dumps(entries))
    return path


def test_a_variants_file_names_an_installed_port_and_it_runs(installed: None, tmp_path: Path) -> None:
    file = write(tmp_path / "variants.json", [{"name": "ours_fp32", "implementation": "renamed"}])
    (variant,) = load_variants_file(file)
    assert variant.port is not None and variant.port.label == "renamed"
    assert variant.to_dict()["implementation"] == "renamed"
    torch.manual_seed(0)
    report = compare(Net(), torch.randn(3, 4), variants=[variant], loss_fn=lambda out, _: out.pow(2).mean())
    assert {r.name for r in report.records("ours_fp32", "fw")} == {"first", "second"}
    assert {r.name for r in report.records("ours_fp32", "grad")} == {
        "first.weight",
        "first.bias",
        "second.weight",
        "second.bias",
    }
    assert all(r.rms_rel is not None and r.rms_rel < 1e-6 for r in report.records("ours_fp32"))


@pytest.mark.parametrize("name", ["os.system", "pytest_precision.ports:torchtune_llama", "../renamed", ""])
def test_a_name_outside_the_fixed_set_is_refused_before_anything_imports(
    installed: None, tmp_path: Path, name: str
) -> None:
    before = set(sys.modules)
    file = write(tmp_path / "variants.json", [{"name": "x", "implementation": name}])
    with pytest.raises(
        ConfigurationError,
        match=r"variants.json, variant 1 \('x'\): implementation must be "
        r".*known here: broken, not_a_port, renamed, torchtune_llama",
    ):
        load_variants_file(file)
    assert not {m for m in set(sys.modules) - before if m.startswith(("os", "ours", "torchtune"))}


@pytest.mark.parametrize("value", [1, True, None, ["renamed"], {"name": "renamed"}])
def test_an_implementation_that_is_not_a_name_is_refused(installed: None, tmp_path: Path, value: Any) -> None:
    file = write(tmp_path / "variants.json", [{"name": "x", "implementation": value}])
    with pytest.raises(ConfigurationError, match=r"implementation must be the name of a port"):
        load_variants_file(file)


def test_an_entry_point_that_fails_to_load_or_is_not_a_port_is_named(installed: None) -> None:
    with pytest.raises(
        ConfigurationError, match=r"implementation 'broken' \(ours.missing:port\) failed to load: ImportError"
    ):
        Variant("x", implementation="broken")
    with pytest.raises(ConfigurationError, match=r"implementation 'not_a_port' gave int, not a Port"):
        Variant("x", implementation="not_a_port")


def test_an_unknown_name_in_python_lists_the_known_ones(installed: None) -> None:
    with pytest.raises(
        ConfigurationError, match=r"'nope' is not a port .*known: broken, not_a_port, renamed, torchtune_llama"
    ):
        Variant("x", implementation="nope")
    assert port_registry.port_names() == ["broken", "not_a_port", "renamed", "torchtune_llama"]
