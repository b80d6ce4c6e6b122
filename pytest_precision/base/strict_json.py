"""JSON of data files read strictly: a key given twice in one object, or a number beyond the largest float, is an
error naming where it is, instead of Python's "the last key wins" and "1e400 is infinity".

A key twice in one object is what keeping both sides of a merge conflict gives; `json.loads` would keep the last
value silently. `1e400` reads as `inf`, which the file's own rules refuse as a literal (`Infinity`). Both are
found after parsing, with their place in the document, so that a reader can say which record holds them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: A place in a document: object keys and list indices from the top.
JsonPath = tuple[str | int, ...]

#: Integers longer than this many digits are beyond the largest float (about 1.8e308) whatever their digits; the
#: bound also keeps Python's limit on int conversion (4300 digits, a ValueError) out of reach.
_MAX_INT_DIGITS = 309


class StrictJsonError(ValueError):
    """A key twice in one object, or a number beyond the largest float: `path` is the key or element's place,
    `document` what was parsed (the last of a duplicated key's values), for naming the record around it."""

    def __init__(self, path: JsonPath, reason: str, document: Any = None) -> None:
        super().__init__(f"{dotted(path)} {reason}")
        self.path = path
        self.reason = reason
        self.document = document


class _Duplicated(dict[str, Any]):
    """An object holding a key more than once (the last value kept, as json would), and which keys."""

    duplicates: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Overflow:
    """A number in the file that is beyond the largest float, as written."""

    text: str


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    twice: list[str] = []
    for key, _ in pairs:
        if key in seen and key not in twice:
            twice.append(key)
        seen.add(key)
    if not twice:
        return dict(pairs)
    marked = _Duplicated(pairs)
    marked.duplicates = tuple(twice)
    return marked


def _float(text: str) -> float | _Overflow:
    value = float(text)
    # Only "inf" from a finite literal can be infinite here: Infinity / NaN go through parse_constant.
    return _Overflow(text) if value in (float("inf"), float("-inf")) else value


def _int(text: str) -> int | _Overflow:
    digits = text.lstrip("-")
    if len(digits) > _MAX_INT_DIGITS:
        return _Overflow(text)
    value = int(text)
    return _Overflow(text) if abs(value) > sys.float_info.max else value


def loads(text: str, *, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """`json.loads(text)`, raising StrictJsonError at the first key given twice in one object or number beyond the
    largest float (first_problem's order). json.JSONDecodeError and RecursionError as json.loads raises them."""
    data = json.loads(text, object_pairs_hook=_pairs, parse_float=_float, parse_int=_int, parse_constant=parse_constant)
    problem = first_problem(data, ())
    if problem is not None:
        problem.document = data
        raise problem
    return data


def first_problem(value: Any, path: JsonPath) -> StrictJsonError | None:
    """The first key twice or overflowing number under `value` (at `path`): an object's own duplicate keys before
    its contents, which are searched in document order."""
    if isinstance(value, _Overflow):
        shown = value.text if len(value.text) <= 40 else f"{value.text[:20]}...({len(value.text)} characters)"
        return StrictJsonError(path, f"is {shown}, beyond the largest float (it would read as infinity)")
    if isinstance(value, dict):
        for key in getattr(value, "duplicates", ()):
            return StrictJsonError((*path, key), "appears twice in one object (both sides of a merge conflict?)")
        for key, item in value.items():
            found = first_problem(item, (*path, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = first_problem(item, (*path, index))
            if found is not None:
                return found
    return None


def value_at(document: Any, path: JsonPath) -> Any:
    """The value at `path` in `document`, None where the path leads nowhere."""
    for part in path:
        if isinstance(document, dict) and isinstance(part, str):
            document = document.get(part)
        elif isinstance(document, list) and isinstance(part, int) and 0 <= part < len(document):
            document = document[part]
        else:
            return None
    return document


def dotted(path: JsonPath) -> str:
    """`path` as a reader writes it: variants.fp8.records[3].rms_rel ("the document" when empty)."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "the document"


__all__ = ["JsonPath", "StrictJsonError", "dotted", "first_problem", "loads", "value_at"]
