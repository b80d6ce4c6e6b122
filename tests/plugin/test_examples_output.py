"""The repository's own examples, run as the README's first command runs them (plus -s, which shows the
trainer-vs-sampler example's printed tables): they pass with nothing to fix (no improved baseline, no
environment drift, no stale file, no warning), and the README's and docs' tables marked as their output are
what they print, digit for digit.

On a torch other than the one the baselines were recorded on (CI's oldest and newest runs), the numbers move:
the examples still pass, through the environment-drift rule in pyproject.toml, and the only lines to fix are
the drift notes naming the torch version and the improvements it brings; the docs' tables are not compared."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_precision.reports.environment import DRIFT_FIELDS

ROOT = Path(__file__).resolve().parents[2]
COMMAND = ["pytest", "examples", "--precision-tables", "-s", "-p", "no:cacheprovider"]
#: The comment that marks a README block as the examples' output.
MARK = "<!-- printed by `pytest examples --precision-tables -s`"
#: Summary lines that ask the user to do something about the project's own examples.
TO_FIX = re.compile(
    r"^(precision (improved|environment differs|stale|error)|.*\bwarnings? summary\b|.*\d+ warnings?\b)"
)


def recorded_torch() -> str:
    """The torch the committed example baselines were recorded on (one for all of them)."""
    versions = {
        json.loads(path.read_text(encoding="utf-8"))["environment"]["torch"]
        for path in (ROOT / "baselines" / "examples").rglob("*.json")
    }
    assert len(versions) == 1, f"the example baselines were recorded on several torch versions: {versions}"
    return versions.pop()


#: Whether this torch is the one the example baselines hold numbers of.
SAME_TORCH = recorded_torch() == torch.__version__
DRIFT_LINE = re.compile(
    r"^precision environment differs from \S+ \(numbers may move\): torch: '[^']+' in the baseline, '[^']+' now; "
    r"tolerances widened by rtol \+2 \(precision_drift_rtol\) for torch: '[^']+' in the baseline, '[^']+' now$"
)


def marked_blocks(readme: str) -> list[list[str]]:
    """The lines of every ```text block right after a MARK comment (blank lines and "..." cuts left out)."""
    blocks = []
    for match in re.finditer(re.escape(MARK) + r"[^\n]*\n```text\n(.*?)```", readme, flags=re.S):
        blocks.append([line for line in match[1].splitlines() if line.strip() and line.strip() != "..."])
    return blocks


@pytest.fixture(scope="module")
def examples_output() -> subprocess.CompletedProcess[str]:
    """stdout of the examples' run in a child pytest (outside any xdist worker), with the CPU paths the
    repository's conftest.py pins (inherited from this process)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS"))}
    environment.pop("PYTEST_CURRENT_TEST", None)
    return subprocess.run(
        [sys.executable, "-m", *COMMAND],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_the_examples_pass_with_nothing_to_fix(examples_output: subprocess.CompletedProcess[str]) -> None:
    lines = examples_output.stdout.splitlines()
    assert examples_output.returncode == 0, examples_output.stdout[-5000:] + examples_output.stderr[-3000:]
    to_fix = [line for line in lines if TO_FIX.match(line)]
    if not SAME_TORCH:  # on another torch: drift notes naming torch alone, and the improvements it brings
        to_fix = [line for line in to_fix if not DRIFT_LINE.match(line) and not line.startswith("precision improved")]
    assert to_fix == []
    assert re.search(r"^precision baselines \(compare, baselines\): \d+ passed$", examples_output.stdout, re.M)


@pytest.mark.skipif(not SAME_TORCH, reason=f"the docs' tables were printed on torch {recorded_torch()}")
def test_the_docs_tables_are_what_the_examples_print(examples_output: subprocess.CompletedProcess[str]) -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = [block for page in pages for block in marked_blocks(page.read_text(encoding="utf-8"))]
    assert len(blocks) >= 4, "the docs' example tables lost their marks"
    printed = {line.rstrip() for line in examples_output.stdout.splitlines()}
    missing = [line for block in blocks for line in block if line.rstrip() not in printed]
    assert missing == [], "doc lines the examples do not print (rerun them and copy their output):\n" + "\n".join(
        missing
    )


def test_marked_blocks_are_found_and_cut_lines_skipped() -> None:
    readme = f"text\n{MARK}: x -->\n```text\n  a  1\n\n...\n  b  2\n```\n```text\n  c\n```\n"
    assert marked_blocks(readme) == [["  a  1", "  b  2"]]


@pytest.mark.parametrize("path", sorted((ROOT / "baselines").rglob("*.json")), ids=lambda p: p.name)
def test_every_committed_baseline_records_where_its_numbers_hold(path: Path) -> None:
    """Without cpu_capability (or another drift field) in its environment, a baseline cannot warn when it is
    compared on another ISA: refresh it (pytest --update-baselines rewrites a file that lacks one)."""
    environment = json.loads(path.read_text(encoding="utf-8"))["environment"]
    assert [name for name in DRIFT_FIELDS if name not in environment] == []
    assert environment["cpu_capability"] == "AVX2"  # the path conftest.py pins
