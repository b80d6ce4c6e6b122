"""Every file the plugin writes goes through atomic_files.write_atomically: the umask's ordinary mode (never
mkstemp's 0600), no temporary file left behind, and no module that writes a file its own way."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pytest_precision
from conftest import TINY_LLAMA_DIR
from pytest_precision.base.atomic_files import TEMPORARY_SUFFIX
from pytest_precision.cli.main import main
from pytest_precision.outputs.plots import matplotlib_available

PACKAGE = Path(pytest_precision.__file__).parent
#: Writes that need no atomic replace, by (module, function, call): a new writer elsewhere fails the test below.
ALLOWED_WRITES = {
    ("plugin/launcher.py", "launch", "open"): "a rank's log, in the launcher's own temporary folder, is its stdout",
    (
        "outputs/summary.py",
        "write_summary",
        "open",
    ): "$GITHUB_STEP_SUMMARY is appended to: it holds the job's other steps",
    ("cli/main.py", "main", "os.open"): "os.devnull, for the interpreter's last flush after a broken pipe",
    ("gate/baseline_diff.py", "ref_side", "write_bytes"): "scratch copies of committed baselines in a temporary folder",
    ("gate/baseline_diff.py", "diff_against", "write_bytes"): "a scratch copy of a committed baseline, ditto",
}
#: Calls that write a file whatever they are given.
WRITERS = {
    "os.replace",
    "os.rename",
    "os.open",
    "os.fdopen",
    "os.link",
    "tempfile.mkstemp",
    "tempfile.NamedTemporaryFile",
    "shutil.copy",
    "shutil.copy2",
    "shutil.copyfile",
    "shutil.move",
    "np.save",
    "numpy.save",
    "np.savez",
    "np.savetxt",
    "torch.save",
    "json.dump",
    "save_file",
    "write_text",
    "write_bytes",
    "savefig",
    "touch",
    "rename",
}


def _name(node: ast.expr) -> str:
    """'os.replace' for os.replace(...), 'write_text' for path.write_text(...), 'open' for open(...)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        modules = ("os", "np", "numpy", "torch", "json", "shutil", "tempfile")
        if isinstance(node.value, ast.Name) and node.value.id in modules:
            return f"{node.value.id}.{node.attr}"
        return node.attr
    return ""


def _writes(call: ast.Call) -> str | None:
    """The name of the writing call `call` is, or None when it writes nothing."""
    name = _name(call.func)
    if name in WRITERS:
        return name
    if name == "open":  # open(path, mode) or path.open(mode): only a mode that writes
        arguments = call.args[1:] if isinstance(call.func, ast.Name) else call.args[:1]
        modes = [*arguments, *(k.value for k in call.keywords if k.arg == "mode")]
        for mode in modes[:1]:
            if not isinstance(mode, ast.Constant) or any(c in str(mode.value) for c in "wax+"):
                return name
    return None


def _given_to_helper(tree: ast.AST) -> tuple[set[int], set[str]]:
    """Nodes inside the arguments of a write_atomically call (its content lambdas), and the names passed to it
    (local functions writing the file at the temporary path they are given)."""
    inside: set[int] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "write_atomically":
            for argument in [*node.args, *(k.value for k in node.keywords)]:
                inside.update(id(n) for n in ast.walk(argument))
                if isinstance(argument, ast.Name):
                    names.add(argument.id)
    return inside, names


def bypassing_writes(source: str) -> Iterator[tuple[str, str, int]]:
    """(function, call, line) of each call in `source` that writes a file other than through write_atomically."""
    tree = ast.parse(source)
    inside, helper_names = _given_to_helper(tree)

    def visit(node: ast.AST, function: str, passed: bool) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                # A local function given to write_atomically writes its temporary file: allowed inside.
                yield from visit(child, function or child.name, passed or child.name in helper_names)
                continue
            if isinstance(child, ast.Call) and not passed and id(child) not in inside:
                name = _writes(child)
                if name is not None:
                    yield function, name, child.lineno
            yield from visit(child, function, passed)

    yield from visit(tree, "", False)


def test_no_module_writes_a_file_but_through_write_atomically() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "base/atomic_files.py":
            continue
        for function, call, line in bypassing_writes(path.read_text(encoding="utf-8")):
            found[(name, function, call)] = line
    bypassing = {key: line for key, line in found.items() if key not in ALLOWED_WRITES}
    assert not bypassing, (
        "these write a file without atomic_files.write_atomically (its mode, fsync and temporary name): "
        f"{bypassing}; write through it, or add the call to ALLOWED_WRITES with the reason"
    )
    stale = sorted(set(ALLOWED_WRITES) - set(found))
    assert not stale, f"ALLOWED_WRITES names writes no module makes any more: {stale}; remove them"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os\ndef f(p):\n    os.replace(p, q)\n", [("f", "os.replace", 3)]),
        ("def f(p):\n    with open(p, 'wb') as h:\n        h.write(b'')\n", [("f", "open", 2)]),
        ("def f(p):\n    with p.open(mode='a') as h:\n        pass\n", [("f", "open", 2)]),
        ("def f(p, m):\n    open(p, m)\n", [("f", "open", 2)]),
        ("def f(p):\n    p.write_text('x')\n    open(p).read()\n    p.open('rb')\n", [("f", "write_text", 2)]),
        ("def f(figure, p):\n    figure.savefig(p)\n", [("f", "savefig", 2)]),
        ("import numpy as np\ndef f(h, a):\n    np.save(h, a)\n", [("f", "np.save", 3)]),
        ("def f(p, t):\n    write_atomically(p, lambda q: save_file(t, q))\n", []),
        (
            "def f(p, a):\n    def save(q):\n        with open(q, 'wb') as h:\n            np.save(h, a)\n"
            "    write_atomically(p, save)\n",
            [],
        ),
        (
            "def f(p, a):\n    def save(q):\n        np.save(q, a)\n    write_atomically(p, b'')\n",
            [("f", "np.save", 3)],
        ),
    ],
)
def test_the_write_finder_sees_writers_and_lets_the_helpers_content_be(
    source: str, expected: list[tuple[str, str, int]]
) -> None:
    assert list(bypassing_writes(source)) == expected


@pytest.fixture
def umask() -> Iterator[int]:
    """Umask 002 (group-writable files, as on shared machines) meanwhile: a writer that ignores the umask, or
    keeps mkstemp's 0600, or hard-codes 0644, shows."""
    old = os.umask(0o002)
    try:
        yield 0o002
    finally:
        os.umask(old)


def assert_ordinary(folder: Path, umask: int) -> list[str]:
    """Every file under `folder` has the mode `open(path, "w")` gives, every folder mkdir's; no temporary file
    is left. Returns the files' relative paths."""
    files = []
    for path in sorted(folder.rglob("*")):
        mode = stat.S_IMODE(path.lstat().st_mode)
        relative = path.relative_to(folder).as_posix()
        assert not path.name.endswith(TEMPORARY_SUFFIX) and ".tmp" not in path.name, relative
        if path.is_dir():
            assert mode == 0o777 & ~umask, (relative, oct(mode))
        else:
            assert mode == 0o666 & ~umask, (relative, oct(mode))
            files.append(relative)
    return files


def test_every_file_of_a_run_has_the_umasks_mode(tmp_path: Path, umask: int) -> None:
    output = tmp_path / "out"
    arguments = ["run", TINY_LLAMA_DIR, "--length", "8", "--variants", "bf16", "--output-dir", output]
    arguments += ["--save-reference", output / "reference.safetensors", "--quiet"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([os.fspath(a) for a in arguments]) == 0
    files = assert_ordinary(output, umask)
    plots = ["error-vs-depth.png"] if matplotlib_available() else []
    assert files == sorted(
        [
            "precision-report.json",
            "summary.md",
            "inputs.safetensors",
            "logprobs/bf16.npy",
            "logprobs/reference.npy",
            "reference.safetensors",
            *plots,
        ]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


SESSION_TEST = """
import torch
from torch import nn


def test_linear(precision, assert_precision_within):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    inputs = {"input": torch.randn(2, 8)}
    assert_precision_within(precision.run(model, inputs, variants=["bf16"], backward=False))
"""


def test_every_file_of_a_session_has_the_umasks_mode(pytester: pytest.Pytester, umask: int) -> None:
    pytester.makepyfile(test_model=SESSION_TEST)
    pytester.makeini("[pytest]\ntestpaths = .\n")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("GITHUB_STEP_SUMMARY", None)
    arguments = ["-p", "no:cacheprovider", "--update-baselines", "--precision-report", "report"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *arguments], cwd=pytester.path, env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    baselines = assert_ordinary(pytester.path / "baselines", umask)
    assert baselines == ["test_model/test_linear.cpu.json"]
    report = assert_ordinary(pytester.path / "report", umask)
    plots = ["test_model/test_linear.png"] if matplotlib_available() else []
    assert report == sorted(["precision-report.json", "summary.md", *plots])
