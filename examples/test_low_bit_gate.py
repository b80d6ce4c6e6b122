"""Below 16 bits: the bundled tiny Llama under fp8 training (torchao's three recipes, emulated on a CPU, torchao's
kernels on CUDA of compute capability 8.9+), quantized inference (int8 and fp8 weights) and fp8 weight storage,
held against the baselines committed under baselines/examples/. Needs the lowbit extra:

    pip install "pytest-precision[lowbit]"
    pytest examples/test_low_bit_gate.py --precision-tables
"""

from __future__ import annotations

import pytest

from conftest import load_tiny_llama, random_tokens

pytest.importorskip("torchao", reason='the lowbit extra: pip install "pytest-precision[lowbit]"')


@pytest.fixture
def batch() -> dict[str, object]:
    ids = random_tokens(batch=2, length=64, seed=0)
    return {"input_ids": ids, "labels": ids}


def test_tiny_llama_fp8_training(precision, assert_precision_within, batch):
    report = precision.run(load_tiny_llama, batch, variants=["fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp"])
    assert_precision_within(report)
    # The report says which kernels ran: torchao's emulation here, its fp8 matmuls on a recent GPU.
    assert {report.runs[v].lowbit["kernels"] for v in report.variants} <= {"emulated", "native"}


def test_tiny_llama_quantized_inference(precision, assert_precision_within, batch):
    # Forward only: fw, logprob and loss rows; the weights' rows show each dequantized weight's error. Not
    # int8_dynamic: whether a CPU's int8 matmul is exact depends on the CPU (see docs/concepts/low-bit.md).
    variants = ["int8_weight_only", "fp8_weight_only", "fp8_e4m3_weights"]
    report = precision.run(load_tiny_llama, batch, variants=variants, weight_cast=True)
    assert_precision_within(report)
    # int8 per-row weights keep more than fp8's 3 mantissa bits: less error at the output.
    assert report.get("int8_weight_only", "lm_head").rms_rel < report.get("fp8_weight_only", "lm_head").rms_rel
