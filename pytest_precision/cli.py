"""`pytest-precision`: show and diff baseline files, or measure a local checkpoint without writing a test.

pytest-precision show baselines/tests/test_llama/test_bf16.cpu.json --kind fw
pytest-precision diff old.json new.json --rtol 0.1
pytest-precision run path/to/checkpoint --variants bf16,fp16 --length 256 --text prompt.txt
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import PrecisionError

EPILOG = """examples:
  pytest-precision show baselines/tests/test_llama/test_bf16.cpu.json
      the error-propagation tables of a baseline (or of a --precision-report session report)
  pytest-precision diff old.json new.json
      what a pull request that changes baselines changes: largest changes first; exit 1 when worse
  pytest-precision run ./my-checkpoint --variants bf16,fp16 --text prompt.txt
      load a local transformers checkpoint (no hub access) and print its tables
"""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PrecisionError(f"cannot read {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise PrecisionError(f"{path} is not valid JSON (line {error.lineno}: {error.msg})") from None
    if not isinstance(data, dict):
        raise PrecisionError(f"{path} holds a JSON {type(data).__name__}, not a baseline or session report")
    return data


def reports_in(path: Path) -> dict[str, Any]:
    """{label: PrecisionReport} of a baseline file (one) or a session report (one per test)."""
    from .baseline import report_from_document
    from .report import PrecisionReport

    data = _read_json(path)
    if "tests" in data and "variants" not in data:
        return {
            nodeid: PrecisionReport.from_dict(
                {"device": entry.get("device", "cpu"), "reference": entry["reference"], "variants": entry["variants"]}
            )
            for nodeid, entry in sorted(data["tests"].items())
            if "variants" in entry
        }
    if "variants" not in data:
        raise PrecisionError(f"{path} is neither a precision baseline nor a session report (no 'variants')")
    return {str(data.get("test", path.name)): report_from_document(data, path)}


def _show(arguments: argparse.Namespace) -> int:
    from .report import PrecisionReport
    from .tables import format_report

    for label, report in reports_in(Path(arguments.file)).items():
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
        print(f"== {label}")
        print(format_report(report, full=not arguments.summary))
        print()
    return 0


def diff_rows(
    old: Any, new: Any, metrics: Sequence[str]
) -> list[tuple[str, str, str, str, float | None, float | None, float | None]]:
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
                ratio = None if a is None or b is None or a == 0 else b / a
                rows.append((variant, record.name, record.kind, metric, a, b, ratio))

    def change(row: tuple[Any, ...]) -> float:
        ratio = row[6]
        if ratio is None or ratio <= 0 or not math.isfinite(ratio):
            return 0.0 if row[4] == row[5] else math.inf
        return abs(math.log(ratio))

    return sorted(rows, key=change, reverse=True)


def _diff(arguments: argparse.Namespace) -> int:
    from .messages import format_number
    from .metrics import METRIC_DIRECTIONS
    from .tables import render
    from .tolerance import Tolerance, is_worse

    old_reports, new_reports = reports_in(Path(arguments.old)), reports_in(Path(arguments.new))
    metrics = arguments.metric or ["rms_rel"]
    unknown = [m for m in metrics if m not in METRIC_DIRECTIONS]
    if unknown:
        raise PrecisionError(
            f"--metric: unknown metric(s) {', '.join(unknown)}; choose from {', '.join(METRIC_DIRECTIONS)}"
        )
    tolerance = Tolerance(rtol=arguments.rtol, atol=arguments.atol)
    worse = 0
    for label, new in new_reports.items():
        old = old_reports.get(label) or (next(iter(old_reports.values())) if len(old_reports) == 1 else None)
        if old is None:
            print(f"== {label}: not in {arguments.old}")
            continue
        only_old = sorted(set(old.variants) - set(new.variants))
        only_new = sorted(set(new.variants) - set(old.variants))
        rows = diff_rows(old, new, metrics)
        got_worse = [r for r in rows if r[4] is not None and r[5] is not None and is_worse(r[3], r[4], r[5], tolerance)]
        worse += len(got_worse)
        print(f"== {label}: {len(got_worse)} of {len(rows)} tensor metrics worse beyond rtol {arguments.rtol}")
        if only_old or only_new:
            print(f"  variants only in old: {', '.join(only_old) or '-'}; only in new: {', '.join(only_new) or '-'}")
        shown = rows[: arguments.limit]
        table = [
            [
                v,
                t,
                k,
                m,
                format_number(a),
                format_number(b),
                "-" if ratio is None else f"{ratio:.3g}x",
                "WORSE" if (v, t, k, m, a, b, ratio) in got_worse else "",
            ]
            for v, t, k, m, a, b, ratio in shown
        ]
        for line in render(["variant", "tensor", "kind", "metric", "old", "new", "ratio", ""], table, left=4):
            print(line)
        if len(rows) > len(shown):
            print(f"  ... {len(rows) - len(shown)} more (--limit)")
    return 1 if worse else 0


def _run(arguments: argparse.Namespace) -> int:
    import torch

    from .comparison import compare
    from .inputs import from_text, random_tokens

    directory = Path(arguments.model_dir)
    if not (directory / "config.json").is_file():
        raise PrecisionError(
            f"{directory} is not a transformers checkpoint folder (no config.json); pass a local folder written by "
            "save_pretrained (the hub is not used)"
        )
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise PrecisionError("`pytest-precision run` needs transformers: pip install 'pytest-precision[hf]'") from None

    def factory(dtype: torch.dtype, device: torch.device) -> Any:
        model: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
        return model.to(device)

    if arguments.text:
        text = Path(arguments.text).read_text(encoding="utf-8")
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        ids = from_text(tokenizer, text, arguments.batch, arguments.length)
    else:
        vocab = AutoConfig.from_pretrained(directory, local_files_only=True).vocab_size
        ids = random_tokens(vocab, arguments.batch, arguments.length, seed=arguments.seed)
    variants = [v.strip() for v in arguments.variants.split(",") if v.strip()]
    report = compare(
        factory,
        {"input_ids": ids, "labels": ids},
        variants,
        device=arguments.device,
        backward=not arguments.forward_only,
    )
    print(report.format(full=arguments.full))
    return 0


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
    show.add_argument("--kind", choices=["fw", "bw", "grad", "logprob", "loss"], help="only tensors of this kind")
    show.add_argument("--summary", action="store_true", help="only the summary tables, not every tensor")
    show.set_defaults(handler=_show)

    diff = commands.add_parser(
        "diff",
        help="compare two baseline files (exit 1 when something got worse)",
        description="Per variant and tensor: old, new and ratio for the gated metrics, largest changes first. "
        "Exit code 1 when a metric got worse beyond --rtol/--atol. Example: git show main:baselines/x.json > old.json; "
        "pytest-precision diff old.json baselines/x.json",
    )
    diff.add_argument("old")
    diff.add_argument("new")
    diff.add_argument("--rtol", type=float, default=0.10, help="relative tolerance (default 0.10)")
    diff.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    diff.add_argument("--metric", action="append", help="metric to compare (repeatable; default rms_rel)")
    diff.add_argument("--limit", type=int, default=30, help="rows shown per test (default 30)")
    diff.set_defaults(handler=_diff)

    run = commands.add_parser(
        "run",
        help="measure a local transformers checkpoint and print its tables",
        description="Load a local transformers causal LM (no hub access), run the fp32 reference and each variant, "
        "and print the tables. Example: pytest-precision run ./ckpt --variants bf16,fp16 --text prompt.txt",
    )
    run.add_argument("model_dir")
    run.add_argument("--variants", default="bf16,fp16", help="comma-separated variant names (default bf16,fp16)")
    run.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128)")
    run.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    run.add_argument("--text", help="a text file to tokenize (repeated to length); default: random tokens")
    run.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    run.add_argument("--device", default="cpu")
    run.add_argument("--forward-only", action="store_true", help="no backward pass")
    run.add_argument("--full", action="store_true", help="also print every tensor's row")
    run.set_defaults(handler=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        return int(arguments.handler(arguments))
    except PrecisionError as error:
        print(f"pytest-precision {arguments.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
