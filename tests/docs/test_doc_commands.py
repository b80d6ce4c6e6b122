"""The README's blocks that cannot run in a test (they install torch into a new venv) are held to what CI
runs: .ci/run installs and tests exactly as the README's "Two commands" say. And the doc-block runner's own
rules (docs/doc_blocks.py), on small inputs."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def doc_blocks() -> ModuleType:
    if "doc_blocks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("doc_blocks", ROOT / "docs" / "doc_blocks.py")
        assert spec is not None and spec.loader is not None
        sys.modules["doc_blocks"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["doc_blocks"])
    return sys.modules["doc_blocks"]


def two_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Two commands\n.*?```bash\n(.*?)```", readme, re.S)
    assert block is not None, "README.md lost its Two commands block"
    return [line for line in block[1].splitlines() if line.strip() and not line.startswith("#")]


def ci_commands() -> list[str]:
    """The commands of .ci/run, less pip's flags."""
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    return [re.sub(r" --quiet| --upgrade pip", "", line).strip() for line in lines if line.strip()]


def test_the_readme_test_command_is_what_ci_runs() -> None:
    steps = two_commands()[1].split(" && ")
    ci = ci_commands()
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"]
    assert [step for step in steps if step.startswith("pip install")] == [
        line for line in ci if line.startswith("pip install")
    ]
    assert steps[-1] == "pytest -n 2"
    assert any(line.startswith("pytest -n 2 ") or line == "pytest -n 2" for line in ci)


def test_the_readme_main_command_installs_torch_as_ci_does() -> None:
    steps = two_commands()[0].split(" && ")
    assert steps[2] == next(line for line in ci_commands() if line.startswith("pip install torch"))
    assert steps[-1] == "pytest examples --precision-tables"


def test_the_install_section_pins_the_torch_ci_installs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Install\n.*?```bash\n(.*?)```", readme, re.S)
    assert block is not None
    torch_line = block[1].splitlines()[0].split("#")[0].strip()
    assert torch_line == next(line for line in ci_commands() if line.startswith("pip install torch"))


def test_console_output_matches_line_by_line_with_dots_for_any_lines() -> None:
    match = doc_blocks().lines_match
    assert match(["a", "...", "d"], ["a", "b", "c", "d"])
    assert match(["a", "...", "d"], ["a", "d"])
    assert not match(["a", "...", "d"], ["a", "b"])
    assert not match(["a", "b"], ["a", "b", "c"])
    assert match(["..."], [])


def test_bash_blocks_are_split_into_commands_and_expected_failures() -> None:
    blocks = doc_blocks()
    commands = blocks.bash_commands("# a comment\npytest x.py \\\n    -q   # fails: no baseline\n\necho hi\n")
    assert commands == ["pytest x.py      -q   # fails: no baseline", "echo hi"]
    assert [blocks.expects_failure(command) for command in commands] == [True, False]


def test_a_file_block_names_its_file_on_its_first_line() -> None:
    pattern = doc_blocks().FILE_LINE
    assert pattern.match("# test_precision.py")["path"] == "test_precision.py"
    assert pattern.match("# .ci/pytest.ini") is None or pattern.match("# .ci/pytest.ini")["path"] == ".ci/pytest.ini"
    assert pattern.match("# the model, built once") is None
