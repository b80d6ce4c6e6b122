"""What a compiled run compiled is part of its gate (gate.compile_check): each gated field's change is named, the
machine's facts are not compared."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_precision.gate.compile_check import GATED_FIELDS, compile_change, compile_changes, recorded_compiled

BLOCK: dict[str, Any] = {
    "backend": "inductor",
    "mode": None,
    "fullgraph": False,
    "dynamic": None,
    "options": {},
    "scope": "regional",
    "numeric_settings": {"emulate_precision_casts": False, "fallback_random": False},
    "regions": ["embed", "layers.0", "layers.1", "norm", "head"],
    "graph_breaks": 0,
    "graphs_per_call": 1,
    "break_reasons": [],
    "cpu_isa": "avx2",
}


def changed(**fields: Any) -> dict[str, Any]:
    return {**BLOCK, **fields}


def test_the_same_compilation_passes_whatever_the_machine() -> None:
    assert compile_change("v", BLOCK, dict(BLOCK)) is None
    assert compile_change("v", BLOCK, changed(cpu_isa="avx512", break_reasons=["other words"])) is None
    assert compile_change("v", None, None) is None
    # A numeric setting another torch lacks is that torch's difference, not the variant's.
    assert compile_change("v", BLOCK, changed(numeric_settings={"emulate_precision_casts": False})) is None
    assert compile_change("v", BLOCK, changed(numeric_settings={**BLOCK["numeric_settings"], "new": 1})) is None


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"scope": "whole"}, "variant 'v': compile scope was 'regional' in the baseline's run, 'whole' in this run"),
        ({"backend": "aot_eager"}, "variant 'v': compile backend was 'inductor' in the baseline's run, 'aot_eager'"),
        ({"mode": "max-autotune"}, "compile mode was None in the baseline's run, 'max-autotune' in this run"),
        ({"fullgraph": True}, "compile fullgraph was False"),
        ({"dynamic": True}, "compile dynamic was None"),
        ({"options": {"fallback_random": True}}, "compile options changed: fallback_random None -> True"),
        (
            {"numeric_settings": {"emulate_precision_casts": True, "fallback_random": False}},
            "compile numeric_settings changed: emulate_precision_casts False -> True",
        ),
        (
            {"regions": ["embed", "layers.0", "norm", "head", "extra"]},
            "the baseline compiled 5 regions, this run 5: missing layers.1; added extra",
        ),
        (
            {"graph_breaks": 2, "break_reasons": ["Call to `torch._dynamo.graph_break()`"]},
            "the baseline's run had 0 graph break(s), this run 2 (Call to `torch._dynamo.graph_break()`)",
        ),
        ({"graphs_per_call": 2}, "compile graphs_per_call was 1 in the baseline's run, 2 in this run"),
    ],
)
def test_each_gated_field_is_named(fields: dict[str, Any], line: str) -> None:
    found = compile_change("v", BLOCK, changed(**fields))
    assert found is not None and line in found


def test_every_gated_field_is_tested() -> None:
    assert set(GATED_FIELDS) == {
        "scope",
        "backend",
        "mode",
        "fullgraph",
        "dynamic",
        "options",
        "numeric_settings",
        "regions",
        "graph_breaks",
        "graphs_per_call",
    }


def test_a_later_field_is_still_compared_after_equal_settings() -> None:
    # Settings that differ only in what one torch lacks are equal: the regions after them still count.
    line = compile_change("v", BLOCK, changed(numeric_settings={"emulate_precision_casts": False}, regions=["embed"]))
    assert line == "variant 'v': the baseline compiled 5 regions, this run 1: missing layers.0, layers.1, norm, head"


def test_many_regions_are_shown_six_then_counted() -> None:
    regions = [f"layers.{i}" for i in range(9)]
    line = compile_change("v", changed(regions=[]), changed(regions=regions))
    assert line == (
        "variant 'v': the baseline compiled 0 regions, this run 9: added layers.0, layers.1, layers.2, layers.3, "
        "layers.4, layers.5, ... 3 more"
    )
    assert compile_change("v", BLOCK, changed(regions=list(reversed(BLOCK["regions"])))) == (
        "variant 'v': the baseline compiled 5 regions, this run 5: the same regions in another order"
    )
    assert compile_change("v", BLOCK, changed(graph_breaks=1)) == (
        "variant 'v': the baseline's run had 0 graph break(s), this run 1"
    )


def test_eager_against_compiled() -> None:
    assert compile_change("v", None, BLOCK) == "variant 'v': the baseline's run was eager, this run is compiled"
    assert compile_change("v", BLOCK, None) == "variant 'v': the baseline's run was compiled, this run is eager"


def test_changes_of_many_variants_in_the_runs_order() -> None:
    recorded = {"a": BLOCK, "b": BLOCK, "gone": BLOCK}
    obtained = {"b": changed(backend="eager"), "new": BLOCK, "a": changed(graph_breaks=1)}
    lines = compile_changes(recorded, obtained)
    assert lines == [
        "variant 'b': compile backend was 'inductor' in the baseline's run, 'eager' in this run",
        "variant 'a': the baseline's run had 0 graph break(s), this run 1",
    ]
    document = {"variants": {"a": {"run": {"compiled": BLOCK}}, "b": {"run": {}}, "c": {}}}
    assert recorded_compiled(document) == {"a": BLOCK, "b": None, "c": None}
