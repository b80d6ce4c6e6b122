"""Every code block of README.md and docs/*.md runs as a test: one test per page, its blocks in order.

Collected by the root conftest.py (README.md and the docs pages). A page is one test,
not one test per block, because its blocks share state (a model defined in one block is measured in the
next; a shell block runs the test file an earlier block wrote) and pytest-xdist's `load` scheduling would
otherwise send a page's blocks to different workers.

What each block does, in the page's own temporary folder (the working directory while the page runs):

- ```python: runs in the page's namespace (Sybil's Python parser); a block opening with `>>>` is a doctest,
  its printed output compared.
- ```python, ```ini or ```toml whose first line is a comment naming a file (`# test_precision.py`): written
  to that file, not run; a later shell block runs it.
- ```bash: one command per line (a trailing `\\` continues it), run by bash; each must exit 0, except a
  command whose comment starts with `# fails`, which must exit non-zero.
- ```console: `$ command` lines, run in order in one bash process; the lines after each command are its
  output (stdout and stderr), compared line by line; a line `...` stands for any number of lines.
- `<!-- skip: next "why" -->` before a block skips it with that reason, visible in the markdown source.

Commands run with this interpreter's scripts first on PATH (`pytest`, `pytest-precision`), `pytest` as
`pytest -p no:cacheprovider` (PYTEST_ADDOPTS) and outside any xdist worker's environment.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import SkipTest

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

#: A first line that names the file a block is written to, e.g. `# test_precision.py` or `# .ci/pytest.ini`.
FILE_LINE = re.compile(r"^[#;] ?(?P<path>[\w.-]+(?:/[\w.-]+)*\.(?:py|ini|toml|cfg|json|txt))\s*$")
#: Seconds one shell block may take: a page is meant to run in seconds, not minutes.
SHELL_TIMEOUT = 300


def write_file(example: Example) -> None:
    """Write the block (less its file-name line) to the file its first line names, in the page's folder."""
    first, _, rest = str(example.parsed).partition("\n")
    match = FILE_LINE.match(first)
    assert match is not None
    path = Path(match["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rest, encoding="utf-8")


class FileBlockParser:
    """```python / ```ini / ```toml blocks whose first line names a file: written there, not run."""

    def __init__(self, *languages: str) -> None:
        self.parsers = [CodeBlockParser(language, write_file) for language in languages]

    def __call__(self, document: Document) -> Iterable[Region]:
        for parser in self.parsers:
            for region in parser(document):
                if FILE_LINE.match(str(region.parsed).partition("\n")[0]):
                    yield region


class PythonBlockParser:
    """```python blocks run in the page's namespace, except those FileBlockParser writes to a file."""

    def __init__(self) -> None:
        self.parser = PythonCodeBlockParser()

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.parser(document):
            if not (isinstance(region.parsed, str) and FILE_LINE.match(region.parsed.partition("\n")[0])):
                yield region


def shell_environment() -> dict[str, str]:
    """This process's environment (the CPU pins of conftest.py included), without pytest's and xdist's
    per-process variables; this interpreter's scripts first on PATH; git able to commit."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS"))
    }
    environment.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), environment.get("PATH", "")]),
        PYTEST_ADDOPTS="-p no:cacheprovider",
        COLUMNS="120",
        GIT_AUTHOR_NAME="docs",
        GIT_AUTHOR_EMAIL="docs@example.com",
        GIT_COMMITTER_NAME="docs",
        GIT_COMMITTER_EMAIL="docs@example.com",
        GIT_CONFIG_GLOBAL=os.devnull,
        PYTHONDONTWRITEBYTECODE="1",
    )
    return environment


def bash_commands(source: str) -> list[str]:
    """The block's commands: one per line, `\\` continuing a line; blank and comment lines left out."""
    commands, current = [], ""
    for line in source.splitlines():
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def expects_failure(command: str) -> bool:
    """`pytest x.py  # fails: ...`: the command must exit non-zero."""
    return bool(re.search(r"\s#\s*fails\b", command))


def run_bash(example: Example) -> str | None:
    """Each command of a ```bash block must exit 0 (non-zero where its comment says `# fails`)."""
    for command in bash_commands(str(example.parsed)):
        done = subprocess.run(
            ["bash", "-c", command],
            env=shell_environment(),
            capture_output=True,
            text=True,
            timeout=SHELL_TIMEOUT,
            check=False,
        )
        if (done.returncode != 0) != expects_failure(command):
            expected = "a non-zero exit status" if expects_failure(command) else "exit status 0"
            return (
                f"$ {command}\nexited {done.returncode}, expected {expected}\n"
                f"--- stdout (end) ---\n{done.stdout[-4000:]}\n--- stderr (end) ---\n{done.stderr[-4000:]}"
            )
    return None


def console_steps(source: str) -> list[tuple[str, list[str]]]:
    """`$ command` lines and the output lines after each."""
    steps: list[tuple[str, list[str]]] = []
    for line in source.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line.rstrip())
        elif line.strip():
            raise ValueError(f"a ```console block starts with a command ($ ...), not {line!r}")
    return steps


def lines_match(expected: list[str], actual: list[str]) -> bool:
    """Line by line; an expected line `...` matches any number of lines (none included)."""
    if not expected:
        return not actual
    if expected[0].strip() == "...":
        return any(lines_match(expected[1:], actual[start:]) for start in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and lines_match(expected[1:], actual[1:])


def trimmed(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def run_console(example: Example) -> str | None:
    """Run a ```console block's commands in one bash process and compare each one's output."""
    steps = console_steps(str(example.parsed))
    marker = "@@ doc-blocks step end @@"
    script = ["exec 2>&1"]
    for command, _ in steps:
        # The status is kept across the marker, so that `echo $?` reports the command before it.
        script.append(f"{command}\n__status=$?; printf '\\n%s\\n' {shlex.quote(marker)}; (exit $__status)")
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        env=shell_environment(),
        capture_output=True,
        text=True,
        timeout=SHELL_TIMEOUT,
        check=False,
    )
    outputs = done.stdout.split(f"\n{marker}\n")
    for (command, expected), output in zip(steps, outputs, strict=False):
        actual = trimmed([line.rstrip() for line in output.splitlines()])
        if not lines_match(trimmed(expected), actual):
            return "$ {}\n--- expected ---\n{}\n--- printed ---\n{}".format(
                command, "\n".join(trimmed(expected)), "\n".join(actual)
            )
    return None


#: How every page is read. `skip: next "why"` needs a reason: Sybil's SkipParser evaluates it as Python.
SYBIL = Sybil(
    parsers=[
        SkipParser(),
        FileBlockParser("python", "ini", "toml"),
        PythonBlockParser(),
        CodeBlockParser("bash", run_bash),
        CodeBlockParser("console", run_console),
    ],
    patterns=["*.md"],
)


@contextmanager
def page_folder() -> Iterator[Path]:
    """A temporary folder, the working directory while the page runs; the previous one restored after."""
    previous = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="doc-page-") as folder:
        os.chdir(folder)
        try:
            yield Path(folder)
        finally:
            os.chdir(previous)


class BlockFailure(Exception):
    """A block that failed: the page, the line, and what went wrong."""


class PageItem(pytest.Item):
    """Every block of one page, in order."""

    def __init__(self, *, document: Document, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.document = document
        self.skipped: list[tuple[int, str]] = []

    def runtest(self) -> None:
        examples = list(self.document.examples())
        with page_folder():
            for example in examples:
                try:
                    example.evaluate()
                except SkipTest as skip:
                    self.skipped.append((example.line, str(skip)))
                except Exception as error:
                    raise BlockFailure(f"{self.path.name}, line {example.line}: {error}") from error
        self.user_properties.append(("blocks", len(examples)))
        self.user_properties.append(("skipped", len(self.skipped)))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: object = None) -> str:
        if isinstance(excinfo.value, BlockFailure):
            cause = excinfo.value.__cause__
            detail = "" if cause is None else "".join(_short_traceback(cause))
            return f"{excinfo.value}\n{detail}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.path.name}: code blocks"


def _short_traceback(error: BaseException) -> list[str]:
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.endswith(".md")]
    lines = traceback.format_list(frames) + traceback.format_exception_only(type(error), error)
    return lines


class PageFile(pytest.File):
    """A markdown page: one test, `code blocks`, that runs all of its blocks."""

    def collect(self) -> Iterator[PageItem]:
        yield PageItem.from_parent(self, name="blocks", document=SYBIL.parse(self.path))


def collect_page(file_path: Path, parent: pytest.Collector) -> PageFile | None:
    """The pytest_collect_file hook's work, for a markdown page."""
    if file_path.suffix == ".md":
        return PageFile.from_parent(parent, path=file_path)
    return None
