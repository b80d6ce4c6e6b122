"""Formats below 16 bits under pytest: gated like bf16, and skipped with the reason where this machine cannot
run them (fp8 matmuls without a GPU that has them)."""

from __future__ import annotations

import pytest
import torch
from plugin_testing import baseline_file, failure, output, project, run

pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")

LOWBIT_TESTS = """
import os

from pytest_precision import Variant
from tinymodel import run


def fp8_variants():
    if os.environ.get("TINY_COARSE_FP8"):  # a planted regression: the blocks' fp8 casts scaled per tensor
        return [Variant("fp8_rowwise", dtype="bfloat16", fp8_training="tensorwise")]
    return ["fp8_rowwise"]


def test_fp8(precision, assert_precision_within):
    assert_precision_within(run(precision, variants=fp8_variants()))


def test_int8(precision, assert_precision_within):
    assert_precision_within(run(precision, variants=["int8_weight_only"]))


def test_fp8_dynamic(precision, assert_precision_within):
    assert_precision_within(run(precision, variants=["fp8_dynamic"]))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA fp8_dynamic may run: the skip is a CPU's")
def test_lowbit_variants_are_gated_and_fp8_matmuls_skip_here(pytester, monkeypatch):
    project(pytester, monkeypatch, test_fp8_gate=LOWBIT_TESTS)
    monkeypatch.delenv("TINY_COARSE_FP8", raising=False)
    written = run(pytester, "--update-baselines", "-rs")
    written.assert_outcomes(passed=2, skipped=1)
    reason = "Float8DynamicActivationFloat8WeightConfig runs fp8 matmuls, which need CUDA of compute capability 8.9"
    assert reason in output(written)
    assert not baseline_file(pytester, "test_fp8_gate", "test_fp8_dynamic").exists()
    import json

    document = json.loads(baseline_file(pytester, "test_fp8_gate", "test_fp8").read_text())
    run_info = document["variants"]["fp8_rowwise"]["run"]
    # 3 blocks and the head: a model without get_output_embeddings() has no head the plugin knows to keep
    assert run_info["lowbit"]["kernels"] == "emulated" and run_info["lowbit"]["modules"] == 4
    assert document["variants"]["fp8_rowwise"]["spec"]["fp8_training"] == "rowwise"
    run(pytester).assert_outcomes(passed=2, skipped=1)
    # A planted regression: the same name, another recipe. The gate names the variant and a layer.
    monkeypatch.setenv("TINY_COARSE_FP8", "1")
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    first = failure(result, "test_fp8")[0]
    assert first.startswith("precision regressed: ") and "first: fp8_rowwise blocks." in first, first
