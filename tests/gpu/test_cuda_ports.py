"""A port on a GPU: torchtune's Llama against transformers' on CUDA (SDPA's flash or memory-efficient kernels there,
where torchtune and transformers may pick different ones). Run with `pytest tests/gpu --precision-gpu` on a machine
with CUDA and torchtune; skipped otherwise. No baseline: what must hold on any recent GPU."""

from __future__ import annotations

import pytest

from conftest import random_tokens, tiny_llama
from pytest_precision import NotSupportedHere, Variant

pytestmark = pytest.mark.precision_gpu


def test_torchtune_agrees_in_fp32_and_matches_transformers_bf16_on_cuda(
    precision, precision_device, assert_port_agrees, assert_port_within
):
    from pytest_precision.ports import torchtune_llama

    try:
        port = torchtune_llama()
    except NotSupportedHere as missing:
        pytest.skip(str(missing))
    assert precision_device == "cuda"
    ids = random_tokens(batch=2, length=64, seed=0)
    variants = [
        "bf16",
        Variant("torchtune_fp32", implementation=port),
        Variant("torchtune_bf16", dtype="bf16", implementation=port, isolate=True),
    ]
    report = precision.run(tiny_llama(), {"input_ids": ids, "labels": ids}, variants=variants)
    # fp32 on CUDA: IEEE matmuls (the plugin pins TF32 off), so the port check holds as on a CPU.
    assert_port_agrees(report, "torchtune_fp32")
    # bf16: the kernels differ more on a GPU than on a CPU, so the factor is looser than the CPU test's 1.3.
    assert_port_within(report, "torchtune_bf16", "bf16", factor=2.0)
    assert report.records("torchtune_bf16", "fw_isolated")
