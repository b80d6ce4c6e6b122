"""Compiled variants under pytest: gated like any variant, what they compiled gated too, and Inductor skipped with
the reason on a CPU without a C++ compiler."""

from __future__ import annotations

import json

from plugin_testing import baseline_file, failure, output, project, run

COMPILED_TESTS = """
import os

import torch

from pytest_precision import Variant
from tinymodel import Block, run


def test_compiled(precision, assert_precision_within, monkeypatch):
    if os.environ.get("TINY_GRAPH_BREAK"):  # a planted change: a graph break in every block's forward
        original = Block.forward

        def broken(self, *args, **kwargs):
            torch._dynamo.graph_break()
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Block, "forward", broken)
    assert_precision_within(run(precision, variants=[Variant("fp32_dynamo", compile="eager")]))


def test_inductor(precision, assert_precision_within):
    assert_precision_within(run(precision, variants=["bf16_compiled"]))
"""


def test_what_a_variant_compiled_is_gated_and_inductor_skips_without_a_compiler(pytester, monkeypatch):
    project(pytester, monkeypatch, test_compile_facts=COMPILED_TESTS)
    monkeypatch.delenv("TINY_GRAPH_BREAK", raising=False)
    # No C++ compiler here (as pretended): the Inductor variant is skipped with the reason, before any run.
    import torch._inductor.cpp_builder as cpp_builder

    def no_compiler() -> str:
        raise RuntimeError("Failed to find C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    written = run(pytester, "--update-baselines", "-rs")
    written.assert_outcomes(passed=1, skipped=1)
    assert "'bf16_compiled': Inductor compiles C++ on a CPU and found no C++ compiler" in output(written)
    document = json.loads(baseline_file(pytester, "test_compile_facts", "test_compiled").read_text())
    compiled = document["variants"]["fp32_dynamo"]["run"]["compiled"]
    assert compiled["backend"] == "eager" and compiled["graph_breaks"] == 0 and compiled["graphs_per_call"] == 1
    assert compiled["regions"] == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm"]  # the default selection
    # pytester imports tinymodel anew in each in-process run, as autoreload would: each run compiles it afresh.
    run(pytester, "-k", "not inductor").assert_outcomes(passed=1, deselected=1)
    # The same numbers (the eager backend), other code: the gate says what changed.
    monkeypatch.setenv("TINY_GRAPH_BREAK", "1")
    result = run(pytester, "-k", "not inductor")
    result.assert_outcomes(failed=1, deselected=1)
    section = failure(result, "test_compiled")
    assert section[0] == "compilation changed (1 variant): the run did not run the code its baseline measured", section
    assert section[1].startswith("  variant 'fp32_dynamo': the baseline's run had 0 graph break(s), this run "), section
    assert "graph_break" in section[1].partition("this run ")[2]  # the reason, in dynamo's words
    assert not any(line.startswith("precision regressed") for line in section)
