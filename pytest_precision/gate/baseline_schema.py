"""The published JSON Schema of baseline files (schemas/baseline.v<N>.schema.json, one per schema_version), and
the one-line message of the first place a document breaks it.

The schema says what a field holds; a message says where, in the words a reader of the file uses: the
variant, the tensor (name and kind) and the field, then what the field should be (the schema's own
`description` of it). Another tool can validate a baseline with the schema alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

#: A field's place in the document, as jsonschema gives it.
Path = Sequence[str | int]

#: The order in which a record's fields are reported when several are wrong: who it is, then its counts, then
#: what is missing, then its metrics.
_RECORD_FIELD_ORDER = ("name", "kind", "shape", "count", "nonfinite", "<required>")


@cache
def schema(version: int = 1) -> dict[str, Any]:
    """The JSON Schema of baseline files of `version` (as published in the package)."""
    text = resources.files("pytest_precision.gate").joinpath(f"schemas/baseline.v{version}.schema.json").read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded


@cache
def _validator(version: int) -> Any:
    import jsonschema

    base = jsonschema.Draft202012Validator
    # JSON Schema counts 2.0 as an integer; a count or a dimension written 2.0 did not come from this package.
    checker = base.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool)
    )
    return jsonschema.validators.extend(base, type_checker=checker)(schema(version))


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages: 'a string', 'null', 'a list', ..."""
    if value is None:
        return "null"
    names = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", int: "a number"}
    return names.get(type(value), "a number" if isinstance(value, float) else type(value).__name__)


def _field_text(definition: str, field: str, version: int) -> str:
    """The schema's description of a field of a record (`definition` "record") or of the document ("")."""
    tree = schema(version)
    properties = tree["$defs"][definition]["properties"] if definition else tree["properties"]
    entry = properties[field]
    if "description" not in entry:
        entry = tree["$defs"][entry["$ref"].rsplit("/", 1)[1]]
    return str(entry["description"])


def _missing_field(error: Any) -> str:
    """The property a `required` error names."""
    return str(error.message.split("'")[1])


def _sort_key(error: Any) -> tuple[Any, ...]:
    """Document order: shallower places first; within one record, its fields in _RECORD_FIELD_ORDER."""
    path = list(error.absolute_path)
    if len(path) >= 4 and path[0] == "variants" and path[2] == "records":
        field = "<required>" if error.validator == "required" and len(path) == 4 else str(path[4] if path[4:] else "")
        rank = _RECORD_FIELD_ORDER.index(field) if field in _RECORD_FIELD_ORDER else len(_RECORD_FIELD_ORDER)
        return (1, [str(p) for p in path[:4]], rank, len(path))
    return (0, len(path), [str(p) for p in path])


def schema_problem(data: dict[str, Any], *, literal: type[str], literal_hint: str, version: int = 1) -> str | None:
    """What is wrong with `data` against the schema, in one line (None when it conforms). `literal` is the type
    the reader gives NaN / Infinity literals (a str subclass), named as such with `literal_hint`."""
    errors = sorted(_validator(version).iter_errors(data), key=_sort_key)
    return _message(errors[0], data, literal, literal_hint, version) if errors else None


def _message(error: Any, data: dict[str, Any], literal: type[str], literal_hint: str, version: int) -> str:
    path = list(error.absolute_path)
    if error.validator == "required" and not path:
        field = _missing_field(error)
        return f"'{field}' is null, not {_field_text('', field, version)}"
    if len(path) == 1 or path[0] not in ("reference", "variants"):  # a field of the document, or inside one
        field, value = str(path[0]), data[path[0]]
        if field == "variants":
            return f"'variants' is {json_type(value)}, not an object of variants"
        if field == "variant_order":
            return variant_order_problem(value, data.get("variants") or {})
        return f"field {field!r} is {json_type(value)}, not {_field_text('', field, version)}"
    where = "the reference" if path[0] == "reference" else f"variant {path[1]!r}"
    inner = path[1:] if path[0] == "reference" else path[2:]
    block = data[path[0]] if path[0] == "reference" else data["variants"][path[1]]
    if not inner:
        if error.validator == "required":
            return f"{where}: 'records' is null, not a list of records"
        return f"{where} is {json_type(block)}, not an object"
    if inner[0] in ("spec", "run") and len(inner) == 1:
        return f"{where}: {inner[0]!r} is {json_type(block[inner[0]])}, not an object"
    if inner[0] == "run" and inner[1] == "loss_scale":
        scale = block["run"][inner[1]]
        return f"{where}: field {inner[1]!r} is {scale!r}, not a finite positive power of two (or null)"
    if inner[0] == "run":  # another field of a run (lowbit): its whole value against the schema's description
        value = block["run"][inner[1]]
        text = str(schema(version)["$defs"]["run"]["properties"][inner[1]]["description"])
        return f"{where}: field 'run.{inner[1]}' is {_shown(value)}, not {text}"
    if len(inner) == 1:  # 'records'
        return f"{where}: 'records' is {json_type(block['records'])}, not a list of records"
    index = int(inner[1])
    record = block["records"][index]
    if len(inner) == 2 and error.validator != "required":
        return f"{where}, records[{index}] is {json_type(record)}, not an object"
    name, kind = record.get("name"), record.get("kind")
    if not isinstance(name, str):
        return f"{where}, records[{index}]: field 'name' is {json_type(name)}, not a string"
    if len(inner) == 2:  # a field is missing
        missing = _missing_field(error)
        if missing == "kind":
            return f"{where}, tensor {name!r}: field 'kind' is None, not {_field_text('record', 'kind', version)}"
        return f"{where}, tensor {name!r} ({kind}): field {missing!r} is missing"
    field = str(inner[2])
    value = record[field]
    if field == "kind":
        return f"{where}, tensor {name!r}: field 'kind' is {value!r}, not {_field_text('record', 'kind', version)}"
    shown = f"{where}, tensor {name!r} ({kind}): field {field!r}"
    if isinstance(value, literal):
        return f"{shown} holds the literal {value}, {literal_hint}"
    # A metric that is no number at all is named as such before what its range should be (a fraction, ...).
    not_a_number = isinstance(value, (list, dict)) or (isinstance(value, str) and value not in ("inf", "-inf"))
    if field not in _RECORD_FIELD_ORDER and not_a_number:
        return f"{shown} is {value!r}, not {schema(version)['$defs']['metric']['description']}"
    return f"{shown} is {value!r}, not {_field_text('record', field, version)}"


def _shown(value: Any) -> str:
    """A value for a message, cut when long."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:100]}... ({json_type(value)})"


def variant_order_problem(order: Any, variants: Any) -> str:
    """The message of a 'variant_order' that does not list each variant once."""
    return f"'variant_order' {order!r} does not list each variant of 'variants' once ({', '.join(variants)})"


__all__ = ["json_type", "schema", "schema_problem", "variant_order_problem"]
