"""Baseline files: where they live, what they hold, how they are read (with clear errors) and written
(atomically, and only when a number moved).

A file is JSON a reviewer can read in a diff: sorted keys, indented, one record per line, floats rounded
to 6 significant digits, trailing newline. Infinities are written as the strings "inf" / "-inf", undefined
values as null.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BaselineError
from .report import PrecisionReport, Record

SCHEMA_VERSION = 1
SIGNIFICANT_DIGITS = 6


def baseline_stem(nodeid: str) -> str:
    """The file-name stem of a test: its name with class and parameters, sanitised."""
    name = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", name.replace("::", ".")).strip("_")


def baseline_path(directory: Path, test_file: str, stem: str, device_key: str) -> Path:
    """<dir>/<test file relative to rootdir, without .py>/<stem>.<device key>.json"""
    relative = Path(test_file).with_suffix("")
    return directory / relative / f"{stem}.{device_key}.json"


def json_ready(value: Any) -> Any:
    """Floats rounded to SIGNIFICANT_DIGITS, NaN as null, infinities as \"inf\" / \"-inf\"."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return str(value)


def _restored(value: Any) -> Any:
    if value == "inf":
        return math.inf
    if value == "-inf":
        return -math.inf
    return value


def payload(report: PrecisionReport, test_id: str) -> dict[str, Any]:
    """Everything a baseline holds except its environment block, rounded as written."""
    variants = {}
    for name in report.variants:
        run = report.runs[name].to_dict()
        spec = run.pop("variant")
        variants[name] = {
            "spec": spec,
            "run": run,
            "records": [r.to_dict() for r in report.records(name)],
        }
    reference = report.reference.to_dict()
    rounded: dict[str, Any] = json_ready(
        {
            "schema_version": SCHEMA_VERSION,
            "test": test_id,
            "device": report.device,
            "reference": {"spec": reference.pop("variant"), "run": reference},
            "variant_order": report.variants,
            "variants": variants,
        }
    )
    return rounded


def render(document: dict[str, Any]) -> str:
    """Sorted, indented JSON with each record on one line, so a diff shows which tensors moved."""
    placeholders: dict[str, str] = {}

    def one_line_records(value: Any) -> Any:
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if key == "records" and isinstance(item, list):
                    tokens = []
                    for record in item:
                        token = f"@@record{len(placeholders)}@@"
                        placeholders[token] = json.dumps(record, sort_keys=True, allow_nan=False)
                        tokens.append(token)
                    out[key] = tokens
                else:
                    out[key] = one_line_records(item)
            return out
        return value

    text = json.dumps(one_line_records(document), sort_keys=True, indent=2, allow_nan=False)
    for token, record_text in placeholders.items():
        text = text.replace(f'"{token}"', record_text, 1)
    return text + "\n"


@dataclass(frozen=True)
class Baseline:
    """A parsed baseline file."""

    path: Path
    data: dict[str, Any]

    @property
    def variant_order(self) -> list[str]:
        return list(self.data.get("variant_order") or self.data["variants"])

    def records(self) -> dict[str, list[Record]]:
        return {
            name: [Record.from_dict({k: _restored(v) for k, v in r.items()}) for r in entry["records"]]
            for name, entry in self.data["variants"].items()
        }


def load_baseline(path: Path, refresh_hint: str, *, shown: Path | None = None) -> Baseline:
    """Read and validate a baseline; every problem is a BaselineError naming the file and the fix.

    `shown` is the path as the user should read it (relative to where pytest runs).
    """
    fix = f"Re-create it with: {refresh_hint}"
    name = shown or path
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise BaselineError(f"cannot read precision baseline {name}: {error}") from None
    if not text.strip():
        raise BaselineError(f"precision baseline {name} is empty. {fix}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise BaselineError(
            f"precision baseline {name} is not valid JSON (line {error.lineno}, column {error.colno}: "
            f"{error.msg}); it may be truncated or have a merge conflict. {fix}"
        ) from None
    if not isinstance(data, dict):
        raise BaselineError(f"precision baseline {name} holds a JSON {type(data).__name__}, not an object. {fix}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BaselineError(
            f"precision baseline {name} has schema_version {version!r}; this pytest-precision reads "
            f"version {SCHEMA_VERSION}. {fix}"
        )
    variants = data.get("variants")
    if not isinstance(variants, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("records"), list) for v in variants.values()
    ):
        raise BaselineError(f"precision baseline {name} has no valid 'variants' block. {fix}")
    return Baseline(path, data)


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and os.replace: never half-written, even in parallel."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates 0600; give the file the mode an ordinary write would (0666 less the umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def document(report: PrecisionReport, test_id: str, environment: dict[str, Any]) -> dict[str, Any]:
    """The whole baseline file content for a report."""
    data = payload(report, test_id)
    data["environment"] = json_ready(environment)
    return data


def numbers_unchanged(path: Path, new: dict[str, Any]) -> bool:
    """Whether the file at `path` already holds `new` apart from its environment block."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(old, dict):
        return False
    strip = {k: v for k, v in new.items() if k != "environment"}
    return bool({k: v for k, v in old.items() if k != "environment"} == json.loads(json.dumps(strip)))


def report_from_document(data: dict[str, Any], path: Path) -> PrecisionReport:
    """A PrecisionReport rebuilt from a baseline file's content (for `pytest-precision show` and `diff`)."""
    from .report import RunInfo

    def run_info(entry: dict[str, Any]) -> RunInfo:
        return RunInfo.from_dict({**(entry.get("run") or {}), "variant": entry.get("spec") or {}})

    try:
        report = PrecisionReport(reference=run_info(data["reference"]), device=str(data.get("device", "cpu")))
        baseline = Baseline(path, data)
        records = baseline.records()
        for name in baseline.variant_order:
            report.add(name, run_info(data["variants"][name]), records[name], [])
    except (KeyError, TypeError) as error:
        raise BaselineError(f"{path} is not a complete precision baseline (missing {error})") from None
    return report
