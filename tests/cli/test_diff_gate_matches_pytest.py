"""The gate `pytest-precision diff` applies is the one pytest applies: a table of configuration layouts, each
resolved by `diff` (which asks pytest in a subprocess) and by the plugin inside a real pytest run (pytester),
on the installed pytest. CI runs this file on pytest 8 (oldest constraints) and 9 (newest); where the two
read a layout differently, `expected` says so."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.cli.main import _pytest_args, build_parser
from pytest_precision.gate.diff_gate import gate_options
from pytest_precision.gate.tolerance import DEFAULT_METRICS, base_of_levels
from pytest_precision.gate.tolerance_rules import ToleranceRules

PYTEST_9 = int(pytest.__version__.split(".")[0]) >= 9
REFUSED = "refused"


@dataclass(frozen=True)
class Layout:
    """Config files written in the project folder, what `diff` and pytest are given, and the base rtol that
    pytest applies (None: the built-in one; REFUSED: pytest refuses the configuration)."""

    files: dict[str, str]
    expected: float | str | None
    #: diff's -c / --rootdir / -o, as the user types them; pytest gets the same.
    options: list[str] = field(default_factory=list)
    pytest_addopts: str = ""
    #: Where diff's gate line says rtol was set, when checked.
    source: str = ""


PYPROJECT_NATIVE = '[tool.pytest]\nprecision_rtol = "0.01"\nprecision_metrics = "rms_rel max_rel"\n'
LAYOUTS: dict[str, Layout] = {
    "pytest.ini": Layout({"pytest.ini": "[pytest]\nprecision_rtol = 0.02\n"}, 0.02),
    # The issue's case: on pytest 9 addopts' -o overrides the ini key (pytest 8.0 applies the key), for pytest
    # and so for diff.
    "addopts -o over the ini key": Layout(
        {"pytest.ini": "[pytest]\naddopts = -o precision_rtol=0.01\nprecision_rtol = 0.5\n"},
        0.01 if PYTEST_9 else 0.5,
        source="pytest.ini addopts -o precision_rtol" if PYTEST_9 else "pytest.ini precision_rtol",
    ),
    "addopts flag": Layout(
        {"pytest.ini": "[pytest]\naddopts = --precision-rtol=0.03\nprecision_rtol = 0.5\n"},
        0.03,
        source="pytest.ini addopts --precision-rtol",
    ),
    "tox.ini": Layout(
        {"tox.ini": "[tox]\nenvlist = py\n\n[pytest]\nprecision_rtol = 0.04\nprecision_atol = max_rel=2\n"}, 0.04
    ),
    "setup.cfg": Layout({"setup.cfg": "[metadata]\nname = x\n\n[tool:pytest]\nprecision_rtol = 0.05\n"}, 0.05),
    "setup.cfg [pytest] is refused": Layout({"setup.cfg": "[pytest]\nprecision_rtol = 0.05\n"}, REFUSED),
    "pyproject ini_options": Layout({"pyproject.toml": '[tool.pytest.ini_options]\nprecision_rtol = "0.06"\n'}, 0.06),
    # pytest 9 reads the native table; pytest 8 takes pyproject.toml as the config file with no settings.
    "pyproject native table": Layout({"pyproject.toml": PYPROJECT_NATIVE}, 0.01 if PYTEST_9 else None),
    # The case: pytest 9 skips an empty ini_options table for the native one; pytest 8 reads the empty one.
    "pyproject native table and an empty ini_options": Layout(
        {"pyproject.toml": PYPROJECT_NATIVE + "[tool.pytest.ini_options]\n"}, 0.01 if PYTEST_9 else None
    ),
    "pyproject both tables": Layout(
        {"pyproject.toml": PYPROJECT_NATIVE + '[tool.pytest.ini_options]\nprecision_rtol = "0.5"\n'},
        REFUSED if PYTEST_9 else 0.5,
    ),
    # pytest 9's own file; pytest 8 does not read it, nor the pyproject.toml without a pytest table beside it.
    "pytest.toml": Layout(
        {"pytest.toml": '[pytest]\nprecision_rtol = "0.07"\n', "pyproject.toml": "[project]\nname = 'x'\n"},
        0.07 if PYTEST_9 else None,
    ),
    "PYTEST_ADDOPTS over the ini": Layout(
        {"pytest.ini": "[pytest]\nprecision_rtol = 0.5\n"},
        0.08,
        pytest_addopts="--precision-rtol=0.08",
        source="PYTEST_ADDOPTS --precision-rtol",
    ),
    "PYTEST_ADDOPTS -o": Layout(
        {"pytest.ini": "[pytest]\nprecision_rtol = 0.5\n"}, 0.09, pytest_addopts="-o precision_rtol=0.09"
    ),
    "-c another file": Layout(
        {"pytest.ini": "[pytest]\nprecision_rtol = 0.5\n", "ci.ini": "[pytest]\nprecision_rtol = 0.11\n"},
        0.11,
        options=["-c", "ci.ini"],
        source="ci.ini precision_rtol",
    ),
    "-o over addopts -o": Layout(
        {"pytest.ini": "[pytest]\naddopts = -o precision_rtol=0.5\n"},
        0.12,
        options=["-o", "precision_rtol=0.12"],
        source="command line -o precision_rtol",
    ),
    "a bad value is refused": Layout({"pytest.ini": "[pytest]\nprecision_rtol = lots\n"}, REFUSED),
    "none": Layout({}, None),
}

#: The test a real pytest run executes: it writes what the plugin's session resolved.
GATE_TEST = """
import json
from pytest_precision.plugin.session import SESSION_KEY

def test_gate(pytestconfig):
    session = pytestconfig.stash[SESSION_KEY]
    with open({path!r}, "w") as out:
        json.dump({{"metrics": session.metrics, "rtol": list(session.rtol), "atol": list(session.atol)}}, out)
"""


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_diff_applies_the_gate_pytest_applies(
    name: str, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    layout = LAYOUTS[name]
    for file, content in layout.files.items():
        (pytester.path / file).write_text(content)
    for side in ("old", "new"):
        (pytester.path / side).mkdir()
    # Outside the project (no config file finds it) and in a folder of its own (other tests list basetemp's files).
    resolved = tmp_path_factory.mktemp("resolved-gate") / "resolved.json"
    pytester.makepyfile(test_gate=GATE_TEST.format(path=str(resolved)))
    if layout.pytest_addopts:
        monkeypatch.setenv("PYTEST_ADDOPTS", layout.pytest_addopts)
    arguments = build_parser().parse_args(["diff", "old", "new", *layout.options])
    asked = [Path("old"), Path("new")]
    try:
        run = pytester.runpytest_inprocess("test_gate.py", *_pytest_args(arguments))
    except pytest.fail.Exception as error:  # in-process, a refusal while finding the config file propagates
        assert layout.expected == REFUSED, error
        ret, said = 1, str(error)
    else:
        ret, said = run.ret, "\n".join(run.outlines + run.errlines)

    if layout.expected == REFUSED:
        assert ret != 0 and not resolved.exists()
        with pytest.raises(ConfigurationError) as refusal:
            gate_options(asked, None, None, None, 30, _pytest_args(arguments))
        # diff's error carries pytest's own message.
        message = str(refusal.value).split("): ", 1)[1].removeprefix("Failed: ")[:60]
        assert message in said, (message, said)
        return

    assert ret == 0, said
    session = json.loads(resolved.read_text())
    options = gate_options(asked, None, None, None, 30, _pytest_args(arguments))
    base, per_metric = base_of_levels(tuple(session["rtol"]), tuple(session["atol"]))  # type: ignore[arg-type]
    assert options.tolerances == ToleranceRules(base=base, base_metrics=per_metric)
    assert list(options.metrics) == (session["metrics"] or list(DEFAULT_METRICS))
    # And what pytest applies is what the layout means (so that diff and the plugin cannot agree on nothing).
    assert session["rtol"][0] == layout.expected
    assert (options.rtol_from == "built-in") == (layout.expected is None), options.rtol_from
    assert options.rtol_from == (layout.source or options.rtol_from)
