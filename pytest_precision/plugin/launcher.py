"""`@pytest.mark.precision_distributed(world_size=N)`: a plain pytest run launches the ranks of such a test.

Each rank is a pytest process running that one test, with torchrun's environment (RANK, WORLD_SIZE, ...) and a
file store to meet at; the plugin in each initialises the process group (see distributed.init_from_environment)
and rank 0 writes the baseline. Each rank writes its outcome to a JSON file; the launching test reports one
outcome from them: passed when every rank passed, else the first failing rank's message. A rank that fails
stops the others after a grace period; a run past the timeout is killed and says which ranks were left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MARKER = "precision_distributed"
#: Environment of a launched rank: where it writes its outcome (also: this process is a launched rank).
RESULT_ENV = "PYTEST_PRECISION_RESULT"
STORE_ENV = "PYTEST_PRECISION_STORE"
BACKEND_ENV = "PYTEST_PRECISION_BACKEND"
#: Default seconds a launched test may run, all ranks together (the marker's timeout= overrides it).
DEFAULT_TIMEOUT_S = 600.0
#: Seconds the other ranks get to finish once one rank failed (they may be waiting on it in a collective).
GRACE_S = 20.0
#: Lines of a rank's output shown when it ended without an outcome.
TAIL_LINES = 40


@dataclass(frozen=True)
class Request:
    """What the marker asks for."""

    world_size: int
    timeout: float


def marker_request(item: pytest.Item) -> Request | None:
    """The item's precision_distributed request, checked; None when it has no such marker."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    unknown = sorted(set(marker.kwargs) - {"world_size", "timeout"})
    world_size = marker.kwargs.get("world_size", marker.args[0] if marker.args else None)
    timeout = marker.kwargs.get("timeout", DEFAULT_TIMEOUT_S)
    valid_size = isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1
    valid_timeout = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
    if unknown or len(marker.args) > 1 or not valid_size or not valid_timeout:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.{MARKER}(world_size=N, timeout=seconds) takes a whole number of ranks "
            f">= 1 and an optional positive timeout, got args={marker.args} kwargs={marker.kwargs}"
        )
    return Request(int(world_size), float(timeout))


def is_launched_rank() -> bool:
    """Whether this process is a rank launched by the marker (not by torchrun)."""
    return bool(os.environ.get(RESULT_ENV))


def running_ranks() -> int:
    """The world size this process is a rank of (torchrun or the launcher), 1 for a plain process."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _child_arguments(item: pytest.Item, basetemp: Path, forwarded: list[str]) -> list[str]:
    config = item.config
    path, separator, rest = item.nodeid.partition("::")
    target = f"{config.rootpath / path}{separator}{rest}"
    arguments = [sys.executable, "-m", "pytest", target, "-p", "no:cacheprovider", "-q", "--no-header"]
    arguments += ["--rootdir", os.fspath(config.rootpath), "--basetemp", os.fspath(basetemp)]
    if config.inipath is not None:
        arguments += ["-c", os.fspath(config.inipath)]
    if config.pluginmanager.hasplugin("xdist"):
        arguments += ["-n", "0"]  # one process per rank, whatever addopts say
    return arguments + forwarded


def _child_environment(rank: int, world_size: int, store: Path, result: Path, gpu: bool) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "TORCHELASTIC"))}
    environment.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        **{STORE_ENV: os.fspath(store), RESULT_ENV: os.fspath(result), BACKEND_ENV: "nccl" if gpu else "gloo"},
    )
    environment.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the cores
    return environment


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return "\n".join(lines[-TAIL_LINES:]) or "(no output)"


def launch(item: pytest.Item, request: Request, forwarded: list[str], *, gpu: bool) -> list[dict[str, Any]]:
    """Run `item` on `request.world_size` ranks; every rank's outcome (a dict read from its result file, or
    one saying how it ended without one). Never hangs: ranks past the timeout, or past the grace period after
    another rank failed, are killed."""
    with tempfile.TemporaryDirectory(prefix="precision-ranks-") as folder:
        work = Path(folder)
        store = work / "store"
        processes = []
        for rank in range(request.world_size):
            result = work / f"rank{rank}.json"
            output = (work / f"rank{rank}.log").open("wb")
            command = _child_arguments(item, work / f"tmp{rank}", forwarded)
            process = subprocess.Popen(
                command,
                cwd=item.config.invocation_params.dir,
                env=_child_environment(rank, request.world_size, store, result, gpu),
                stdout=output,
                stderr=subprocess.STDOUT,
            )
            output.close()
            processes.append(process)
        try:
            ended = _wait(processes, request.timeout)
        finally:  # interrupted (Ctrl-C, a pytest timeout plugin): no rank outlives the test
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        outcomes = []
        for rank, process in enumerate(processes):
            result = work / f"rank{rank}.json"
            if result.is_file():
                outcome: dict[str, Any] = json.loads(result.read_text())
            else:
                why = ended.get(rank) or f"exited with status {process.returncode} without an outcome"
                outcome = {
                    "outcome": "failed",
                    "message": f"{why}; its last output:\n{_tail(work / f'rank{rank}.log')}",
                }
            outcome["rank"] = rank
            outcomes.append(outcome)
        return outcomes


def _wait(processes: list[subprocess.Popen[bytes]], timeout: float) -> dict[int, str]:
    """Wait for every process; kill those left at the timeout, or GRACE_S after one failed. Returns why each
    killed rank ended."""
    start = time.monotonic()
    failed_at: float | None = None
    killed: dict[int, str] = {}
    while True:
        codes = [p.poll() for p in processes]
        if all(code is not None for code in codes):
            return killed
        now = time.monotonic()
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        reason = None
        if now - start > timeout:
            reason = f"killed after the test's timeout of {timeout:g} s"
        elif failed_at is not None and now - failed_at > GRACE_S:
            reason = f"killed {GRACE_S:g} s after another rank failed (it was waiting on that rank)"
        if reason is not None:
            for rank, process in enumerate(processes):
                if process.poll() is None:
                    process.kill()
                    process.wait()
                    killed[rank] = reason
            return killed
        time.sleep(0.05)


def one_outcome(outcomes: list[dict[str, Any]]) -> tuple[str, str]:
    """("passed" | "skipped" | "failed", message) of the launched test from its ranks' outcomes."""
    failed = [o for o in outcomes if o["outcome"] == "failed"]
    if failed:
        first = failed[0]
        messages = {str(o.get("message", "")).strip() for o in failed}
        if len(failed) == len(outcomes) and len(messages) == 1:
            count = len(outcomes)
            return "failed", f"every rank ({count} of {count}) failed alike:\n{first.get('message', '')}"
        others = [str(o["rank"]) for o in failed[1:]]
        also = f" (rank(s) {', '.join(others)} failed too)" if others else ""
        message = f"rank {first['rank']} of {len(outcomes)}{also}:\n{first.get('message', '')}"
        for other in failed[1:]:  # what the other ranks said, when they said something else
            said = str(other.get("message", "")).strip()
            if said and said != str(first.get("message", "")).strip():
                message += f"\nrank {other['rank']}: {said.splitlines()[0]}"
        return "failed", message
    if all(o["outcome"] == "skipped" for o in outcomes):
        return "skipped", str(outcomes[0].get("message", ""))
    return "passed", ""


class RankRecorder:
    """In a launched rank: the outcome of its one test, written to RESULT_ENV's file at the session's end."""

    def __init__(self) -> None:
        self.outcome = "skipped"
        self.message = "no test ran on this rank (deselected or not collected)"
        self.tables = ""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.record(report)

    def record(self, report: pytest.TestReport) -> None:
        if report.failed:
            if self.outcome != "failed":
                self.message = report.longreprtext
            self.outcome = "failed"
        elif report.skipped and self.outcome != "failed":
            self.outcome, self.message = "skipped", _skip_reason(report)
        elif report.when == "call" and report.passed and self.outcome != "failed":
            self.outcome, self.message = "passed", ""
        for title, text in report.sections:
            if title == "precision tables":
                self.tables = text

    def write(self, session_export: dict[str, Any]) -> None:
        path = Path(os.environ[RESULT_ENV])
        from pytest_precision.base.atomic_files import write_atomically

        document = {"outcome": self.outcome, "message": self.message, "tables": self.tables, "session": session_export}
        write_atomically(path, json.dumps(document))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


__all__ = ["MARKER"]
