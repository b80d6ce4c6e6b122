"""Baseline files: where they live, what they hold, how they are read (with clear errors) and written
(atomically, and only when a number moved).

A file is JSON a reviewer can read in a diff: sorted keys, indented, one record per line, floats rounded
to 6 significant digits (fp16 loss scales exactly: they are reused as they are), trailing newline.
Infinities are written as the strings "inf" / "-inf", undefined values as null.

`load_baseline` validates a file before the gate uses it, against the JSON Schema published in the package
(schemas/baseline.v1.schema.json, see baseline_schema): every record an object with a string `name`, a known
`kind`, a `shape` of non-negative integers, non-negative integer `count` and `nonfinite`, every core metric
present and each metric a number, null, "inf" or "-inf", range fractions (underflow_frac, zero_frac,
overflow_frac) in [0, 1] and ref_absmax >= 0. Then what a schema cannot say, checked here: no NaN / Infinity
literal anywhere, no key twice in one object and no number beyond the largest float (1e400 would read as
infinity; base.strict_json), each tensor once per variant, `variant_order` listing each variant once, a recorded
`loss_scale` null or a finite positive power of two. Anything else is a BaselineError naming the file, the
variant, the tensor and the field. A low-bit run's `lowbit` block (format, module count and names) is checked
too: the gate compares it with a run's (gate.lowbit_check).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_precision.base import strict_json
from pytest_precision.base.errors import BaselineError, ConfigurationError
from pytest_precision.base.file_names import WINDOWS_DEVICE_NAMES, windows_device_name
from pytest_precision.base.records import METRIC_NAMES, Record
from pytest_precision.gate.baseline_schema import schema_problem, variant_order_problem
from pytest_precision.reports.report import PrecisionReport

SCHEMA_VERSION = 1
SIGNIFICANT_DIGITS = 6


#: The longest baseline stem, in UTF-8 bytes. With the device key and ".json" (".cuda-sm120.json": 16 bytes) a
#: file name stays far below the 255 bytes that ext4, APFS, NTFS and most others allow, and its temporary
#: twin (see write_atomically) fits too.
MAX_STEM_BYTES = 200
#: Characters Windows refuses in a file name (macOS refuses ":" in Finder, every system "/").
ILLEGAL_CHARACTERS = frozenset('<>:"/\\|?*')
#: Names Windows reserves for devices, also with any extension ("nul.cpu.json"), in any case: see file_names.
RESERVED_NAMES = WINDOWS_DEVICE_NAMES
#: The device keys of baseline file names (environment.device_key): "cpu" or "cuda-sm<major><minor>".
DEVICE_KEY_PATTERN = r"cpu|cuda-sm\d+"
_BASELINE_NAME = re.compile(rf"^(?P<stem>[^.].*)\.(?P<device>{DEVICE_KEY_PATTERN})\.json$")


def stem_problem(stem: str) -> str | None:
    """Why `stem` cannot name a baseline file on Linux, macOS and Windows alike, or None when it can."""
    if not stem:
        return "it is empty"
    if os.path.isabs(stem) or stem.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[/\\]", stem):
        return "it is an absolute path"
    if ".." in re.split(r"[/\\]", stem):
        return "it climbs out of the baseline folder with '..'"
    if "/" in stem or "\\" in stem:
        return "it holds a path separator ('/' or '\\'); subfolders are not supported"
    illegal = sorted({c for c in stem if c in ILLEGAL_CHARACTERS or ord(c) < 32 or ord(c) == 127})
    if illegal:
        return f"it holds {', '.join(repr(c) for c in illegal)}, not allowed in a file name on every system"
    if stem.startswith("."):
        return "it starts with '.' (a hidden file)"
    if stem.endswith((".", " ")):
        return "it ends with a dot or a space (Windows drops those)"
    device = windows_device_name(stem)
    if device is not None:
        return f"{device!r} is a device name Windows reserves"
    size = len(stem.encode("utf-8", "surrogatepass"))
    if size > MAX_STEM_BYTES:
        return f"it is {size} bytes long in UTF-8, more than the {MAX_STEM_BYTES} that fit every filesystem"
    return None


def checked_stem(stem: object, argument: str = "baseline") -> str:
    """`stem` when it can name a baseline file everywhere; else a ConfigurationError naming `argument`."""
    if not isinstance(stem, str):
        raise ConfigurationError(f"{argument}= must be a string (a file name stem), got {type(stem).__name__}")
    problem = stem_problem(stem)
    if problem is not None:
        shown = stem if len(stem) <= 80 else f"{stem[:60]}...{stem[-10:]}"
        raise ConfigurationError(
            f"{argument}={shown!r} cannot name a baseline file: {problem}. Give a plain file name stem such as "
            f"{argument}='llama_bf16' (letters, digits, '_', '-' and '.'; at most {MAX_STEM_BYTES} bytes); the "
            "file is <baseline dir>/<test file>/<stem>.<device>.json"
        )
    return stem


def baseline_stem(nodeid: str) -> str:
    """The file-name stem of a test: its name with class and parameters, sanitised.

    Characters other than letters, digits, '_', '.' and '-' become '_'. A stem starting with a name Windows
    reserves ("Aux.test_x") gets a '_' after it; one longer than MAX_STEM_BYTES (long parameters) is cut and
    ends with '-' and 12 hex digits of the SHA-256 of the test name, so it stays unique and stable.
    """
    name = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
    stem = re.sub(r"[^A-Za-z0-9_.\-]+", "_", name.replace("::", ".")).strip("_").rstrip(".")
    base, dot, rest = stem.partition(".")
    if windows_device_name(stem) is not None:
        stem = f"{base}_{dot}{rest}"
    if len(stem) > MAX_STEM_BYTES:  # ASCII only: characters are bytes
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        stem = f"{stem[: MAX_STEM_BYTES - len(digest) - 1].rstrip('.')}-{digest}"
    return stem or "test"


def baseline_path(directory: Path, test_file: str, stem: str, device_key: str) -> Path:
    """<dir>/<test file relative to rootdir, without .py>/<stem>.<device key>.json"""
    relative = Path(test_file).with_suffix("")
    return directory / relative / f"{stem}.{device_key}.json"


def parse_baseline_name(name: str) -> tuple[str, str] | None:
    """(stem, device key) of a file name of the form <stem>.<device key>.json; None for any other name."""
    match = _BASELINE_NAME.match(name)
    return (match["stem"], match["device"]) if match else None


def owned_document(path: Path) -> dict[str, Any] | None:
    """The content of `path` when the plugin wrote it: a baseline file name, and a JSON object of this
    schema version whose "test" is a test id. None for anything else (never pruned, never stale)."""
    if path.is_symlink() or not path.is_file() or parse_baseline_name(path.name) is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        return None
    test = data.get("test")
    if not isinstance(test, str) or "::" not in test or not isinstance(data.get("variants"), dict):
        return None
    return data


#: Keys whose float values are written exactly, never rounded: fp16 loss scales are powers of two that a
#: compare run reuses as they are (2**20 rounded to 6 digits would be 1048580).
EXACT_KEYS = frozenset({"loss_scale"})


def json_ready(value: Any, *, exact: bool = False) -> Any:
    """Floats rounded to SIGNIFICANT_DIGITS (values under EXACT_KEYS kept as they are), NaN as null,
    infinities as \"inf\" / \"-inf\"."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value if exact else float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(value, dict):
        return {str(k): json_ready(v, exact=k in EXACT_KEYS) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return str(value)


#: Record fields that hold a metric (a number, null, or "inf" / "-inf" in a file).
METRIC_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Record) if f.name not in ("name", "kind", "shape", "count", "nonfinite")
)
#: Range statistics that are fractions of a tensor's elements (see range_stats.RangeStats).
FRACTION_METRICS = ("underflow_frac", "zero_frac", "overflow_frac")
#: Metric fields every record holds (the others only where defined, see Record.to_dict).
REQUIRED_METRICS: tuple[str, ...] = tuple(m for m in METRIC_NAMES if m != "nonfinite")


def restored_float(value: Any) -> Any:
    """A float as json_ready wrote it: "inf" / "-inf" back to infinities; anything else as it is."""
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
    """A parsed baseline file (load_baseline has validated it)."""

    path: Path
    data: dict[str, Any]

    @property
    def variant_order(self) -> list[str]:
        return list(self.data.get("variant_order") or self.data["variants"])

    def records(self) -> dict[str, list[Record]]:
        return {
            name: [Record.from_dict(restored_record(r)) for r in entry["records"]]
            for name, entry in self.data["variants"].items()
        }

    def loss_scales(self) -> dict[str, float]:
        """{variant: the fp16 loss scale its run recorded}, for variants that recorded one."""
        scales = {}
        for name, entry in self.data["variants"].items():
            scale = (entry.get("run") or {}).get("loss_scale")
            if scale is not None:
                scales[name] = float(scale)
        return scales


def restored_record(record: dict[str, Any]) -> dict[str, Any]:
    """A record as written, its metric fields' "inf" / "-inf" made floats (a tensor named "inf" stays a name)."""
    return {k: restored_float(v) if k in METRIC_FIELDS else v for k, v in record.items()}


_LITERAL_HINT = 'which JSON does not allow (an undefined metric is null, an infinite one "inf" or "-inf")'


class _NonStandardLiteral(str):
    """NaN, Infinity or -Infinity in a file: Python's json reads them, JSON has none, a baseline never
    holds them (NaN is written null, infinities "inf" / "-inf")."""


def load_baseline(path: Path, refresh_hint: str, *, shown: Path | None = None) -> Baseline:
    """Read and validate a baseline; every problem is a BaselineError naming the file and the fix.

    `shown` is the path as the user should read it (relative to where pytest runs).
    """
    fix = f"Re-create it with: {refresh_hint}" if refresh_hint else "Re-create it with --update-baselines."
    name = shown or path
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise BaselineError(f"cannot read precision baseline {name}: {error}") from None
    if not text.strip():
        raise BaselineError(f"precision baseline {name} is empty. {fix}")
    try:
        data = strict_json.loads(text, parse_constant=_NonStandardLiteral)
    except strict_json.StrictJsonError as error:
        raise BaselineError(f"precision baseline {name}: {_place(error)}. {fix}") from None
    except (json.JSONDecodeError, RecursionError) as error:
        where = (
            f" (line {error.lineno}, column {error.colno}: {error.msg})"
            if isinstance(error, json.JSONDecodeError)
            else " (nested too deeply)"
        )
        raise BaselineError(
            f"precision baseline {name} is not valid JSON{where}; it may be truncated or have a merge conflict. {fix}"
        ) from None
    if not isinstance(data, dict):
        raise BaselineError(f"precision baseline {name} holds a JSON {type(data).__name__}, not an object. {fix}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BaselineError(
            f"precision baseline {name} has schema_version {version!r}; this pytest-precision reads "
            f"version {SCHEMA_VERSION}. {fix}"
        )
    problem = _document_problem(data) or _literal_problem(data, "")
    if problem:
        raise BaselineError(f"precision baseline {name}: {problem}. {fix}")
    return Baseline(path, data)


def _place(error: strict_json.StrictJsonError) -> str:
    """Where a strict_json problem is, in the words of the file's reader: the variant (or the reference), the
    tensor (name and kind) and the key; elsewhere the key's dotted path."""
    path, document = error.path, error.document
    where = None
    if len(path) >= 2 and path[0] == "variants":
        where = f"variant {path[1]!r}"
        rest = path[2:]
    elif path[:1] == ("reference",):
        where, rest = "the reference", path[1:]
    if where is None or not rest:
        return f"field {strict_json.dotted(path)!r} {error.reason}"
    if len(rest) >= 3 and rest[0] == "records" and isinstance(rest[1], int):
        record = strict_json.value_at(document, path[: len(path) - len(rest) + 2])
        name = record.get("name") if isinstance(record, dict) else None
        kind = f" ({record.get('kind')})" if isinstance(record, dict) and isinstance(record.get("kind"), str) else ""
        tensor = f"tensor {name!r}{kind}" if isinstance(name, str) else f"records[{rest[1]}]"
        return f"{where}, {tensor}: field {strict_json.dotted(rest[2:])!r} {error.reason}"
    return f"{where}: field {strict_json.dotted(rest)!r} {error.reason}"


def _literal_problem(value: Any, where: str) -> str | None:
    """Where the first NaN / Infinity literal outside the records is, if any."""
    if isinstance(value, _NonStandardLiteral):
        return f"field {where} holds the literal {value}, {_LITERAL_HINT}"
    if isinstance(value, dict):
        children = [(f"{where}.{key}" if where else key, item) for key, item in value.items()]
    else:
        children = [(f"{where}[{i}]", item) for i, item in enumerate(value)] if isinstance(value, list) else []
    for child, item in children:
        found = _literal_problem(item, child)
        if found:
            return found
    return None


def _document_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with the document, if anything: first against the published schema (baseline_schema), then
    what a JSON Schema cannot say, checked here: 'variant_order' lists each variant once, each tensor appears
    once per variant, and a recorded loss scale is a finite power of two."""
    problem = schema_problem(data, literal=_NonStandardLiteral, literal_hint=_LITERAL_HINT)
    if problem:
        return problem
    variants = data["variants"]
    order = data.get("variant_order")
    if order is not None and sorted(order) != sorted(variants):
        return variant_order_problem(order, variants)
    problem = _loss_scale_problem(data.get("reference") or {}, "the reference")
    for variant, entry in variants.items():
        problem = problem or _loss_scale_problem(entry, f"variant {variant!r}") or _lowbit_problem(entry, variant)
        seen: set[tuple[str, str]] = set()
        for record in entry["records"]:
            key = (record["name"], record["kind"])
            if key in seen:
                problem = problem or f"variant {variant!r}: tensor {key[0]!r} ({key[1]}) is listed twice"
            seen.add(key)
    return problem


def _loss_scale_problem(entry: dict[str, Any], where: str) -> str | None:
    """A recorded loss scale (the schema holds it to a positive number or null) is finite and a power of two."""
    scale = (entry.get("run") or {}).get("loss_scale")
    if scale is None or (math.isfinite(scale) and math.frexp(scale)[0] == 0.5):
        return None
    return f"{where}: field 'loss_scale' is {scale!r}, not a finite positive power of two (or null)"


def _lowbit_problem(entry: dict[str, Any], variant: str) -> str | None:
    """A recorded low-bit block (the schema holds its types) counts its module names in 'modules'."""
    lowbit = (entry.get("run") or {}).get("lowbit") or {}
    names = lowbit.get("module_names")
    if names is None or lowbit["modules"] == len(names):
        return None
    return (
        f"variant {variant!r}: field 'run.lowbit.modules' is {lowbit['modules']}, but 'module_names' lists "
        f"{len(names)} modules"
    )


def document(report: PrecisionReport, test_id: str, environment: dict[str, Any]) -> dict[str, Any]:
    """The whole baseline file content for a report."""
    data = payload(report, test_id)
    data["environment"] = json_ready(environment)
    return data


def numbers_unchanged(path: Path, new: dict[str, Any]) -> bool:
    """Whether the file at `path` already holds `new` apart from its environment block, and records the same
    DRIFT_FIELDS (a file lacking one, or measured where one differed, is rewritten: it then says where it holds).
    The commit, the date and the versions outside DRIFT_FIELDS never force a rewrite."""
    from pytest_precision.reports.environment import DRIFT_FIELDS

    try:
        # Strictly: a file holding a key twice reads as the last value and could equal `new`; it is rewritten.
        old = strict_json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError and StrictJsonError too
        return False
    if not isinstance(old, dict):
        return False
    strip = {k: v for k, v in new.items() if k != "environment"}
    if {k: v for k, v in old.items() if k != "environment"} != json.loads(json.dumps(strip)):
        return False
    then, now = old.get("environment"), json.loads(json.dumps(new.get("environment") or {}))
    if not isinstance(then, dict):
        return False
    return all(name in then and then[name] == now.get(name) for name in DRIFT_FIELDS)


def report_from_document(data: dict[str, Any], path: Path) -> PrecisionReport:
    """A PrecisionReport rebuilt from a baseline file's content (for `pytest-precision show` and `diff`)."""
    from pytest_precision.base.records import RunInfo

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
