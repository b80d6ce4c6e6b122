"""`pytest-precision`: show and diff baseline files, or measure a local checkpoint without writing a test.

pytest-precision show baselines/tests/test_llama/test_bf16.cpu.json --kind fw
pytest-precision diff old.json new.json --rtol 0.1
pytest-precision run path/to/checkpoint --variants bf16,fp16 --length 256 --text prompt.txt
"""

from __future__ import annotations

import argparse
import json
import math
import os
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


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (transformers' messages span several), at most 300 characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise PrecisionError(f"cannot read {path}: {error.strerror or error}") from None
    if b"\x00" in raw[:8192]:
        raise PrecisionError(f"{path} is a binary file, not a baseline or session report (JSON text)")
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as error:
        raise PrecisionError(
            f"{path} is not UTF-8 text (byte {error.start}), not a baseline or session report (JSON text)"
        ) from None
    except json.JSONDecodeError as error:
        raise PrecisionError(f"{path} is not valid JSON (line {error.lineno}: {error.msg})") from None
    except RecursionError:
        raise PrecisionError(f"{path} is not a baseline or session report (JSON nested too deeply)") from None
    if not isinstance(data, dict):
        raise PrecisionError(f"{path} holds a JSON {type(data).__name__}, not a baseline or session report")
    return data


def _restored_records(variants: Any) -> Any:
    """A session report's variants with the strings "inf" / "-inf" it writes for infinities made floats."""
    if not isinstance(variants, dict):
        raise TypeError(f"'variants' is a JSON {type(variants).__name__}, not an object")
    restored = {}
    for name, entry in variants.items():
        records = entry["records"]
        if not isinstance(records, list):
            raise TypeError(f"variant {name!r}: 'records' is a JSON {type(records).__name__}, not a list")
        restored[name] = {**entry, "records": [{k: _restored(v) for k, v in r.items()} for r in records]}
    return restored


def _restored(value: Any) -> Any:
    return {"inf": math.inf, "-inf": -math.inf}.get(value, value) if isinstance(value, str) else value


#: Record fields that are not metrics (checked apart).
_NOT_METRICS = {"name", "kind", "shape", "count", "nonfinite"}


def _check_report(report: Any, label: str) -> None:
    """TypeError naming the variant, tensor and field of the first record that is not numbers and names."""
    import dataclasses

    from .report import Record

    metric_fields = [f.name for f in dataclasses.fields(Record) if f.name not in _NOT_METRICS]
    for run_name, run in [("reference", report.reference), *report.runs.items()]:
        for name in ("variant", "parameter_dtypes", "buffer_dtypes", "input_shapes", "backend"):
            if not isinstance(getattr(run, name), dict):
                raise TypeError(f"test {label}, {run_name} run: {name} is not an object")
        for name in ("loss_scale", "token_count"):
            value = getattr(run, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"test {label}, {run_name} run: {name} is {value!r}, not a number or null")
    for variant in report.variants:
        for record in report.records(variant):
            where = f"test {label}, variant {variant!r}, tensor {record.name!r} ({record.kind})"
            if not isinstance(record.name, str) or not isinstance(record.kind, str):
                raise TypeError(f"test {label}, variant {variant!r}: a record's name or kind is not a string")
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in record.shape):
                raise TypeError(f"{where}: shape {list(record.shape)!r} is not a list of integers")
            for name in metric_fields:
                value = getattr(record, name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise TypeError(f"{where}: {name} is {value!r}, not a number or null")


def reports_in(path: Path) -> dict[str, Any]:
    """{label: PrecisionReport} of a baseline file (one) or a session report (one per test).

    Anything malformed is a PrecisionError naming the file, never a raw exception.
    """
    from .baseline import report_from_document
    from .report import PrecisionReport

    data = _read_json(path)
    try:
        if "tests" in data and "variants" not in data:
            tests = data["tests"]
            if not isinstance(tests, dict):
                raise TypeError(f"'tests' is a JSON {type(tests).__name__}, not an object of test id -> results")
            reports = {}
            for nodeid, entry in sorted(tests.items()):
                if not isinstance(entry, dict):
                    raise TypeError(f"test {nodeid}: a JSON {type(entry).__name__}, not an object")
                if "variants" in entry:
                    document = {
                        "device": entry.get("device", "cpu"),
                        "reference": entry["reference"],
                        "variants": _restored_records(entry["variants"]),
                    }
                    reports[nodeid] = PrecisionReport.from_dict(document)
        elif "variants" not in data:
            raise PrecisionError(f"{path} is neither a precision baseline nor a session report (no 'variants')")
        else:
            reports = {str(data.get("test", path.name)): report_from_document(data, path)}
        for label, report in reports.items():
            _check_report(report, label)
    except PrecisionError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        detail = f"missing {error}" if isinstance(error, KeyError) else _one_line(error)
        raise PrecisionError(
            f"{path} is not a valid precision baseline or session report ({detail}); re-create it with "
            "pytest --update-baselines (a baseline) or pytest --precision-report DIR (a session report)"
        ) from None
    return reports


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
                f"{path}: test {label} cannot be shown, its run information is malformed ({_one_line(error)})"
            ) from None
        print(f"== {label}")
        print(text)
        print()
    return 0


Row = tuple[str, str, str, str, float | None, float | None, float | None]


def _undefined(value: float | None) -> bool:
    return value is None or math.isnan(value)


def diff_rows(old: Any, new: Any, metrics: Sequence[str]) -> list[Row]:
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


def _worse(row: Row, tolerance: Any) -> bool:
    """Whether a row's metric is a number in both and got worse beyond the tolerance."""
    from .tolerance import is_worse

    metric, before, after = row[3], row[4], row[5]
    if before is None or after is None or math.isnan(before) or math.isnan(after):
        return False
    return is_worse(metric, before, after, tolerance)


def lost_checks(old: Any, new: Any, metrics: Sequence[str]) -> list[str]:
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


def _pairs(old_path: Path, new_path: Path) -> list[tuple[str, Any, Any]]:
    """(label, old report or None, new report) per test of NEW: by test id, or the only one against the only
    one. A single baseline against several tests pairs with its own test id, or refuses."""
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
        print(f"== {label}: {len(got_worse)} of {len(rows)} tensor metrics worse beyond rtol {arguments.rtol}")
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


#: Files a transformers tokenizer is read from; a checkpoint with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _checked_device(name: str) -> Any:
    """The torch.device of --device, after checking that this machine has it."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise PrecisionError(f"--device {name}: not a device name ({_one_line(error)}); e.g. cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PrecisionError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    try:
        torch.empty(1, device=device)
    except Exception as error:  # each backend fails in its own way (AssertionError, RuntimeError, ...)
        raise PrecisionError(f"--device {name}: not usable here ({_one_line(error)}); use --device cpu") from None
    return device


def _checkpoint_config(directory: Path) -> dict[str, Any]:
    """config.json of a local checkpoint folder, refused when it is corrupt or names custom code."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise PrecisionError(
            f"{directory} is not a transformers checkpoint folder (no config.json); pass a local folder written by "
            "save_pretrained (the hub is not used)"
        )
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise PrecisionError(f"cannot read {config_path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise PrecisionError(f"{config_path} is not valid JSON ({_one_line(error)}); re-save the checkpoint") from None
    if not isinstance(config, dict):
        raise PrecisionError(f"{config_path} holds a JSON {type(config).__name__}, not a model configuration")
    if "auto_map" in config:
        # transformers would run the checkpoint's own .py files (with trust_remote_code) or silently measure
        # its built-in class instead of the model the checkpoint means; neither is acceptable here.
        named = config["auto_map"]
        shown = ", ".join(f"{k} -> {v}" for k, v in named.items()) if isinstance(named, dict) else repr(named)
        raise PrecisionError(
            f"{config_path} names custom code (auto_map: {shown}); pytest-precision run never executes code from a "
            "checkpoint: load the model yourself (trust_remote_code=True, if you trust it) and call "
            "pytest_precision.compare"
        )
    return config


def _loading(what: str, load: Any) -> Any:
    """load(), with any error of transformers (OSError, ValueError, safetensors', ...) as one line."""
    try:
        return load()
    except PrecisionError:
        raise
    except Exception as error:
        raise PrecisionError(f"cannot load {what}: {type(error).__name__}: {_one_line(error)}") from None


def _run(arguments: argparse.Namespace) -> int:
    import torch

    from .comparison import compare
    from .inputs import from_text, random_tokens
    from .variants import resolve_variant

    if arguments.length < 2:
        raise PrecisionError(
            f"--length must be >= 2 (got {arguments.length}): a next-token log-probability needs two tokens"
        )
    if arguments.batch < 1:
        raise PrecisionError(f"--batch must be >= 1 (got {arguments.batch})")
    variants = [v.strip() for v in arguments.variants.split(",") if v.strip()]
    if not variants:
        raise PrecisionError(f"--variants {arguments.variants!r} names no variant; e.g. --variants bf16,fp16")
    for variant in variants:
        resolve_variant(variant, argument="--variants")
    device = _checked_device(arguments.device)
    text = None
    if arguments.text:
        try:
            text = Path(arguments.text).read_bytes().decode("utf-8")
        except OSError as error:
            raise PrecisionError(f"--text {arguments.text}: cannot read it: {error.strerror or error}") from None
        except UnicodeDecodeError:
            raise PrecisionError(f"--text {arguments.text}: not UTF-8 text; pass a UTF-8 text file") from None
    directory = Path(arguments.model_dir)
    _checkpoint_config(directory)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise PrecisionError("`pytest-precision run` needs transformers: pip install 'pytest-precision[hf]'") from None
    # Never code from the checkpoint, never the hub: trust_remote_code=False also means transformers never
    # prompts (it asks only when the argument is left at None).
    local = {"local_files_only": True, "trust_remote_code": False}
    config = _loading(f"the configuration of {directory}", lambda: AutoConfig.from_pretrained(directory, **local))

    def factory(dtype: torch.dtype, device: torch.device) -> Any:
        model: Any = _loading(
            f"the model in {directory}",
            lambda: AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **local),
        )
        return model.to(device)

    if text is not None:
        if not any((directory / name).is_file() for name in TOKENIZER_FILES):
            raise PrecisionError(
                f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...) to tokenize --text "
                f"{arguments.text}; save one there (tokenizer.save_pretrained), or leave out --text for random tokens"
            )
        tokenizer = _loading(f"the tokenizer of {directory}", lambda: AutoTokenizer.from_pretrained(directory, **local))
        ids = from_text(tokenizer, text, arguments.batch, arguments.length)
    else:
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise PrecisionError(
                f"{directory / 'config.json'}: vocab_size is {vocab!r}, not a positive integer; random tokens need it"
            )
        ids = random_tokens(vocab, arguments.batch, arguments.length, seed=arguments.seed)
    report = compare(
        factory,
        {"input_ids": ids, "labels": ids},
        variants,
        device=device,
        backward=not arguments.forward_only,
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
    diff.add_argument("--rtol", type=_tolerance, default=0.10, help="relative tolerance (default 0.10)")
    diff.add_argument("--atol", type=_tolerance, default=1e-5, help="absolute tolerance (default 1e-5)")
    diff.add_argument("--metric", action="append", help="metric to compare (repeatable; default rms_rel)")
    diff.add_argument("--limit", type=_positive, default=30, help="rows shown per test (default 30)")
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
