"""pytest hooks, options and fixtures; everything else lives in plain library modules.

Importing this module (pytest does, for every user of the environment) imports neither torch nor
transformers: they load when a precision fixture is first used.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator
from typing import Any

import pytest

pytest.register_assert_rewrite("pytest_precision.assertion")

from .session import (  # noqa: E402
    OPTION_ATOL,
    OPTION_BASELINE_DIR,
    OPTION_RTOL,
    OPTION_TABLES,
    SESSION_KEY,
    TABLES_KEY,
    PrecisionRunner,
    PrecisionSession,
    option,
)

GPU_MARKER = "precision_gpu"
TABLES_SECTION = "precision tables"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("precision", "numerical precision gates (pytest-precision)")
    group.addoption(
        "--update-baselines",
        action="store_true",
        default=False,
        dest="update_baselines",
        help="write precision baselines instead of comparing against them (no ini twin, on purpose)",
    )
    group.addoption(
        "--precision-gpu",
        action="store_true",
        default=None,
        dest="precision_gpu",
        help="run precision tests on CUDA and run tests marked precision_gpu (error if no CUDA device)",
    )
    group.addoption(
        "--precision-baseline-dir",
        default=None,
        dest=OPTION_BASELINE_DIR,
        help="folder of baseline files, relative to rootdir (default: baselines)",
    )
    group.addoption("--precision-rtol", default=None, dest=OPTION_RTOL, help="default relative tolerance (0.10)")
    group.addoption("--precision-atol", default=None, dest=OPTION_ATOL, help="default absolute tolerance (1e-5)")
    group.addoption(
        "--precision-tables",
        action="store_true",
        default=None,
        dest=OPTION_TABLES,
        help="print each precision test's error-propagation tables in the terminal summary",
    )
    parser.addini("precision_gpu", "like --precision-gpu", type="bool", default=False)
    parser.addini(OPTION_BASELINE_DIR, "like --precision-baseline-dir", default="baselines")
    parser.addini(OPTION_RTOL, "like --precision-rtol", default="")
    parser.addini(OPTION_ATOL, "like --precision-atol", default="")
    parser.addini(OPTION_TABLES, "like --precision-tables", type="bool", default=False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "precision(rtol=None, atol=None): tolerances of this test's precision gate")
    config.addinivalue_line("markers", f"{GPU_MARKER}: needs a CUDA device; runs only with --precision-gpu")
    if config.getoption("precision_gpu") is None:
        config.option.precision_gpu = bool(config.getini("precision_gpu"))
    if config.getoption("precision_gpu"):
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(
                "--precision-gpu (or ini precision_gpu) needs a CUDA device, and torch sees none "
                f"(torch {torch.__version__}); run without it to test on CPU"
            )
    config.stash[SESSION_KEY] = PrecisionSession.from_config(config)


def pytest_report_header(config: pytest.Config) -> str:
    from .environment import package_version

    session = config.stash[SESSION_KEY]
    if "torch" in sys.modules:
        threads = str(sys.modules["torch"].get_num_threads())
    else:
        threads = os.environ.get("OMP_NUM_THREADS") or f"{os.cpu_count()} cores"
    mode = "update" if session.update else "compare"
    return (
        f"precision: torch {package_version('torch')}, device {session.device}, threads {threads}, "
        f"baselines {session.baseline_dir} ({mode})"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("precision_gpu"):
        return
    skip = pytest.mark.skip(reason="precision_gpu: needs a CUDA device; run with --precision-gpu")
    for item in items:
        if item.get_closest_marker(GPU_MARKER) is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    from .assertion import CURRENT_ITEM

    token = CURRENT_ITEM.set(item)
    try:
        return (yield)
    finally:
        CURRENT_ITEM.reset(token)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    tables = item.stash.get(TABLES_KEY, [])
    if call.when == "call" and tables:
        report.sections.append((TABLES_SECTION, "\n\n".join(tables)))
    return report


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is None:
        return
    if session.show_tables:
        shown = False
        for reports in terminalreporter.stats.values():
            for report in reports:
                for title, text in getattr(report, "sections", []):
                    if title == TABLES_SECTION:
                        if not shown:
                            terminalreporter.write_sep("=", "precision tables")
                            shown = True
                        terminalreporter.write_line(f"{report.nodeid}")
                        terminalreporter.write_line(text)
                        terminalreporter.write_line("")
    for line in session.summary_lines():
        terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    precision_session = session.config.stash.get(SESSION_KEY, None)
    if workeroutput is not None and precision_session is not None:
        # An xdist worker: the controller prints the summary, so hand it this worker's counts.
        workeroutput["precision_outcomes"] = dict(precision_session.outcomes)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    outcomes = getattr(node, "workeroutput", {}).get("precision_outcomes")
    if outcomes:
        node.config.stash[SESSION_KEY].outcomes.update(outcomes)


@pytest.fixture
def precision_device(request: pytest.FixtureRequest) -> str:
    """ "cpu", or "cuda" with --precision-gpu."""
    return request.config.stash[SESSION_KEY].device


@pytest.fixture
def precision(request: pytest.FixtureRequest, precision_device: str) -> PrecisionRunner:
    """`precision.run(model, inputs, variants=[...], **compare_kwargs) -> PrecisionReport`."""
    return PrecisionRunner(request.node, precision_device, request.config.stash[SESSION_KEY])


@pytest.fixture(name="assert_precision_within")
def assert_precision_within_fixture(request: pytest.FixtureRequest) -> Callable[..., None]:
    """`assert_precision_within(report, *, baseline=None, rtol=None, atol=None, metrics=None, tolerances=None,
    limits=None)`: fail this test when the report regressed against its baseline."""
    session = request.config.stash[SESSION_KEY]
    item = request.node

    def check(report: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        session.check(item, report, **kwargs)

    return check


__all__ = ["option"]
