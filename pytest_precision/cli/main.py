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

from pytest_precision.base.errors import PrecisionError
from pytest_precision.base.records import KINDS
from pytest_precision.base.torchao_notices import quiet_torchao_notices
from pytest_precision.gate.baseline_diff import Row as Row
from pytest_precision.gate.baseline_diff import diff_rows as diff_rows
from pytest_precision.gate.baseline_diff import lost_checks as lost_checks
from pytest_precision.gate.report_files import reports_in

if TYPE_CHECKING:
    from pytest_precision.gate.diff_gate import DiffOptions
    from pytest_precision.gate.tolerance import Level

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

RUN_DESCRIPTION = """Load a local transformers causal LM (no hub access), run the fp32 reference and each variant,
and print the error-propagation tables. Progress goes to stderr (a live bar on a terminal, plain lines
otherwise; --quiet silences it). Never executes code from the checkpoint: trust_remote_code=False, no
prompt, and a config.json naming custom code (auto_map) is refused.

Reusing the reference: on a big model the fp32 reference is the most expensive run (fp32 weights, every
activation and gradient kept). --save-reference PATH writes it once; later runs with --reference PATH run
only the variants you add, on the same tokens. The file records a digest of the checkpoint's weights and
of the inputs: a reference of other weights, or other inputs, is refused instead of measured against.

examples:
  pytest-precision run ./ckpt --text prompt.txt --output-dir runs/first --save-reference ref.safetensors
  pytest-precision run ./ckpt --reference ref.safetensors --variants bf16_fp32_head,bf16_sdpa
  pytest-precision run ./ckpt --variants-file variants.json --variants bf16 --tokens 1024
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

What is gated: by default the project's own gate. --metric, --rtol and --atol, each on its own; else,
for a test of a session report that recorded its gate, that gate (what the test checked, its call's
metrics= included); else what the project's pytest resolves: diff runs `python -m pytest
--precision-resolved-gate FILE [-c FILE] [--rootdir DIR] [-o NAME=VALUE] PATHS` in the current folder,
and pytest reads its config file for these paths (pytest.ini, pyproject.toml, tox.ini, setup.cfg, and
pytest 9's pytest.toml and [tool.pytest], as the installed pytest reads them), addopts and
PYTEST_ADDOPTS, then stops before collecting; else rms_rel, rtol 0.1, atol 1e-5. Where pytest refuses
the configuration, diff exits 2 with pytest's message. That run imports the conftest.py files and
plugins a test run would: with --metric, --rtol and --atol all given, pytest is not asked. The last
line of the output says what was gated, where each part came from, and which config file pytest read.
"""


def _show(arguments: argparse.Namespace) -> int:
    from pytest_precision.reports.report import PrecisionReport
    from pytest_precision.reports.tables import format_report

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
    from pytest_precision.gate.baseline_diff import diff_against, diff_files, diff_trees, folder_side
    from pytest_precision.gate.diff_gate import gate_options

    def options(*paths: Path) -> DiffOptions:
        """The gate: the command line's, else the pytest config file's for `paths`, else built-in."""
        return gate_options(
            paths, arguments.metric, arguments.rtol, arguments.atol, arguments.limit, _pytest_args(arguments)
        )

    if arguments.against is not None:
        if arguments.new is not None:
            raise PrecisionError(
                f"--against {arguments.against} compares the working tree's PATH with that ref: give one PATH "
                f"(default baselines), not OLD and NEW ({arguments.old} {arguments.new})"
            )
        path = Path(arguments.old or "baselines")
        chosen = options(path)
        code = diff_against(arguments.against, path, chosen)
    elif arguments.new is None:
        raise PrecisionError(
            "give OLD and NEW (two baseline files, or two folders of baselines), or --against REF [PATH] to "
            "compare the baselines committed at a git ref with the working tree's"
        )
    else:
        old, new = Path(arguments.old), Path(arguments.new)
        if old.is_dir() != new.is_dir():
            folder, other = (arguments.old, arguments.new) if old.is_dir() else (arguments.new, arguments.old)
            raise PrecisionError(
                f"{folder} is a folder and {other} is not: give two baseline files, or two folders of baselines"
            )
        chosen = options(old, new)
        if old.is_dir():
            code = diff_trees(folder_side(old, arguments.old), folder_side(new, arguments.new), chosen)
        else:
            code = diff_files(old, new, chosen)
    print(chosen.gate_line())
    return code


def _pytest_args(arguments: argparse.Namespace) -> list[str]:
    """diff's -c, --rootdir and -o, as pytest takes them (in the long form with "=": a value may start with -)."""
    given = [("--config-file", arguments.config_file), ("--rootdir", arguments.rootdir)]
    return [f"{flag}={value}" for flag, value in given if value is not None] + [
        f"--override-ini={value}" for value in arguments.override_ini or []
    ]


def _run(arguments: argparse.Namespace) -> int:
    from pytest_precision.cli.run import RunOptions, interrupted_message, run_checkpoint, written_files

    def path(value: str | None) -> Path | None:
        return None if value is None else Path(value)

    options = RunOptions(
        directory=Path(arguments.model_dir),
        variants=arguments.variants,
        variants_file=path(arguments.variants_file),
        length=arguments.length,
        batch=arguments.batch,
        tokens=arguments.tokens,
        text=arguments.text,
        seed=arguments.seed,
        device=arguments.device,
        forward_only=arguments.forward_only,
        isolate=arguments.isolate,
        modules=None if arguments.modules is None else tuple(arguments.modules),
        temperature=arguments.temperature,
        loss_scale=arguments.loss_scale,
        output_dir=path(arguments.output_dir),
        overwrite=arguments.overwrite,
        save_reference=path(arguments.save_reference),
        reference=path(arguments.reference),
        quiet=arguments.quiet,
        full=arguments.full,
    )
    before = written_files(options)
    try:
        run_checkpoint(options)
    except KeyboardInterrupt:  # Ctrl-C: one line saying what was (not) written, not a traceback
        raise KeyboardInterrupt(interrupted_message(options, before)) from None
    return 0


def _tolerance(text: str) -> Level:
    """argparse type of --rtol/--atol: a finite number >= 0, METRIC=NUMBER entries, or both ("0.1 max_rel=0.5")."""
    from pytest_precision.gate.tolerance import parsed_level

    try:
        level = parsed_level(text, "tolerance")
    except PrecisionError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("tolerance: ")) from None
    if not all(math.isfinite(value) for value in [*level[1].values(), *([] if level[0] is None else [level[0]])]):
        raise argparse.ArgumentTypeError(f"{text!r} must be finite numbers >= 0")
    return level


def _positive_number(text: str) -> float:
    """argparse type of --temperature: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _loss_scale(text: str) -> float | str:
    """argparse type of --loss-scale: a finite number > 0, or "calibrate"."""
    if text == "calibrate":
        return text
    try:
        return _positive_number(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0 or 'calibrate'") from None


def _regex(text: str) -> str:
    """argparse type of --modules: a regex that compiles."""
    import re

    try:
        re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regex ({error})") from None
    return text


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
        help="relative tolerance (default: the ini's precision_rtol, else 0.10); per metric as METRIC=RTOL, "
        "e.g. '0.1 max_rel=0.5'",
    )
    diff.add_argument(
        "--atol",
        type=_tolerance,
        metavar="ATOL",
        help="absolute tolerance (default: the ini's precision_atol, else 1e-5); per metric as METRIC=ATOL",
    )
    diff.add_argument(
        "--metric",
        action="append",
        help="metric to compare (repeatable; default: the ini's precision_metrics, else rms_rel)",
    )
    diff.add_argument("--limit", type=_positive, default=30, help="rows shown per test (default 30)")
    project = diff.add_argument_group(
        "the project's pytest (asked for the gate unless --metric, --rtol and --atol are all given)"
    )
    project.add_argument(
        "-c", "--config-file", metavar="FILE", help="the config file pytest reads, as pytest's -c (passed on)"
    )
    project.add_argument("--rootdir", metavar="DIR", help="pytest's --rootdir (passed on)")
    project.add_argument(
        "-o",
        "--override-ini",
        action="append",
        metavar="NAME=VALUE",
        help="pytest's -o, e.g. -o precision_rtol=0.05 (repeatable; passed on)",
    )
    diff.set_defaults(handler=_diff)

    run = commands.add_parser(
        "run",
        help="measure a local transformers checkpoint: tables, progress, and with --output-dir files to keep",
        description=RUN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("model_dir", metavar="CKPT", help="a local checkpoint folder (save_pretrained)")
    run.add_argument("--device", default="cpu", help="where the runs compute: cpu (default), cuda, cuda:1, ...")
    variants = run.add_argument_group("variants")
    variants.add_argument(
        "--variants",
        metavar="NAMES",
        help="comma-separated built-in variant names (default bf16,fp16, unless --variants-file is given)",
    )
    variants.add_argument(
        "--variants-file",
        metavar="FILE",
        help="a JSON or TOML file of variants by their fields (name, dtype, "
        "autocast, fp32_modules, matmul_precision, backend, attn_implementation, arrangement, fp8_training, quantize, "
        "weight_storage, replay_routing, compile, implementation); mixes with --variants",
    )
    variants.add_argument(
        "--isolate", action="store_true", help="also each module's isolated error (the error it adds itself)"
    )
    variants.add_argument(
        "--loss-scale",
        type=_loss_scale,
        metavar="SCALE",
        help="fp16 loss scale: a number, or 'calibrate' (an "
        "unscaled pass of each fp16 variant sizes it); default: sized from the reference's largest gradient",
    )
    inputs = run.add_argument_group("inputs (with --reference: default the reference's own; if given, must match)")
    inputs.add_argument("--length", type=int, metavar="N", help="tokens per sequence, at least 2 (default 128)")
    inputs.add_argument("--batch", type=int, metavar="N", help="sequences (default 2)")
    inputs.add_argument("--tokens", type=int, metavar="N", help="tokens in all: --batch sequences of N/batch")
    inputs.add_argument(
        "--text", metavar="FILE", help="a UTF-8 text file to tokenize (repeated to length); default: random tokens"
    )
    inputs.add_argument("--seed", type=int, metavar="N", help="seed of the random tokens (default 0)")
    measured = run.add_argument_group("what is measured (with --reference: the reference's own)")
    measured.add_argument(
        "--modules",
        action="append",
        type=_regex,
        metavar="REGEX",
        help="full-match regex of module names to capture (repeatable); default: embedding, blocks, final norm, head",
    )
    measured.add_argument("--forward-only", action="store_true", default=None, help="no backward pass")
    measured.add_argument(
        "--temperature", type=_positive_number, metavar="T", help="of the chosen-token log-probabilities (default 1)"
    )
    reference = run.add_argument_group("reusing the reference")
    reference.add_argument(
        "--save-reference", metavar="PATH", help="write the fp32 reference (safetensors) for later --reference runs"
    )
    reference.add_argument(
        "--reference",
        metavar="PATH",
        help="load a reference written by --save-reference and run only the "
        "variants; refused when it was made from other weights or inputs",
    )
    output = run.add_argument_group("output")
    output.add_argument(
        "--output-dir",
        metavar="DIR",
        help="write precision-report.json, summary.md, error-vs-depth.png, "
        "inputs.safetensors and logprobs/<run>.npy there (refused when DIR is not empty, unless --overwrite, "
        "and while another run writes DIR)",
    )
    output.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run's files in --output-dir and an existing --save-reference file",
    )
    output.add_argument("--quiet", action="store_true", help="no progress on stderr")
    output.add_argument("--full", action="store_true", help="also print every tensor's row")
    run.set_defaults(handler=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    quiet_torchao_notices()
    arguments = build_parser().parse_args(argv)
    try:
        code = int(arguments.handler(arguments))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except PrecisionError as error:
        print(f"pytest-precision {arguments.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(f"pytest-precision {arguments.command}: {str(interrupt) or 'interrupted'}", file=sys.stderr)
        return 128 + 2  # what a shell reports for a command stopped by SIGINT
    except BrokenPipeError:
        # The reader went away (`pytest-precision show x.json | head`): stop quietly. Point stdout at devnull so
        # the interpreter's final flush does not fail again (the recipe of Python's signal module docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # what a process killed by SIGPIPE reports


if __name__ == "__main__":
    sys.exit(main())
