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
    section = failure(result, "test_fp8")
    # What the variant measures changed (the recipe): said first, then the numbers' regression.
    assert section[:2] == [
        "low-bit conversion changed (1 variant): the run did not measure what its baseline measured",
        "  variant 'fp8_rowwise': the baseline's format was fp8 training, rowwise recipe, this run's is fp8 "
        "training, tensorwise recipe",
    ], section
    regressed = [line for line in section if line.startswith("precision regressed: ")]
    assert regressed and "first: fp8_rowwise blocks." in regressed[0], section


FEWER_MODULES_TESTS = """
import os

from torch import nn

from tinymodel import tiny_batch, tiny_model


class SameLinear(nn.Module):
    \"\"\"What nn.Linear computes, under another class: fp8 training converts nn.Linear modules only.\"\"\"

    def __init__(self, linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


def model():
    built = tiny_model()
    if os.environ.get("TINY_FEWER_LINEAR"):  # 3 of the 4 nn.Linear modules (3 blocks and the head) replaced
        for block in built.blocks:
            block.lin = SameLinear(block.lin)
    return built


def test_fp8(precision, assert_precision_within):
    # The scalar loss's error moves either way by chance; every other tensor's falls with fewer fp8 modules.
    report = precision.run(model(), tiny_batch(), variants=["fp8_rowwise"])
    assert_precision_within(report, tolerances={"loss": {"rtol": float("inf")}})
"""


def test_a_variant_that_converts_fewer_modules_fails_naming_them(pytester, monkeypatch):
    """Its error falls (fewer fp8 casts): without the module gate it passed as "precision improved, tighten"."""
    import json

    project(pytester, monkeypatch, test_fewer=FEWER_MODULES_TESTS)
    monkeypatch.delenv("TINY_FEWER_LINEAR", raising=False)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_fewer", "test_fp8")
    lowbit = json.loads(path.read_text())["variants"]["fp8_rowwise"]["run"]["lowbit"]
    assert lowbit["modules"] == 4 and lowbit["module_names"] == ["blocks.0.lin", "blocks.1.lin", "blocks.2.lin", "head"]
    run(pytester).assert_outcomes(passed=1)
    monkeypatch.setenv("TINY_FEWER_LINEAR", "1")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_fp8")
    assert section[:2] == [
        "low-bit conversion changed (1 variant): the run did not measure what its baseline measured",
        "  variant 'fp8_rowwise': the baseline's fp8 training converted 4 modules, this run 1: missing "
        "blocks.0.lin, blocks.1.lin, blocks.2.lin",
    ], section
    assert "Baseline: baselines/test_fewer/test_fp8.cpu.json" in section
    assert "precision improved" not in output(result)
    # A baseline from before module names were recorded: the counts are compared.
    document = json.loads(path.read_text())
    del document["variants"]["fp8_rowwise"]["run"]["lowbit"]["module_names"]
    path.write_text(json.dumps(document))
    old = failure(run(pytester), "test_fp8")
    assert old[1] == (
        "  variant 'fp8_rowwise': the baseline's fp8 training converted 4 modules, this run 1 (the baseline "
        "records no module names: refresh the baseline to record module names)"
    ), old
    monkeypatch.delenv("TINY_FEWER_LINEAR")
    run(pytester).assert_outcomes(passed=1)  # the same count: an old baseline still passes
