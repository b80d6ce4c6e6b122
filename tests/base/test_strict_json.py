"""base.strict_json: a key twice in one object and numbers beyond the largest float are errors with their place;
everything else reads as json.loads reads it."""

from __future__ import annotations

import json
import math
import sys

import pytest

from pytest_precision.base import strict_json
from pytest_precision.base.strict_json import StrictJsonError


@pytest.mark.parametrize(
    "text",
    ['{"a": [1, 2.5, {"b": null}], "c": "1e400", "d": -0.0}', "[]", '"x"', "1.7976931348623157e308", "1e-400"],
)
def test_what_json_reads_exactly_reads_the_same(text: str) -> None:
    loaded = strict_json.loads(text)
    assert loaded == json.loads(text) and type(loaded) is type(json.loads(text))
    assert repr(loaded) == repr(json.loads(text))  # plain dicts, floats and ints: no marker type leaks out


@pytest.mark.parametrize(
    ("text", "path", "reason"),
    [
        ('{"a": 1, "a": 2}', ("a",), "appears twice"),
        ('{"a": [0, {"b": {"c": 1, "c": 1}}]}', ("a", 1, "b", "c"), "appears twice"),
        ('{"a": [0, 1e400]}', ("a", 1), "is 1e400, beyond the largest float"),
        ('{"a": -2e308}', ("a",), "is -2e308, beyond"),
        ("[" + "9" * 400 + "]", (0,), "characters), beyond the largest float"),
    ],
)
def test_the_problem_names_its_place(text: str, path: tuple[str | int, ...], reason: str) -> None:
    with pytest.raises(StrictJsonError) as raised:
        strict_json.loads(text)
    assert raised.value.path == path and reason in raised.value.reason


def test_an_integer_just_beyond_the_largest_float_is_refused_and_one_within_reads() -> None:
    largest = int(sys.float_info.max)  # 309 digits
    assert strict_json.loads(str(largest)) == largest and float(largest) == sys.float_info.max
    with pytest.raises(StrictJsonError):
        strict_json.loads(str(largest * 2))
    assert math.isinf(json.loads("1e400"))  # what strict_json guards against


def test_an_objects_own_duplicate_is_named_before_its_contents_then_document_order() -> None:
    with pytest.raises(StrictJsonError) as raised:
        strict_json.loads('{"x": {"y": 1e999}, "w": [1e999], "z": 1, "z": 2}')
    assert raised.value.path == ("z",)
    with pytest.raises(StrictJsonError) as raised:
        strict_json.loads('{"x": {"y": 1e999}, "w": [1e999]}')
    assert raised.value.path == ("x", "y")
    assert strict_json.dotted(("variants", "fp8", "records", 3, "rms_rel")) == "variants.fp8.records[3].rms_rel"
    assert strict_json.value_at(raised.value.document, ("w", 0)) is not None


def test_constants_go_to_the_callers_hook() -> None:
    assert strict_json.loads("[NaN]", parse_constant=lambda name: name) == ["NaN"]
