"""Compiled variants on a GPU: Inductor generates Triton kernels there. Run with `pytest tests/gpu --precision-gpu`
on a machine with CUDA (and Triton); skipped otherwise. No baseline: what must hold on any recent GPU."""

from __future__ import annotations

import pytest

from conftest import random_tokens, tiny_llama
from pytest_precision import Variant

pytestmark = pytest.mark.precision_gpu


@pytest.fixture
def batch() -> dict[str, object]:
    ids = random_tokens(batch=2, length=64, seed=0)
    return {"input_ids": ids, "labels": ids}


def test_inductor_triton_bf16_is_measured_block_by_block(precision, precision_device, batch):
    pytest.importorskip("triton", reason="Inductor's GPU code is Triton")
    assert precision_device == "cuda"
    variants = [
        "bf16",
        "bf16_compiled",
        "bf16_compiled_emulated",
        Variant("bf16_dynamo", dtype="bf16", compile="eager"),
    ]
    report = precision.run(tiny_llama(), batch, variants=variants, isolate=True)
    eager = {(r.name, r.kind): r.rms_rel for r in report.records("bf16")}
    compiled = {(r.name, r.kind): r.rms_rel for r in report.records("bf16_compiled")}
    assert set(compiled) == set(eager)
    # Triton's fused kernels: other numbers than eager's in the blocks, forward and backward.
    for kind in ("fw", "bw", "fw_isolated"):
        assert compiled[("model.layers.3", kind)] != eager[("model.layers.3", kind)]
    # Dynamo with the eager backend runs eager's CUDA kernels: eager's numbers exactly.
    assert {(r.name, r.kind): r.rms_rel for r in report.records("bf16_dynamo")} == eager
    facts = report.runs["bf16_compiled"].compiled
    assert facts["graph_breaks"] == 0 and "cpu_isa" not in facts
    assert facts["numeric_settings"]["emulate_precision_casts"] is False
    assert report.compile_costs["bf16_compiled"]["compilations"] >= 6


def test_fp32_inductor_stays_close_to_fp32(precision, precision_device, batch):
    pytest.importorskip("triton", reason="Inductor's GPU code is Triton")
    report = precision.run(tiny_llama(), batch, variants=["fp32_compiled", "bf16"])
    # Reordered fp32 sums: rounding-level differences, far below bf16's.
    assert report.get("fp32_compiled", "lm_head").rms_rel < report.get("bf16", "lm_head").rms_rel / 100
