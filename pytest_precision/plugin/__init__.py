"""pytest hooks, options and fixtures; everything else lives in plain library modules.

Importing this module (pytest does, for every user of the environment) imports neither torch nor
transformers: they load when a precision fixture is first used.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

pytest.register_assert_rewrite("pytest_precision.plugin.assertion")

from pytest_precision.base.errors import NotSupportedHere  # noqa: E402
from pytest_precision.base.torchao_notices import quiet_torchao_notices  # noqa: E402
from pytest_precision.plugin import session_end  # noqa: E402
from pytest_precision.plugin.launcher import MARKER as DISTRIBUTED_MARKER  # noqa: E402
from pytest_precision.plugin.launcher import (  # noqa: E402
    RankRecorder,
    is_launched_rank,
    launch,
    marker_request,
    one_outcome,
    running_ranks,
)
from pytest_precision.plugin.options import (  # noqa: E402
    ALIAS_TAKEN_KEY,
    OPTION_RESOLVED_GATE,
    UPDATE_ALIAS,
    UPDATE_FLAGS,
    add_options,
    add_update_alias,
    is_folder,
    option,
)
from pytest_precision.plugin.precision_fixture import PrecisionRunner  # noqa: E402
from pytest_precision.plugin.session import (  # noqa: E402
    ASSERTED_KEY,
    SESSION_KEY,
    TABLES_KEY,
    PrecisionSession,
    PrecisionUnassertedWarning,
    unasserted_run,
)

quiet_torchao_notices()  # before a test module imports transformers, which imports torchao

GPU_MARKER = "precision_gpu"
RECORDER_KEY = pytest.StashKey[RankRecorder]()
#: Whether this session created the default process group (torchrun or launched ranks): it destroys it.
GROUP_CREATED_KEY = pytest.StashKey[bool]()
STALE_KEY = pytest.StashKey[list[Path]]()
REPORT_PATH_KEY = pytest.StashKey[Path | None]()
TABLES_SECTION = "precision tables"


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    add_options(parser, pluginmanager)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser) -> Generator[None, Any, Any]:
    try:
        return (yield)
    finally:
        if not add_update_alias(parser):
            early_config.stash[ALIAS_TAKEN_KEY] = True


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    # --precision-resolved-gate FILE (what `pytest-precision diff` asks): write the gate and run nothing. Other
    # sessions do not import the module.
    if config.getoption(OPTION_RESOLVED_GATE) is None:
        return None
    from pytest_precision.plugin.resolved_gate import write_resolved_gate

    return write_resolved_gate(config)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "precision(rtol=None, atol=None, isolate=None): tolerances of this test's precision gate (a number, or "
        "{metric: number}); "
        "isolate=True also measures each module's isolated error in precision.run",
    )
    config.addinivalue_line("markers", f"{GPU_MARKER}: needs a CUDA device; runs only with --precision-gpu")
    config.addinivalue_line(
        "markers",
        f"{DISTRIBUTED_MARKER}(world_size=N, timeout=600): run this test on N torch.distributed ranks (a plain "
        "pytest launches them, gloo on CPU, nccl with --precision-gpu; under torchrun it runs in place)",
    )
    if is_launched_rank():
        recorder = config.stash[RECORDER_KEY] = RankRecorder()
        config.pluginmanager.register(recorder, "precision-rank-recorder")
    if config.getoption("precision_gpu") is None:
        config.option.precision_gpu = bool(config.getini("precision_gpu"))
    session = PrecisionSession.from_config(config)
    UPDATE_FLAGS[:] = ["--precision-update" if config.stash.get(ALIAS_TAKEN_KEY, False) else UPDATE_ALIAS]
    if config.stash.get(ALIAS_TAKEN_KEY, False):
        session.notes.append(
            f"{UPDATE_ALIAS} belongs to another plugin or conftest here and keeps its meaning there; "
            "write precision baselines with --precision-update"
        )
    if session.update and session.strict:
        raise pytest.UsageError(
            "--update-baselines and --precision-strict (or ini precision_strict) contradict each other: "
            "update first, then gate strictly"
        )
    if session.gpu:
        session.device = _pin_gpu(config)
    config.stash[SESSION_KEY] = session


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (or no rank at all)."""
    return os.environ.get("RANK", "0") == "0"


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(GROUP_CREATED_KEY, False):
        from pytest_precision.distributed.ranks import shut_down

        shut_down()
    UPDATE_FLAGS[:] = [UPDATE_ALIAS]  # a later session in this process (pytester) starts from the default


def _pin_gpu(config: pytest.Config) -> str:
    """The CUDA device of this process: xdist worker gwN takes GPU N mod device_count, pinned before the
    worker first uses CUDA, so `pytest -n <gpus> --precision-gpu` spreads a suite over a machine's GPUs."""
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(
            "--precision-gpu (or ini precision_gpu) needs a CUDA device, and torch sees none "
            f"(torch {torch.__version__}); run without it to test on CPU"
        )
    if running_ranks() > 1:  # a torch.distributed rank: its own GPU
        index = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is None:
        return "cuda"
    index = int(worker.removeprefix("gw")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def pytest_report_header(config: pytest.Config) -> str:
    from pytest_precision.reports.environment import package_version

    session = config.stash[SESSION_KEY]
    if "torch" in sys.modules:
        threads = str(sys.modules["torch"].get_num_threads())
    else:
        threads = os.environ.get("OMP_NUM_THREADS") or f"{os.cpu_count()} cores"
    mode = "update" if session.update else "compare"
    device = session.device
    workers = getattr(config.option, "numprocesses", None)
    if session.gpu and workers:
        count = sys.modules["torch"].cuda.device_count()
        device = f"cuda, worker gwN on cuda:(N mod {count})"
    return (
        f"precision: torch {package_version('torch')}, device {device}, threads {threads}, "
        f"baselines {session.baseline_dir} ({mode})"
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    if running_ranks() > 1:  # torchrun, or a rank the marker launched: join the others
        from pytest_precision.distributed.ranks import init_from_environment

        session.config.stash[GROUP_CREATED_KEY] = init_from_environment()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[SESSION_KEY].collected.update(item.nodeid for item in items)
    ranks = running_ranks()
    for item in items:
        request = marker_request(item)
        if request is not None and ranks > 1 and request.world_size != ranks:
            reason = f"{DISTRIBUTED_MARKER}: needs {request.world_size} ranks, this process is one of {ranks}"
            item.add_marker(pytest.mark.skip(reason=reason))
    if config.getoption("precision_gpu"):
        return
    skip = pytest.mark.skip(reason="precision_gpu: needs a CUDA device; run with --precision-gpu")
    for item in items:
        if item.get_closest_marker(GPU_MARKER) is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> Generator[None, Any, Any]:
    ignored = yield
    if ignored:
        # --ignore, --ignore-glob, collect_ignore, another plugin: tests there may exist; keep their files.
        _protect(config, collection_path)
    return ignored


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    if report.outcome != "passed":
        # A collection error or a module-level skip (importorskip, skip(allow_module_level=True)): its
        # tests are unknown this run, so their baselines are not stale.
        session = collector.config.stash.get(SESSION_KEY, None)
        if session is not None:
            session.protected.add(report.nodeid)
    return report


def _protect(config: pytest.Config, path: Path) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is None:
        return
    # Node ids are relative to rootdir as paths are given (symlinks unresolved); try that first.
    for inside, root in ((path, config.rootpath), (path.resolve(), config.rootpath.resolve())):
        try:
            relative = inside.relative_to(root).as_posix()
        except ValueError:
            continue
        session.protected.add("" if relative == "." else relative)
        return
    # Outside rootdir: no test id of a baseline under it.


def pytest_deselected(items: list[pytest.Item]) -> None:
    # Deselected tests still own their baselines (stale-file detection); -k and friends call this.
    for item in items:
        item.config.stash[SESSION_KEY].collected.add(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    from pytest_precision.plugin.assertion import CURRENT_ITEM

    token = CURRENT_ITEM.set(item)
    try:
        return (yield)
    finally:
        CURRENT_ITEM.reset(token)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    # A variant this machine cannot run (fp8 matmuls without such a GPU, ...): skipped with the reason.
    try:
        result = yield
    except NotSupportedHere as error:
        pytest.skip(str(error))
    # After a test body that returned: precision.run without assert_precision_within warns (fails if strict).
    message = unasserted_run(item)
    if message is not None:
        if item.config.stash[SESSION_KEY].strict:
            pytest.fail(message, pytrace=False)
        warnings.warn(PrecisionUnassertedWarning(message), stacklevel=1)
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A precision_distributed test in a plain process: launch its ranks instead of calling it here."""
    request = marker_request(pyfuncitem)
    if request is None or running_ranks() > 1:
        return None
    session = pyfuncitem.config.stash[SESSION_KEY]
    if session.gpu:
        import torch

        if torch.cuda.device_count() < request.world_size:
            pytest.skip(
                f"{DISTRIBUTED_MARKER}: {request.world_size} ranks need {request.world_size} GPUs (one per rank), "
                f"this machine has {torch.cuda.device_count()}"
            )
    outcomes = launch(pyfuncitem, request, session.forwarded_options(), gpu=session.gpu)
    for outcome in outcomes[:1]:  # rank 0 wrote the files and holds the session's results
        session.merge(outcome.get("session") or {})
        if outcome.get("tables"):
            pyfuncitem.stash.setdefault(TABLES_KEY, []).append(outcome["tables"])
    verdict, message = one_outcome(outcomes)
    if verdict == "failed":
        pytest.fail(message, pytrace=False)
    if verdict == "skipped":
        pytest.skip(message)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    tables = item.stash.get(TABLES_KEY, [])
    if call.when == "call" and tables:
        report.sections.append((TABLES_SECTION, "\n\n".join(tables)))
    return report


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is None or (running_ranks() > 1 and not is_rank_zero()):
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
    for line in session_end.summary_lines(session, config.stash.get(STALE_KEY, None)):
        terminalreporter.write_line(line)
    report_path = config.stash.get(REPORT_PATH_KEY, None)
    if report_path is not None:
        terminalreporter.write_line(f"precision report: {report_path} and summary.md beside it")
        if session.plots_skipped:
            terminalreporter.write_line(
                "precision plots: skipped, matplotlib is not installed (pip install 'pytest-precision[plot]')"
            )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    precision_session = config.stash.get(SESSION_KEY, None)
    if precision_session is None:
        return
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        # An xdist worker: the controller prints the summary, so hand it this worker's results.
        workeroutput["precision"] = precision_session.export()
        return
    recorder = config.stash.get(RECORDER_KEY, None)
    if recorder is not None:
        # A rank the marker launched: the launching test reports, and its session prunes and writes reports.
        recorder.write(precision_session.export())
        return
    if running_ranks() > 1 and not is_rank_zero():
        return  # under torchrun, rank 0 alone writes files
    _record_test_outcomes(session, precision_session)
    if (precision_session.update or precision_session.prune) and is_folder(precision_session.baseline_dir):
        from pytest_precision.base.atomic_files import remove_stale_temporaries

        remove_stale_temporaries(precision_session.baseline_dir, recursive=True)
    if not is_partial_run(session, exitstatus):
        stale = session_end.stale_baselines(precision_session)
        if precision_session.prune:
            for path in stale:
                try:
                    path.unlink(missing_ok=True)
                except OSError as error:
                    precision_session.errors.append(f"--precision-prune could not delete {path}: {error}")
        config.stash[STALE_KEY] = stale
        if stale and not precision_session.prune and (precision_session.fail_stale or precision_session.strict):
            precision_session.errors.append(
                f"{len(stale)} stale baseline file(s) (listed above) and --precision-fail-stale or "
                "--precision-strict: delete them with --precision-prune, or restore the tests that wrote them"
            )
    try:
        config.stash[REPORT_PATH_KEY] = session_end.write_report(precision_session, config.stash.get(STALE_KEY, None))
    except OSError as error:
        config.stash[REPORT_PATH_KEY] = None
        precision_session.errors.append(f"precision report not written to {precision_session.report_dir}: {error}")
    if precision_session.errors and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        # The tests passed, but what the run promised (one owner per file, a report) did not hold.
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _record_test_outcomes(session: pytest.Session, precision_session: PrecisionSession) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {}) if reporter is not None else {}
    for outcome, reports in stats.items():
        for report in reports:
            nodeid = str(getattr(report, "nodeid", ""))
            counts = nodeid in precision_session.tests and getattr(report, "when", None) in ("call", "setup")
            if counts and outcome in ("passed", "failed", "skipped", "error"):
                precision_session.tests[nodeid]["outcome"] = outcome


def is_partial_run(session: pytest.Session, exitstatus: int) -> bool:
    """Whether this run selected less than the whole configured suite: then no baseline is called stale."""
    config = session.config
    options = config.option
    if exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR):
        return True
    if session.shouldstop or session.shouldfail:
        return True
    # --deselect, --ignore, collection errors and module-level skips are handled per path (see
    # PrecisionSession.protected and pytest_deselected); these narrow the run as a whole.
    narrowing = ("keyword", "markexpr", "lf", "stepwise", "stepwise_skip")
    if any(getattr(options, name, None) for name in narrowing):
        return True
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        return False
    configured = [config.rootpath / p for p in config.getini("testpaths")] or [config.rootpath]
    selected = []
    for argument in config.args:
        if "::" in argument:
            return True
        selected.append((config.invocation_params.dir / argument).resolve())
    return not all(
        any(path.resolve() == chosen or chosen in path.resolve().parents for chosen in selected) for path in configured
    )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    exported = getattr(node, "workeroutput", {}).get("precision")
    if exported:
        node.config.stash[SESSION_KEY].merge(exported)


@pytest.fixture
def precision_device(request: pytest.FixtureRequest) -> str:
    """ "cpu", or "cuda" with --precision-gpu."""
    return request.config.stash[SESSION_KEY].device


@pytest.fixture
def precision(request: pytest.FixtureRequest, precision_device: str) -> PrecisionRunner:
    """`precision.run(model, inputs, variants=[...], **compare_kwargs) -> PrecisionReport`."""
    return PrecisionRunner(request.node, precision_device, request.config.stash[SESSION_KEY])


@pytest.fixture(name="assert_port_agrees")
def assert_port_agrees_fixture(request: pytest.FixtureRequest) -> Callable[..., None]:
    """`assert_port_agrees(report, variant, *, limit=1e-4)`: fail this test unless the fp32 port variant agrees with
    the reference implementation to rounding (pytest_precision.ports.assert_port_agrees); gates the test's runs."""
    from pytest_precision.reports.ports import agreement_failure

    item = request.node

    def check(report: Any, variant: str, **kwargs: Any) -> None:
        __tracebackhide__ = True
        item.stash[ASSERTED_KEY] = True
        failure = agreement_failure(report, variant, **kwargs)
        if failure is not None:
            pytest.fail(failure, pytrace=False)

    return check


@pytest.fixture(name="assert_port_within")
def assert_port_within_fixture(request: pytest.FixtureRequest) -> Callable[..., None]:
    """`assert_port_within(report, ours, theirs, *, factor=2.0, floor=1e-6)`: fail this test when the port's error is
    above `factor` times the reference implementation's in a row (pytest_precision.ports.assert_port_within); gates
    the test's runs."""
    from pytest_precision.reports.ports import ratio_failure

    item = request.node

    def check(report: Any, ours: str, theirs: str, **kwargs: Any) -> None:
        __tracebackhide__ = True
        item.stash[ASSERTED_KEY] = True
        failure = ratio_failure(report, ours, theirs, **kwargs)
        if failure is not None:
            pytest.fail(failure, pytrace=False)

    return check


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
