"""Failure and summary text: headline with counts, a capped table in execution order, then the fix."""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from pytest_precision.base.records import KINDS, Record
from pytest_precision.gate.drift import DriftAllowance
from pytest_precision.gate.tolerance import Violation, format_value
from pytest_precision.reports.tables import render

#: Rows shown before "... N more", shared between the failing variants.
MAX_ROWS = 20
#: Each failing variant shows at least this many rows, however many variants fail.
MIN_ROWS_PER_VARIANT = 3
#: Where every row and the error-vs-depth plot are, when the table had to leave rows out (the plugin names the
#: files of its session instead: see full_list_hint).
FULL_LIST_HINT = "every record and an error-vs-depth plot: rerun with --precision-report DIR"


def full_list_hint(report_dir: Path | None, baseline: Path | None, rows: int, plot: Path | None) -> str:
    """Where the rows a failure table leaves out are. Against a baseline: `pytest-precision diff` of the baseline
    and the session report lists every (tensor, metric) row, `rows` of them; limits have no baseline: the
    session report holds every record. `plot`: the test's error-vs-depth plot (None without matplotlib)."""
    report = "DIR/precision-report.json" if report_dir is None else f"{report_dir / 'precision-report.json'}"
    if baseline is None:
        where = f"every record in {report}"
    else:
        where = f"all rows: pytest-precision diff {baseline} {report} --limit {rows}"
    if report_dir is None:
        return f"{where}, after a rerun with --precision-report DIR, which also plots error against depth"
    shown_plot = "" if plot is None else f"; the plot: {plot}"
    return f"{where}, once the session has ended{shown_plot}"


# Execution order: forward rows in forward order, then backward rows in backward order, then gradients,
# so that the first row is where precision was first lost.
#: The kinds in their display and gate order (records.KINDS), whole-variant rows ("*") last.
_KIND_ORDER = {**{kind: rank for rank, kind in enumerate(KINDS)}, "*": len(KINDS)}

REFRESH_TEMPLATE = "pytest {nodeid} {flag}"
#: A metric without a value, in tables.
UNDEFINED = "undefined"
#: Why a metric can be undefined in a run, for messages.
UNDEFINED_CAUSES = (
    "nothing was compared (the reference is not finite, every label is -100, the mask removes every position) "
    "or the variant's output is constant or all zeros"
)


def refresh_command(nodeid: str) -> str:
    """The command that refreshes one test's baseline, with the update flag this session answers to."""
    from pytest_precision.plugin.options import UPDATE_FLAGS

    return REFRESH_TEMPLATE.format(nodeid=shlex.quote(nodeid), flag=UPDATE_FLAGS[-1])


def execution_order(violations: Sequence[Violation], order: dict[tuple[str, str, str], int]) -> list[Violation]:
    """Sort by variant run order, then kind group, then capture order within the kind."""
    variants = list(dict.fromkeys(v.variant for v in violations))
    return sorted(
        violations,
        key=lambda v: (
            variants.index(v.variant),
            _KIND_ORDER.get(v.kind, len(KINDS) + 1),
            order.get((v.variant, v.name, v.kind), math.inf),
        ),
    )


def _ratio(violation: Violation) -> str:
    ratio = violation.ratio
    if ratio is None:
        return "-"
    return "inf" if math.isinf(ratio) else f"{ratio:.2f}x"


def _row(v: Violation) -> list[str]:
    if v.reason in ("missing", "new"):
        what = "variant" if v.name == "*" else "tensor"
        side = "not in this run" if v.reason == "missing" else "not in the baseline"
        return [v.variant, v.name, v.kind, f"{v.reason} {what}", side, "", "", ""]
    if v.reason == "limit":
        obtained = UNDEFINED if v.obtained is None else format_value(v.metric, v.obtained)
        return [v.variant, v.name, v.kind, v.metric, "(limit)", obtained, "", format_value(v.metric, v.allowed)]
    if v.reason == "undefined":
        expected = UNDEFINED if v.expected is None else format_value(v.metric, v.expected)
        obtained = UNDEFINED if v.obtained is None else format_value(v.metric, v.obtained)
        return [v.variant, v.name, v.kind, v.metric, expected, obtained, "", ""]
    expected, obtained, allowed = (format_value(v.metric, x) for x in (v.expected, v.obtained, v.allowed))
    return [v.variant, v.name, v.kind, v.metric, expected, obtained, _ratio(v), allowed]


def row_shares(sizes: Sequence[int], budget: int) -> list[int]:
    """How many rows of each group to show within `budget`: one row to each group in turn while it has rows
    left, so that every group shows its first rows and none takes the whole table."""
    shares = [0] * len(sizes)
    while budget > 0 and any(share < size for share, size in zip(shares, sizes, strict=True)):
        for i, size in enumerate(sizes):
            if budget > 0 and shares[i] < size:
                shares[i] += 1
                budget -= 1
    return shares


def violation_table(violations: Sequence[Violation], *, full_list: str = FULL_LIST_HINT) -> list[str]:
    """The violations (in execution order) as a table of at most max(MAX_ROWS, MIN_ROWS_PER_VARIANT x
    variants) rows: each variant's first rows, followed by "... N more <variant>" when some were left out, and
    then `full_list`, where to find them all."""
    header = ["variant", "tensor", "kind", "metric", "baseline", "obtained", "ratio", "allowed"]
    groups: dict[str, list[Violation]] = {}
    for v in violations:
        groups.setdefault(v.variant, []).append(v)
    budget = max(MAX_ROWS, MIN_ROWS_PER_VARIANT * len(groups))
    shares = row_shares([len(group) for group in groups.values()], budget)
    shown = [(group[:share], len(group) - share) for group, share in zip(groups.values(), shares, strict=True)]
    rendered = render(header, [_row(v) for rows, _ in shown for v in rows], left=4)
    lines, position = rendered[:1], 1
    for rows, left_out in shown:
        lines += rendered[position : position + len(rows)]
        position += len(rows)
        if left_out:
            lines.append(f"  ... {left_out} more {rows[0].variant} row(s)")
    if any(left_out for _, left_out in shown):
        lines.append(f"  ({sum(left_out for _, left_out in shown)} row(s) not shown; {full_list})")
    return lines


def drift_note(differences: Sequence[str], allowance: DriftAllowance | None) -> str:
    """The lines a regression message ends with when the environment differs from the baseline's: what differs,
    and the drift rule that widened the tolerances, or how to set one ("" when nothing differs)."""
    if not differences and allowance is None:
        return ""
    lines = []
    if differences:
        lines.append(f"The environment differs from the baseline's (numbers may move): {'; '.join(differences)}.")
    if allowance is not None:
        lines.append(f"Environment drift: {allowance.describe()}, and the error still exceeds them.")
    else:
        lines.append(
            "If the difference explains it, an environment-drift rule allows for it while it lasts (ini "
            'precision_drift_rtol = "torch=2.0"), or refresh the baseline in this environment.'
        )
    return "\n" + "\n".join(lines)


def regression_message(
    violations: Sequence[Violation],
    gated: int,
    path: Path,
    nodeid: str,
    order: dict[tuple[str, str, str], int],
    nonfinite_origin: Mapping[str, str] | None = None,
    *,
    full_list: str = FULL_LIST_HINT,
) -> str:
    ordered = execution_order(violations, order)
    first = ordered[0]
    if first.name == "*":
        state = "new (not in the baseline)" if first.reason == "new" else "missing from this run"
        where = f"variant {first.variant} is {state}"
    else:
        where = f"{first.variant} {first.name} ({first.kind})"
    lines = [f"precision regressed: {regression_counts(ordered, gated)}; first: {where}"]
    nonfinite = [v for v in ordered if v.reason == "nonfinite"]
    if nonfinite:
        lines.append(
            "non-finite values (NaN/Inf) where the baseline had none: "
            + ", ".join(f"{v.variant} {v.name} ({v.kind})" for v in nonfinite[:5])
        )
        for variant, origin in sorted((nonfinite_origin or {}).items()):
            lines.append(f"  {variant}: first non-finite output from finite inputs in {origin}")
    lines += _undefined_lines(ordered)
    lines += [
        *violation_table(ordered, full_list=full_list),
        f"Baseline: {path}",
        f"If the change is intended, refresh it: {refresh_command(nodeid)}",
    ]
    return "\n".join(lines)


def regression_counts(violations: Sequence[Violation], gated: int) -> str:
    """ "F / G tensors (P%) in V variant(s)": F of the G tensors that are in both the baseline and the run failed
    (a part of a whole, never above 100%), then what is in only one of them, counted apart (", and 12 tensor(s)
    and 1 variant(s) missing from this run, 1 tensor(s) new (not in the baseline)")."""
    failed = {(v.variant, v.name, v.kind) for v in violations if v.reason not in ("missing", "new")}
    variants = len({v.variant for v in violations})
    if gated:
        compared = f"{len(failed)} / {gated} tensors ({100.0 * len(failed) / gated:.1f}%)"
    else:
        compared = "no tensor in both the baseline and this run"
    apart = []
    for reason, side in (("missing", "missing from this run"), ("new", "new (not in the baseline)")):
        counts = []
        for what, whole in (("tensor", False), ("variant", True)):
            rows = {(v.variant, v.name, v.kind) for v in violations if v.reason == reason and (v.name == "*") == whole}
            if rows:
                counts.append(f"{len(rows)} {what}(s)")
        if counts:
            apart.append(f"{' and '.join(counts)} {side}")
    return f"{compared} in {variants} variant(s)" + (f", and {', '.join(apart)}" if apart else "")


def _undefined_lines(violations: Sequence[Violation]) -> list[str]:
    """Why metrics without a value fail: undefined in this run, or in the baseline (then refresh it)."""
    in_run = [v for v in violations if v.reason == "undefined" and v.obtained is None]
    in_baseline = [v for v in violations if v.reason == "undefined" and v.obtained is not None]
    lines = []
    if in_run:
        lines.append(
            "undefined in this run, nothing to hold against the baseline: "
            + ", ".join(f"{v.variant} {v.name} ({v.kind}) {v.metric}" for v in in_run[:5])
            + f" ({UNDEFINED_CAUSES})"
        )
    if in_baseline:
        lines.append(
            "undefined in the baseline but defined in this run (refresh the baseline if the change is intended): "
            + ", ".join(f"{v.variant} {v.name} ({v.kind}) {v.metric}" for v in in_baseline[:5])
        )
    return lines


def improvement_message(
    improvements: Sequence[Violation],
    path: Path,
    nodeid: str,
    order: dict[tuple[str, str, str], int],
    *,
    full_list: str = FULL_LIST_HINT,
) -> str:
    """--precision-strict: an improvement beyond tolerance fails until the baseline is tightened."""
    ordered = execution_order(improvements, order)
    tensors = {(v.variant, v.name, v.kind) for v in ordered}
    return "\n".join(
        [
            f"precision improved beyond tolerance in {len(tensors)} tensor(s) (--precision-strict): "
            "tighten the baseline",
            *violation_table(ordered, full_list=full_list),
            f"Baseline: {path}",
            f"Tighten it with: {refresh_command(nodeid)}",
        ]
    )


def limit_message(
    violations: Sequence[Violation], order: dict[tuple[str, str, str], int], *, full_list: str = FULL_LIST_HINT
) -> str:
    ordered = execution_order(violations, order)
    return "\n".join(
        [
            f"precision limits exceeded by {len(ordered)} tensor metric(s) (limits hold without a baseline)",
            *violation_table(ordered, full_list=full_list),
        ]
    )


def nonfinite_message(rows: Sequence[tuple[str, Record]], path: Path) -> str:
    """Refusal to write a baseline holding NaN/Inf: that would make a broken variant the expectation."""
    shown = [f"  {variant}  {r.name} ({r.kind}): {r.nonfinite} of {math.prod(r.shape)} values" for variant, r in rows]
    if len(shown) > MAX_ROWS:
        shown = [*shown[:MAX_ROWS], f"  ... {len(shown) - MAX_ROWS} more"]
    return "\n".join(
        [
            f"not writing {path}: {len(rows)} tensor(s) hold NaN/Inf where the reference is finite "
            "(first in execution order first):",
            *shown,
            "Fix the variant (fp16 overflow? missing loss scaling?) or leave it out of variants=, then update again.",
        ]
    )


def undefined_message(rows: Sequence[tuple[str, Record, Sequence[str]]], path: Path) -> str:
    """Refusal to write a baseline whose gated metrics are undefined: it would gate nothing there."""
    shown = [
        f"  {variant}  {r.name} ({r.kind}): {', '.join(metrics)} undefined ({r.count} of {math.prod(r.shape)} "
        "values compared)"
        for variant, r, metrics in rows
    ]
    if len(shown) > MAX_ROWS:
        shown = [*shown[:MAX_ROWS], f"  ... {len(shown) - MAX_ROWS} more"]
    return "\n".join(
        [
            f"not writing {path}: {len(rows)} gated tensor(s) have nothing to compare, a metric without a value "
            "(first in execution order first):",
            *shown,
            f"Likely: {UNDEFINED_CAUSES}.",
            "Fix the inputs or the variant, or leave the tensor out (modules=) or the metric out (metrics=), then "
            "update again.",
        ]
    )


def missing_baseline_message(path: Path, nodeid: str) -> str:
    return "\n".join(
        [
            f"no precision baseline for {nodeid}",
            f"expected: {path}",
            f"Create it with: {refresh_command(nodeid)}   (then review and commit it)",
        ]
    )
