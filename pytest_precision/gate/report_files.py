"""Baseline files and session reports as `pytest-precision show` and `diff` read them: anything that is not
one (binary, not UTF-8, not JSON, of the wrong shape anywhere) is a PrecisionError naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_precision.base import strict_json
from pytest_precision.base.errors import PrecisionError

if TYPE_CHECKING:
    from pytest_precision.reports.report import PrecisionReport


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise PrecisionError(f"cannot read {path}: {error.strerror or error}") from None
    if b"\x00" in raw[:8192]:
        raise PrecisionError(f"{path} is a binary file, not a baseline or session report (JSON text)")
    try:
        data = strict_json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as error:
        raise PrecisionError(
            f"{path} is not UTF-8 text (byte {error.start}), not a baseline or session report (JSON text)"
        ) from None
    except strict_json.StrictJsonError as error:
        raise PrecisionError(f"{path}: {error}; re-create it (a baseline: --update-baselines)") from None
    except json.JSONDecodeError as error:
        raise PrecisionError(f"{path} is not valid JSON (line {error.lineno}: {error.msg})") from None
    except RecursionError:
        raise PrecisionError(f"{path} is not a baseline or session report (JSON nested too deeply)") from None
    if not isinstance(data, dict):
        raise PrecisionError(f"{path} holds a JSON {type(data).__name__}, not a baseline or session report")
    return data


def _restored_records(variants: Any) -> Any:
    """A session report's variants with the strings "inf" / "-inf" it writes for infinities made floats."""
    from pytest_precision.gate.baseline import restored_record

    if not isinstance(variants, dict):
        raise TypeError(f"'variants' is a JSON {type(variants).__name__}, not an object")
    restored = {}
    for name, entry in variants.items():
        records = entry["records"]
        if not isinstance(records, list):
            raise TypeError(f"variant {name!r}: 'records' is a JSON {type(records).__name__}, not a list")
        restored[name] = {**entry, "records": [restored_record(r) for r in records]}
    return restored


#: Record fields that are not metrics (checked apart).
_NOT_METRICS = {"name", "kind", "shape", "count", "nonfinite"}


def _check_report(report: PrecisionReport, label: str) -> None:
    """TypeError naming the variant, tensor and field of the first record that is not numbers and names."""
    import dataclasses

    from pytest_precision.base.records import Record

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


def reports_in(path: Path) -> dict[str, PrecisionReport]:
    """{label: PrecisionReport} of a baseline file (one) or a session report (one per test).

    Anything malformed is a PrecisionError naming the file, never a raw exception.
    """
    from pytest_precision.gate.baseline import report_from_document
    from pytest_precision.reports.report import PrecisionReport

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
        detail = f"missing {error}" if isinstance(error, KeyError) else str(error)
        raise PrecisionError(
            f"{path} is not a valid precision baseline or session report ({detail}); re-create it with "
            "pytest --update-baselines (a baseline) or pytest --precision-report DIR (a session report)"
        ) from None
    return reports
