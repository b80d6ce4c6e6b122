"""`pytest-precision`: show and diff baseline files, or measure a local checkpoint without writing a test.

pytest-precision show baselines/tests/test_llama/test_bf16.cpu.json --kind fw
pytest-precision diff old.json new.json --rtol 0.1
pytest-precision run path/to/checkpoint --variants bf16,fp16 --length 256 --text prompt.txt
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import PrecisionError
from .report import KINDS
from .report_files import reports_in

if TYPE_CHECKING:
    from .report import PrecisionReport
    from .tolerance import Tolerance

EPILOG = """examples:
  pytest-precision show baselines/tests/test_llama/test_bf16.cpu.json
      the error-propagation tables of a baseline (or of a --precision-report session report)
  pytest-precision diff old.json new.json
      what a pull request that changes baselines changes: largest changes first; exit 1 when worse
      or when a variant, a tensor or a defined metric of old.json is gone
  pytest-precision run ./my-checkpoint --variants bf16,fp16 --text prompt.txt
      load a local transformers checkpoint (no hub access) and print its tables
"""


def _show(arguments: argparse.Namespace) -> int:
    from .report import PrecisionReport
    from .tables import format_report

    path = Path(arguments.file)
    for label, report in reports_in(path).items():
        if arguments.variant:
            if arguments.variant not in report.variants:
                raise PrecisionError(
                    f"{arguments.file}: no variant {arguments.variant!r}; variants: {', '.join(report.variants)}"
                )
            kept = PrecisionReport(reference=report.reference, device=report.device)
            kept.add(arguments.variant, report.runs[arguments.variant], report.records(arguments.variant), [])
            report = kept
        if arguments.kind:
            filtered = PrecisionReport(reference=report.reference, device=report.device)
            for variant in report.variants:
                filtered.add(variant, report.runs[variant], report.records(variant, arguments.kind), [])
            report = filtered
        try:
            text = format_report(report, full=not arguments.summary)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            # reports_in checks the records; a run block of the wrong shape shows up only here.
            raise PrecisionError(
                f"{path}: test {label} cannot be shown, its run information is malformed ({error})"
            ) from None
        print(f"== {label}")
        print(text)
        print()
    return 0


Row = tuple[str, str, str, str, float | None, float | None, float | None]


def _undefined(value: float | None) -> bool:
    return value is None or math.isnan(value)


def diff_rows(old: PrecisionReport, new: PrecisionReport, metrics: Sequence[str]) -> list[Row]:
    """(variant, tensor, kind, metric, old, new, new/old) for tensors in both, largest change first."""
    rows = []
    for variant in new.variants:
        if variant not in old.variants:
            continue
        before = {(r.name, r.kind): r for r in old.records(variant)}
        for record in new.records(variant):
            previous = before.get((record.name, record.kind))
            if previous is None:
                continue
            for metric in metrics:
                a, b = previous.metric(metric), record.metric(metric)
                ratio = None if a is None or b is None or a == 0 or math.isnan(a) or math.isnan(b) else b / a
                rows.append((variant, record.name, record.kind, metric, a, b, ratio))

    def change(row: Row) -> float:
        ratio = row[6]
        if ratio is None or ratio <= 0 or not math.isfinite(ratio):
            return 0.0 if row[4] == row[5] or (_undefined(row[4]) and _undefined(row[5])) else math.inf
        return abs(math.log(ratio))

    return sorted(rows, key=change, reverse=True)


def _worse(row: Row, tolerance: Tolerance) -> bool:
    """Whether a row's metric is a number in both and got worse beyond the tolerance."""
    from .tolerance import is_worse

    metric, before, after = row[3], row[4], row[5]
    if before is None or after is None or math.isnan(before) or math.isnan(after):
        return False
    return is_worse(metric, before, after, tolerance)


def lost_checks(old: PrecisionReport, new: PrecisionReport, metrics: Sequence[str]) -> list[str]:
    """What `new` no longer checks or newly breaks, one line each: a variant or tensor it dropped, a metric
    that was a number and became undefined (null/NaN), more non-finite values than before."""
    lines = [f"dropped variant {variant}" for variant in old.variants if variant not in new.variants]
    for variant in old.variants:
        if variant not in new.variants:
            continue
        after = {(r.name, r.kind): r for r in new.records(variant)}
        for previous in old.records(variant):
            tensor = f"{variant} {previous.name} ({previous.kind})"
            record = after.get((previous.name, previous.kind))
            if record is None:
                lines.append(f"dropped tensor {tensor}")
                continue
            for metric in metrics:
                if not _undefined(previous.metric(metric)) and _undefined(record.metric(metric)):
                    lines.append(f"{tensor}: {metric} became undefined")
            if record.nonfinite > previous.nonfinite:
                lines.append(f"{tensor}: nonfinite {previous.nonfinite} -> {record.nonfinite}")
    return lines


def _pairs(old_path: Path, new_path: Path) -> list[tuple[str, PrecisionReport | None, PrecisionReport | None]]:
    """(label, old report, new report) per test, paired by test id (None: not in that file); the only test of
    each file pair up whatever their ids. A single test against several pairs with its own id, or refuses."""
    old_reports, new_reports = reports_in(old_path), reports_in(new_path)
    for path, reports in ((old_path, old_reports), (new_path, new_reports)):
        if not reports:
            raise PrecisionError(f"{path} holds no precision results (a session report without tests?)")
    if len(old_reports) == 1 and len(new_reports) == 1:
        (label, new), old = next(iter(new_reports.items())), next(iter(old_reports.values()))
        return [(label, old, new)]
    shared = set(old_reports) & set(new_reports)
    if not shared:
        raise PrecisionError(
            f"no test is in both {old_path} ({', '.join(sorted(old_reports)[:3])}"
            f"{', ...' if len(old_reports) > 3 else ''}) and {new_path} ({', '.join(sorted(new_reports)[:3])}"
            f"{', ...' if len(new_reports) > 3 else ''}); diff the baseline of a test against a session report "
            "holding that test id, or two files of the same tests"
        )
    if len(old_reports) == 1 or len(new_reports) == 1:
        # One test against a session report: only that test is compared.
        return [(label, old_reports[label], new_reports[label]) for label in sorted(shared)]
    return [(label, old_reports.get(label), new) for label, new in new_reports.items()] + [
        (label, old, None) for label, old in old_reports.items() if label not in new_reports
    ]


def _diff(arguments: argparse.Namespace) -> int:
    from .messages import format_number
    from .metrics import METRIC_DIRECTIONS
    from .tables import render
    from .tolerance import Tolerance

    metrics = arguments.metric or ["rms_rel"]
    unknown = [m for m in metrics if m not in METRIC_DIRECTIONS]
    if unknown:
        raise PrecisionError(
            f"--metric: unknown metric(s) {', '.join(unknown)}; choose from {', '.join(METRIC_DIRECTIONS)}"
        )
    tolerance = Tolerance(rtol=arguments.rtol, atol=arguments.atol)
    failed = 0
    for label, old, new in _pairs(Path(arguments.old), Path(arguments.new)):
        if old is None:
            print(f"== {label}: not in {arguments.old} (a new test)")
            continue
        if new is None:
            print(f"== {label}: dropped, in {arguments.old} but not in {arguments.new}")
            failed += 1
            continue
        rows = diff_rows(old, new, metrics)
        got_worse = {row for row in rows if _worse(row, tolerance)}
        lost = lost_checks(old, new, metrics)
        failed += len(got_worse) + len(lost)
        lost_note = f"; {len(lost)} check{'s' if len(lost) > 1 else ''} lost or newly non-finite" if lost else ""
        print(
            f"== {label}: {len(got_worse)} of {len(rows)} tensor metrics worse beyond rtol {arguments.rtol}{lost_note}"
        )
        for line in lost:
            print(f"  {line}")
        only_new = [v for v in new.variants if v not in old.variants]
        if only_new:
            print(f"  variants only in new: {', '.join(only_new)}")
        shown = rows[: arguments.limit]
        table = [
            [
                *row[:4],
                format_number(row[4]),
                format_number(row[5]),
                "-" if row[6] is None else f"{row[6]:.3g}x",
                "WORSE" if row in got_worse else "UNDEFINED" if _undefined(row[5]) and not _undefined(row[4]) else "",
            ]
            for row in shown
        ]
        for line in render(["variant", "tensor", "kind", "metric", "old", "new", "ratio", ""], table, left=4):
            print(line)
        if len(rows) > len(shown):
            print(f"  ... {len(rows) - len(shown)} more (--limit)")
    return 1 if failed else 0


def _run(arguments: argparse.Namespace) -> int:
    from .checkpoint import measure_checkpoint

    report = measure_checkpoint(
        Path(arguments.model_dir),
        variants=arguments.variants,
        length=arguments.length,
        batch=arguments.batch,
        text_file=arguments.text,
        seed=arguments.seed,
        device=arguments.device,
        backward=not arguments.forward_only,
        isolate=arguments.isolate,
    )
    print(report.format(full=arguments.full))
    return 0


def _tolerance(text: str) -> float:
    """argparse type of --rtol/--atol: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _positive(text: str) -> int:
    """argparse type of --limit: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pytest-precision",
        description="Show and diff pytest-precision baselines, or measure a local checkpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser(
        "show",
        help="print the tables of a baseline file or a session report",
        description="Print the error-propagation tables of a baseline file or of a --precision-report session "
        "report, the same tables the plugin prints. Example: pytest-precision show baselines/x/test.cpu.json",
    )
    show.add_argument("file")
    show.add_argument("--variant", help="only this variant")
    show.add_argument("--kind", choices=list(KINDS), help="only tensors of this kind")
    show.add_argument("--summary", action="store_true", help="only the summary tables, not every tensor")
    show.set_defaults(handler=_show)

    diff = commands.add_parser(
        "diff",
        help="compare two baseline files (exit 1 when something got worse or is no longer checked)",
        description="Per variant and tensor: old, new and ratio for the gated metrics, largest changes first. "
        "Exit code 1 when NEW is worse than OLD: a metric worse beyond --rtol/--atol, a variant, tensor or test of "
        "OLD missing from NEW, a metric that was a number and is undefined (null/NaN) in NEW, or more non-finite "
        "values; exit code 2 when a file cannot be read or no test pairs up. Files pair by test id; one baseline "
        "against a session report compares that test only. Example: git show main:baselines/x.json > old.json; "
        "pytest-precision diff old.json baselines/x.json",
    )
    diff.add_argument("old")
    diff.add_argument("new")
    diff.add_argument("--rtol", type=_tolerance, default=0.10, help="relative tolerance (default 0.10)")
    diff.add_argument("--atol", type=_tolerance, default=1e-5, help="absolute tolerance (default 1e-5)")
    diff.add_argument("--metric", action="append", help="metric to compare (repeatable; default rms_rel)")
    diff.add_argument("--limit", type=_positive, default=30, help="rows shown per test (default 30)")
    diff.set_defaults(handler=_diff)

    run = commands.add_parser(
        "run",
        help="measure a local transformers checkpoint and print its tables",
        description="Load a local transformers causal LM (no hub access), run the fp32 reference and each variant, "
        "and print the tables. Never executes code from the checkpoint: trust_remote_code=False, no prompt, and a "
        "config.json naming custom code (auto_map) is refused. "
        "Example: pytest-precision run ./ckpt --variants bf16,fp16 --text prompt.txt",
    )
    run.add_argument("model_dir")
    run.add_argument("--variants", default="bf16,fp16", help="comma-separated variant names (default bf16,fp16)")
    run.add_argument("--length", type=int, default=128, help="tokens per sequence, at least 2 (default 128)")
    run.add_argument("--batch", type=int, default=2, help="sequences, at least 1 (default 2)")
    run.add_argument("--text", help="a text file to tokenize (repeated to length); default: random tokens")
    run.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    run.add_argument("--device", default="cpu")
    run.add_argument("--forward-only", action="store_true", help="no backward pass")
    run.add_argument("--isolate", action="store_true", help="also each module's isolated error (its own share)")
    run.add_argument("--full", action="store_true", help="also print every tensor's row")
    run.set_defaults(handler=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        code = int(arguments.handler(arguments))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except PrecisionError as error:
        print(f"pytest-precision {arguments.command}: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`pytest-precision show x.json | head`): stop quietly. Point stdout at devnull so
        # the interpreter's final flush does not fail again (the recipe of Python's signal module docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # what a process killed by SIGPIPE reports


if __name__ == "__main__":
    sys.exit(main())
