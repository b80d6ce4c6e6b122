"""Shared by the pytester tests of the plugin: a tiny seeded model written into each pytester project, and
helpers to run pytest in-process and read what the user sees.

The runs are in-process (`pytester.runpytest`), and pytester restores `sys.modules` after each run and
again when its fixture ends: anything first imported after the fixture started is dropped again. So this
module, imported when the tests are collected, imports torch, every pytest_precision module and whatever a
comparison loads lazily (`warm_up()`), so that no run re-imports half of torch or a second copy of the plugin.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import re
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: tinymodel.py, written into every pytester project.
TINY_MODEL = '''
"""A tiny seeded language model: embedding -> 3 residual blocks -> norm -> head."""

import os

import torch
from torch import nn

from pytest_precision import Variant

VOCAB, HIDDEN = 64, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return TinyLM().eval()


def tiny_batch(seed=0):
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def coarse_block_1(model):
    """Round block 1's output to float8 e4m3 (3 mantissa bits): a regression injected into one block."""
    block = model.blocks[1]
    forward = block.forward

    def rounded(x):
        out = forward(x)
        return out.to(torch.float8_e4m3fn).to(out.dtype)

    block.forward = rounded
    return model


def chosen_variants():
    """TINY_VARIANTS (comma-separated, default bf16); with TINY_DEGRADE set, "bf16" is a degraded bf16."""
    names = os.environ.get("TINY_VARIANTS", "bf16").split(",")
    if not os.environ.get("TINY_DEGRADE"):
        return names
    degraded = Variant(name="bf16", dtype="bfloat16", prepare=coarse_block_1)
    return [degraded if name == "bf16" else name for name in names]


def run(precision, variants=None):
    return precision.run(tiny_model(), tiny_batch(), variants=variants or chosen_variants())
'''

#: The simplest precision test: compare the tiny model's bf16 run against its baseline.
SIMPLE_TEST = """
from tinymodel import run


def test_name(precision, assert_precision_within):
    assert_precision_within(run(precision))
"""


def gate_tests(*names: str) -> str:
    """A test file of SIMPLE_TEST's shape with one test per name, each gating tinymodel's run."""
    tests = [
        f"def {name}(precision, assert_precision_within):\n    assert_precision_within(run(precision))\n"
        for name in names
    ]
    return "\nfrom tinymodel import run\n\n\n" + "\n\n".join(tests)


def failed_tests(result: pytest.RunResult) -> list[str]:
    """The names of the tests a run reports as FAILED, sorted."""
    return sorted(re.findall(r"^FAILED [^:]+::(\w+)", result.stdout.str(), flags=re.M))


TABLE_HEADER = re.compile(r"^\s*variant\s+tensor\s+kind\s+metric\s+baseline\s+obtained\s+ratio\s+allowed$")


def warm_up() -> None:
    """Import torch and all of pytest_precision, and run one comparison and baseline round trip here."""
    import torch

    import pytest_precision

    for name in pytest_precision.__all__:
        getattr(pytest_precision, name)
    for module in pkgutil.iter_modules(pytest_precision.__path__):
        importlib.import_module(f"pytest_precision.{module.name}")
    from pytest_precision import compare
    from pytest_precision.gate import baseline
    from pytest_precision.outputs import plots
    from pytest_precision.reports import environment

    tiny = types.ModuleType("tinymodel_warm_up")
    exec(compile(TINY_MODEL, "tinymodel_warm_up", "exec"), tiny.__dict__)
    report = compare(tiny.tiny_model(), tiny.tiny_batch(), ["bf16", "fp16"])
    report.format()
    document = baseline.document(report, "warm_up", environment.environment("cpu", {}))
    json.loads(baseline.render(document))
    torch.float8_e4m3fn  # noqa: B018
    if importlib.util.find_spec("torchao") is not None:  # the lowbit variants' modules, loaded once here
        compare(tiny.tiny_model(), tiny.tiny_batch(), ["fp8_rowwise", "int8_weight_only", "fp8_e4m3_weights"])
    # torch.compile's modules (dynamo's backend registry refuses a backend registered twice, as a re-import in a
    # pytester run would): one tiny compilation with each backend the compiled variants' tests run.
    import torch._dynamo

    from pytest_precision.engine.compile_build import compiler_quiet

    with compiler_quiet():  # torch.jit.script_method's deprecation, raised by a module Inductor imports
        import torch._inductor.compile_fx

        for backend in ("eager", "aot_eager"):
            torch.compile(torch.sin, backend=backend)(torch.ones(2))
        torch._dynamo.list_backends()
    torch._dynamo.reset()
    # What --precision-report's plot imports, imported here once: then the warnings of matplotlib and the class
    # that run's -W ignores come from one pyparsing (run re-imports nothing that a warning class could differ in).
    if plots.matplotlib_available():
        with warnings.catch_warnings():
            deprecation = pyparsing_deprecation()
            if deprecation is not None:
                warnings.simplefilter("ignore", deprecation)
            for name in ("matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.ticker"):
                importlib.import_module(name)


def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, **tests: str) -> pytest.Pytester:
    """A pytester project with tinymodel.py and the given test files, and no TINY_* variables set."""
    for name in ("TINY_DEGRADE", "TINY_VARIANTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    pytester.makepyfile(tinymodel=TINY_MODEL)
    if tests:
        pytester.makepyfile(**tests)
    return pytester


def degrade(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, the "bf16" variant of tinymodel.run rounds block 1's output to float8."""
    monkeypatch.setenv("TINY_DEGRADE", "1")


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """pytest in-process under umask 022, the usual one, so that file modes are predictable.

    Torch runs on one thread meanwhile: a tiny model's kernels are ~20x faster without thread hand-offs,
    more so on a busy machine. (`project` sets OMP_NUM_THREADS=1 for xdist workers and subprocesses.)
    """
    import torch

    umask = os.umask(0o022)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # In-process, the plugin's package is already imported when the inner session marks it for assertion
        # rewriting (an install whose RECORD lists a .pth path does that), which only a second session in
        # one process can see: ignore that warning, not others.
        ignore = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
        if pyparsing_deprecation() is not None:
            ignore += ["-W", "ignore::pyparsing.PyparsingDeprecationWarning"]
        return pytester.runpytest("-p", "no:cacheprovider", *ignore, *args)
    finally:
        torch.set_num_threads(threads)
        os.umask(umask)


def pyparsing_deprecation() -> type[Warning] | None:
    """pyparsing's PyparsingDeprecationWarning, or None where pyparsing lacks it or is not installed.

    pyparsing >= 3.3 deprecates the camelCase names that matplotlib < 3.10.7 calls while plotting: the runs
    ignore it, or their output gains a warnings summary that is none of the plugin's doing.
    """
    try:
        import pyparsing
    except ImportError:
        return None
    return getattr(pyparsing, "PyparsingDeprecationWarning", None)


def baseline_file(pytester: pytest.Pytester, test_file: str, stem: str, directory: str = "baselines") -> Path:
    return pytester.path / directory / test_file / f"{stem}.cpu.json"


def output(result: pytest.RunResult) -> str:
    return "\n".join(result.outlines + result.errlines)


def failure(result: pytest.RunResult, test_name: str) -> list[str]:
    """The lines of one test's failure section, from its "___ name ___" title to the next title."""
    lines = result.outlines
    title = re.compile(rf"^_+ {re.escape(test_name)} _+$")
    starts = [i for i, line in enumerate(lines) if title.match(line)]
    assert len(starts) == 1, f"no single failure section for {test_name}:\n" + "\n".join(lines)
    section = []
    for line in lines[starts[0] + 1 :]:
        if re.match(r"^(_{3,} .* _{3,}|-{3,} .* -{3,}|={3,} .* ={3,})$", line):
            break
        section.append(line)
    return section


def table_rows(section: list[str]) -> list[list[str]]:
    """The rows under the violation table's header, split on whitespace."""
    headers = [i for i, line in enumerate(section) if TABLE_HEADER.match(line)]
    assert len(headers) == 1, "no single violation table header in:\n" + "\n".join(section)
    header = headers[0]
    rows = []
    for line in section[header + 1 :]:
        if not line.startswith("  ") or line.startswith("  ..."):
            break
        rows.append(line.split())
    return rows


def assert_no_traceback(result: pytest.RunResult) -> None:
    """What the user sees names no plugin internals: no traceback, no source lines, no library paths."""
    text = output(result)
    assert "Traceback" not in text
    assert "pytest_precision" not in text
    assert "site-packages" not in text
    assert not [line for line in result.outlines if line.startswith(("E   ", ">   "))]


def records(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, entry in document["variants"].items():
        for record in entry["records"]:
            yield name, record


def record_rows(path: Path, variant: str = "bf16") -> list[tuple[str, str]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return [(r["name"], r["kind"]) for v, r in records(data) if v == variant]


warm_up()


def stale_lines(result: pytest.RunResult) -> list[str]:
    """The "precision stale baselines" summary line and the files listed under it."""
    lines = output(result).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("precision stale baselines")), None)
    if start is None:
        return []
    return [lines[start], *(line.strip() for line in lines[start + 1 :] if line.startswith("  baselines/"))]
