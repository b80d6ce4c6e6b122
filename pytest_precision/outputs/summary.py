"""A GitHub-flavoured markdown summary of a `--precision-report` run: per test its outcome, its worst
regressions and improvements against its baseline, and the error-propagation summary per kind.

`write_summary` writes it to DIR/summary.md and, on GitHub Actions, appends it to the job summary
(the file named by GITHUB_STEP_SUMMARY).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pytest_precision.base.atomic_files import write_atomically
from pytest_precision.base.records import Record
from pytest_precision.gate.checks import check_against_baseline
from pytest_precision.gate.tolerance import DEFAULT_METRICS, Violation
from pytest_precision.gate.tolerance_rules import ToleranceRules
from pytest_precision.reports.report import PrecisionReport
from pytest_precision.reports.tables import (
    SUMMARY_KINDS,
    percent_column,
    routing_cells,
    summary_rows,
    summary_values,
)

SUMMARY_FILE = "summary.md"
#: Rows of regressions and of improvements shown per test.
TOP_CHANGES = 5


def report_from_entry(entry: Mapping[str, Any]) -> PrecisionReport:
    """The PrecisionReport of one test entry of precision-report.json."""
    variants = entry.get("variants") or {}
    return PrecisionReport.from_dict(
        {
            "device": entry.get("device", "cpu"),
            "reference": entry["reference"],
            "variants": variants,
            "order": list(variants),
            "nonfinite_origin": entry.get("nonfinite_origin") or {},
        }
    )


def _cell(text: object) -> str:
    """A table cell: pipes escaped, line breaks flattened."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """Inline code that survives backticks in the text."""
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}" if fence == "`" else f"{fence} {text} {fence}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> list[str]:
    """A GitHub markdown table: the first `left` columns left-aligned, the rest (numbers) right-aligned."""
    align = [":---" if i < left else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(_cell(c) for c in header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _value(metric: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    if metric.endswith("_rel"):
        return percent_column([value])[0]
    if metric == "nonfinite":
        return str(int(value))
    return f"{value:.4g}"


def _ratio(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    if math.isinf(ratio):
        return "inf"
    return f"{ratio:.2f}x"


def _sort_key(violation: Violation, *, descending: bool) -> tuple[int, float]:
    ratio = violation.ratio
    if ratio is None or math.isnan(ratio):
        return (1, 0.0)
    return (0, -ratio if descending else ratio)


def _changes_table(violations: Iterable[Violation], *, descending: bool) -> list[str]:
    chosen = sorted(violations, key=lambda v: _sort_key(v, descending=descending))[:TOP_CHANGES]
    rows = [
        [
            v.variant,
            v.name,
            v.kind,
            v.metric,
            _value(v.metric, v.expected),
            _value(v.metric, v.obtained),
            _ratio(v.ratio),
        ]
        for v in chosen
    ]
    return markdown_table(["variant", "tensor", "kind", "metric", "baseline", "obtained", "ratio"], rows, left=4)


def baseline_section(
    report: PrecisionReport,
    baseline: Mapping[str, Sequence[Record]],
    *,
    rules: ToleranceRules | None = None,
    metrics: Iterable[str] = DEFAULT_METRICS,
) -> list[str]:
    """Markdown lines: the worst regressions (largest obtained/baseline first) and improvements (smallest
    first) past the tolerance, plus tensors or variants that are new or missing."""
    obtained = {variant: report.records(variant) for variant in report.variants}
    check = check_against_baseline(baseline, obtained, rules or ToleranceRules(), metrics)
    regressions = [v for v in check.violations if v.reason in ("regressed", "nonfinite")]
    other = [v for v in check.violations if v.reason in ("new", "missing", "undefined")]
    lines: list[str] = []
    worst = _ratio(check.worst_ratio)
    lines.append(
        f"Against the baseline: {len(regressions)} regression(s), {len(check.improvements)} improvement(s) "
        f"over {check.gated} gated tensor(s); worst ratio {worst}."
    )
    if regressions:
        shown = min(len(regressions), TOP_CHANGES)
        lines += ["", f"**Worst regressions** ({shown} of {len(regressions)}, largest first)", ""]
        lines += _changes_table(regressions, descending=True)
    if check.improvements:
        shown = min(len(check.improvements), TOP_CHANGES)
        lines += ["", f"**Largest improvements** ({shown} of {len(check.improvements)}, largest first)", ""]
        lines += _changes_table(check.improvements, descending=False)
    if other:
        listed = ", ".join(_new_or_missing(v) for v in other[:10])
        more = f" and {len(other) - 10} more" if len(other) > 10 else ""
        lines += ["", f"New, missing or undefined against the baseline: {listed}{more}."]
    return lines


def _new_or_missing(violation: Violation) -> str:
    if violation.name == "*":
        return f"{violation.variant} (whole variant {violation.reason})"
    if violation.reason == "undefined":
        side = "this run" if violation.obtained is None else "the baseline"
        return f"{violation.variant}: {violation.name} ({violation.kind}, {violation.metric} undefined in {side})"
    return f"{violation.variant}: {violation.name} ({violation.kind}, {violation.reason})"


def propagation_tables(report: PrecisionReport, metric: str = "rms_rel") -> list[str]:
    """Markdown lines: per kind (fw, bw, grad), one row per variant with the metric at the first tensor,
    the median and max in between, and the last tensor (percent as in tables.py)."""
    lines: list[str] = []
    for kind in SUMMARY_KINDS:
        present = [(label, records) for label, records in summary_rows(report, kind) if records]
        if not present:
            continue
        values, (first, last) = summary_values(present, metric)
        columns = [percent_column(list(column)) for column in zip(*values, strict=True)]
        header = [kind, f"first ({first})", "mid median", "mid max", f"last ({last})"]
        rows = [[label, *(column[i] for column in columns)] for i, (label, _) in enumerate(present)]
        if lines:
            lines.append("")
        lines += markdown_table(header, rows)
    header, rows = routing_cells(report)
    if rows:
        lines += ["", "Routing: tokens whose top-k experts agree with the reference's.", ""]
        lines += markdown_table(header, rows)
    return lines


def section_lines(
    nodeid: str,
    entry: Mapping[str, Any],
    baseline: Mapping[str, Sequence[Record]] | None = None,
    *,
    rules: ToleranceRules | None = None,
    metrics: Iterable[str] = DEFAULT_METRICS,
    plot: str | None = None,
) -> list[str]:
    """The markdown lines of one test. The tolerances and gated metrics its gate used (the entry's "gate",
    see ToleranceRules.to_dict) replace `rules` and `metrics` when the entry has them. `plot`: the link to the
    test's error-vs-depth plot, relative to summary.md."""
    gate = entry.get("gate")
    if isinstance(gate, Mapping):
        rules = ToleranceRules.from_dict(gate)
        metrics = gate.get("metrics") or metrics
    outcome = entry.get("outcome") or "unknown"
    lines = [f"### {_code(nodeid)}: {outcome}", ""]
    if entry.get("baseline_outcome") or entry.get("baseline"):
        where = f" ({_code(str(entry['baseline']))})" if entry.get("baseline") else ""
        lines += [f"Baseline: {entry.get('baseline_outcome') or 'n/a'}{where}.", ""]
    if not entry.get("variants"):
        lines += ["No precision records.", ""]
        return lines
    if plot is not None:
        lines += [f"Plot: [{plot}]({quote(plot)}).", ""]
    report = report_from_entry(entry)
    reference = report.reference.variant.get("name", "fp32")
    if report.nonfinite_origin:
        origins = ", ".join(f"{variant}: {_code(where)}" for variant, where in report.nonfinite_origin.items())
        lines += [f"First NaN/Inf: {origins}.", ""]
    if baseline is not None:
        lines += [*baseline_section(report, baseline, rules=rules, metrics=metrics), ""]
    table = propagation_tables(report)
    if table:
        lines += [
            f"Error propagation: `rms_rel` against the {reference} reference on {report.device}, in execution order.",
            "",
        ]
        lines += [*table, ""]
    return lines


def markdown_summary(
    tests: Mapping[str, Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, list[Record]]] | None = None,
    *,
    rules: ToleranceRules | None = None,
    metrics: Iterable[str] = DEFAULT_METRICS,
    title: str = "Precision report",
    environment: Mapping[str, Any] | None = None,
    plots: Mapping[str, str] | None = None,
    stale: Sequence[str] = (),
    drift: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """The whole summary: a title line with the outcome counts, then one section per test.

    `tests` is the "tests" block of precision-report.json; `baselines` maps a nodeid to its baseline's
    records per variant (Baseline.records()). Each test is held against its baseline with the tolerances
    and metrics its gate used (its entry's "gate"); `rules` and `metrics` serve entries without one.
    `environment`: the session's (a line under the title); `plots`: {nodeid: link to its plot}; `stale`:
    baseline files no test used; `drift`: {baseline file: environment differences}.
    """
    baselines = baselines or {}
    metrics = list(metrics)
    counts: dict[str, int] = {}
    for entry in tests.values():
        outcome = str(entry.get("outcome") or "unknown")
        counts[outcome] = counts.get(outcome, 0) + 1
    tally = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests"
    lines = [f"## {title}", "", f"{len(tests)} test(s): {tally}.", ""]
    if environment:
        lines += [f"Measured on: {environment_line(environment)}.", ""]
    if drift:
        lines += ["### Environment differs from the baselines (numbers may move)", ""]
        lines += [f"- {_code(path)}: {'; '.join(differences)}" for path, differences in sorted(drift.items())]
        lines.append("")
    for nodeid, entry in tests.items():
        plot = (plots or {}).get(nodeid)
        lines += section_lines(nodeid, entry, baselines.get(nodeid), rules=rules, metrics=metrics, plot=plot)
    if stale:
        lines += [f"### Stale baselines: {len(stale)} file(s) no test used", ""]
        lines += [f"- {_code(path)}" for path in stale]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def environment_line(environment: Mapping[str, Any]) -> str:
    """One line of what a session ran on: versions, device, ISA, GPU stack, commit and date."""
    commit = environment.get("commit")
    parts = [
        f"pytest-precision {environment.get('pytest_precision')}",
        f"torch {environment.get('torch')}",
        str(environment.get("device")),
        f"CPU ISA {environment.get('cpu_capability')}",
    ]
    if environment.get("cuda"):
        parts.append(f"CUDA {environment['cuda']}, cuDNN {environment.get('cudnn')}")
    if commit:
        parts.append(f"commit {str(commit)[:12]}{' (dirty)' if environment.get('dirty') else ''}")
    if environment.get("date"):
        parts.append(str(environment["date"]))
    return ", ".join(parts)


def write_summary(directory: Path, text: str) -> Path:
    """Write DIR/summary.md atomically and append `text` to $GITHUB_STEP_SUMMARY when that is set.

    An OSError names the file; one from $GITHUB_STEP_SUMMARY says so (summary.md is written by then)."""
    path = Path(directory) / SUMMARY_FILE
    if not text.endswith("\n"):
        text += "\n"
    write_atomically(path, text)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        try:
            with open(step_summary, "a", encoding="utf-8") as handle:
                handle.write(text + "\n")
        except OSError as error:
            raise OSError(
                error.errno, f"cannot append the summary to GITHUB_STEP_SUMMARY ({error.strerror})", step_summary
            ) from None
    return path


__all__ = ["markdown_summary", "markdown_table", "report_from_entry", "write_summary"]
