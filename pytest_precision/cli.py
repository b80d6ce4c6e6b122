"""`pytest-precision`: show and diff baseline files, or measure a local checkpoint without writing a test.

pytest-precision show baselines/tests/test_llama/test_bf16.cpu.json --kind fw
pytest-precision diff old.json new.json --rtol 0.1
pytest-precision diff --against main baselines
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

from .baseline_diff import Row as Row
from .baseline_diff import diff_rows as diff_rows
from .baseline_diff import lost_checks as lost_checks
from .errors import PrecisionError
from .report import KINDS
from .report_files import reports_in

if TYPE_CHECKING:
    from .tolerance import Level

EPILOG = """examples:
  pytest-precision show baselines/tests/test_llama/test_bf16.cpu.json
      the error-propagation tables of a baseline (or of a --precision-report session report)
  pytest-precision diff old.json new.json
      what a pull request that changes baselines changes: largest changes first; exit 1 when worse
      or when a variant, a tensor or a defined metric of old.json is gone
  pytest-precision diff --against main [baselines]
      every baseline committed on main against the working tree's, one section per test and a summary;
      exit 1 also when a baseline of main is gone (a dropped gate); added baselines pass
  pytest-precision diff old_baselines/ baselines/
      the same for two folders, paired by path
  pytest-precision run ./my-checkpoint --variants bf16,fp16 --text prompt.txt
      load a local transformers checkpoint (no hub access) and print its tables
"""

DIFF_DESCRIPTION = """Per variant and tensor: old, new and ratio for the gated metrics, largest changes first.

Exit code 1 when NEW is worse than OLD: a metric worse beyond --rtol/--atol, a variant, tensor or
test of OLD missing from NEW, a metric that was a number and is undefined (null/NaN) in NEW, or more
non-finite values. Exit code 2 when a file cannot be read or no test pairs up.

OLD NEW, two files: they pair by test id; one baseline against a session report compares that test
only. Example: git show main:baselines/x.json > old.json; pytest-precision diff old.json baselines/x.json

OLD NEW, two folders: their baselines (<stem>.<device>.json files the plugin wrote; other JSON is
ignored and counted) pair by path, one section per test, then a summary line. A baseline only in NEW
is added (passes); one only in OLD is removed and fails: a baseline that disappeared is a gate that
was dropped.

--against REF [PATH]: the baselines committed at git ref REF (a branch, tag or commit) under PATH
(default baselines, relative to the current directory) against the working tree's, committed or not,
as two folders; PATH may also be one baseline file. What a pull request changes, before pushing it:
  pytest-precision diff --against main
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


def _diff(arguments: argparse.Namespace) -> int:
    from .baseline_diff import DiffOptions, diff_against, diff_files, diff_trees, folder_side
    from .metrics import METRIC_DIRECTIONS
    from .tolerance import ToleranceRules, base_of_levels

    metrics = arguments.metric or ["rms_rel"]
    unknown = [m for m in metrics if m not in METRIC_DIRECTIONS]
    if unknown:
        raise PrecisionError(
            f"--metric: unknown metric(s) {', '.join(unknown)}; choose from {', '.join(METRIC_DIRECTIONS)}"
        )
    base, per_metric = base_of_levels(arguments.rtol or (None, {}), arguments.atol or (None, {}))
    options = DiffOptions(metrics, ToleranceRules(base=base, base_metrics=per_metric), arguments.limit)
    if arguments.against is not None:
        if arguments.new is not None:
            raise PrecisionError(
                f"--against {arguments.against} compares the working tree's PATH with that ref: give one PATH "
                f"(default baselines), not OLD and NEW ({arguments.old} {arguments.new})"
            )
        return diff_against(arguments.against, Path(arguments.old or "baselines"), options)
    if arguments.new is None:
        raise PrecisionError(
            "give OLD and NEW (two baseline files, or two folders of baselines), or --against REF [PATH] to "
            "compare the baselines committed at a git ref with the working tree's"
        )
    old, new = Path(arguments.old), Path(arguments.new)
    if old.is_dir() and new.is_dir():
        return diff_trees(folder_side(old, arguments.old), folder_side(new, arguments.new), options)
    if old.is_dir() or new.is_dir():
        folder, other = (arguments.old, arguments.new) if old.is_dir() else (arguments.new, arguments.old)
        raise PrecisionError(
            f"{folder} is a folder and {other} is not: give two baseline files, or two folders of baselines"
        )
    return diff_files(old, new, options)


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


def _tolerance(text: str) -> Level:
    """argparse type of --rtol/--atol: a finite number >= 0, METRIC=NUMBER entries, or both ("0.1 max_rel=0.5")."""
    from .tolerance import parsed_level

    try:
        level = parsed_level(text, "tolerance")
    except PrecisionError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("tolerance: ")) from None
    if not all(math.isfinite(value) for value in [*level[1].values(), *([] if level[0] is None else [level[0]])]):
        raise argparse.ArgumentTypeError(f"{text!r} must be finite numbers >= 0")
    return level


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
        help="compare two baseline files, two folders, or the baselines committed at a git ref (exit 1 when "
        "something got worse or is no longer checked)",
        usage="pytest-precision diff OLD NEW [options]\n       pytest-precision diff --against REF [PATH] [options]",
        description=DIFF_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("old", nargs="?", metavar="OLD", help="baseline file or folder (with --against: PATH)")
    diff.add_argument("new", nargs="?", metavar="NEW", help="baseline file or folder")
    diff.add_argument(
        "--against",
        metavar="REF",
        help="a git branch, tag or commit: compare its committed baselines under PATH with the working tree's",
    )
    diff.add_argument(
        "--rtol",
        type=_tolerance,
        metavar="RTOL",
        help="relative tolerance (default 0.10); per metric as METRIC=RTOL, e.g. '0.1 max_rel=0.5'",
    )
    diff.add_argument(
        "--atol", type=_tolerance, metavar="ATOL", help="absolute tolerance (default 1e-5); per metric as METRIC=ATOL"
    )
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
