"""What a session does at its end: the terminal summary, the session report (precision-report.json), summary.md
and the plots beside it; and which baseline files no collected test owns (stale)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import PrecisionError
from pytest_precision.plugin.options import is_folder
from pytest_precision.plugin.session import PrecisionSession

if TYPE_CHECKING:
    pass


def summary_lines(session: PrecisionSession, stale: list[Path] | None = None) -> list[str]:
    """The terminal summary: outcome counts, then improvements, environment warnings and stale files."""
    order = ("written", "updated", "unchanged", "kept", "passed", "failed", "missing")
    parts = [f"{session.outcomes[k]} {k}" for k in order if session.outcomes[k]]
    lines = [f"precision note: {note}" for note in session.notes]
    if parts:
        mode = "update" if session.update else "compare"
        lines.append(f"precision baselines ({mode}, {session._shown(session.baseline_dir)}): {', '.join(parts)}")
    if session.improvements:
        from pytest_precision.plugin.messages import refresh_command
    for nodeid, count in sorted(session.improvements.items()):
        lines.append(
            f"precision improved: {nodeid}: {count} tensor(s) beyond tolerance; tighten the baseline with: "
            f"{refresh_command(nodeid)}"
        )
    for path, differences in sorted(session.drift.items()):
        lines.append(f"precision environment differs from {path} (numbers may move): {'; '.join(differences)}")
    if stale:
        action = "deleted (--precision-prune)" if session.prune else "no test uses them; delete with --precision-prune"
        lines.append(f"precision stale baselines: {len(stale)} ({action}):")
        lines += [f"  {session._shown(path)}" for path in stale]
    lines += [f"precision error: {error}" for error in session.errors]
    return lines


def stale_baselines(session: PrecisionSession) -> list[Path]:
    """Baseline files no collected test owns, after a full run.

    Only the plugin's own files count (baselines.owned_document: its name pattern, its schema and a test
    id); anything else in the folder is never stale. A test that ran its check owns the files it used
    (and those for other devices); a test that was collected but skipped, deselected or stopped before
    its check owns every file recording its id; a file whose test lies in a module or folder that could
    not be fully collected (`protected`) is kept.
    """
    if not is_folder(session.baseline_dir):
        return []
    from pytest_precision.gate.baseline import owned_document, parse_baseline_name
    from pytest_precision.reports.environment import device_key

    current_device = device_key(session.device)
    stale = []
    for path in sorted(session.baseline_dir.rglob("*.json")):
        if str(path) in session.used_paths:
            continue
        data = owned_document(path)
        if data is None:
            continue  # not the plugin's file (or unreadable: its own test reports it)
        test = data["test"]
        name = parse_baseline_name(path.name)
        file_device = name[1] if name else None
        if test in session.collected and (test not in session.checked or file_device != current_device):
            continue
        if session.is_protected(test):
            continue
        stale.append(path)
    return stale


def write_report(session: PrecisionSession, stale: list[Path] | None = None) -> Path | None:
    """The session report: one JSON file with the session's environment (versions, device, ISA, GPU, CUDA,
    commit, date), stale baseline files and environment drift, and every precision test's outcome and
    records; summary.md and the plots beside it."""
    if session.report_dir is None:
        return None
    from pytest_precision.base.atomic_files import write_atomically
    from pytest_precision.gate.baseline import json_ready
    from pytest_precision.reports.environment import session_environment

    path = session.report_dir / "precision-report.json"
    document = {
        "schema_version": 1,
        "baseline_dir": os.fspath(session.baseline_dir),
        "environment": session_environment(session.rootpath, session.device),
        "stale": [os.fspath(session._shown(p)) for p in stale or []],
        "drift": session.drift,
        "tests": session.tests,
    }
    write_atomically(path, json.dumps(json_ready(document), indent=1, sort_keys=True, allow_nan=False) + "\n")
    _write_summary_and_plots(session, document)
    return path


def _write_summary_and_plots(session: PrecisionSession, document: Mapping[str, Any]) -> None:
    """DIR/summary.md (also appended to $GITHUB_STEP_SUMMARY) and, with matplotlib, one PNG per test,
    linked from the test's section of summary.md."""
    from pytest_precision.gate.baseline import load_baseline
    from pytest_precision.outputs.plots import matplotlib_available, plot_error_vs_depth, plot_path
    from pytest_precision.outputs.summary import markdown_summary, report_from_entry, write_summary

    assert session.report_dir is not None
    baselines: dict[str, Any] = {}
    for nodeid, entry in session.tests.items():
        try:
            baselines[nodeid] = load_baseline(Path(entry["baseline"]), "").records()
        except (PrecisionError, KeyError):
            continue  # missing or unreadable: the test itself reports it
    session.plots_skipped = not matplotlib_available()
    plotted = (
        [] if session.plots_skipped else [n for n, e in session.tests.items() if "variants" in e and "reference" in e]
    )
    plots = {nodeid: plot_path(session.report_dir, nodeid) for nodeid in plotted}
    text = markdown_summary(
        session.tests,
        baselines,
        environment=document["environment"],
        plots={nodeid: path.relative_to(session.report_dir).as_posix() for nodeid, path in plots.items()},
        stale=document["stale"],
        drift=session.drift,
    )
    write_summary(session.report_dir, text)
    for nodeid, plot in plots.items():
        plot_error_vs_depth(
            report_from_entry(session.tests[nodeid]), plot, baseline=baselines.get(nodeid), title=nodeid
        )
