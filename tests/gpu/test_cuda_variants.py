"""GPU checks, run with `pytest tests/gpu --precision-gpu` on a machine with CUDA; skipped otherwise.

They hold no baseline (none is committed for GPUs): they assert what must be true on any recent GPU.
"""

from __future__ import annotations

import pytest

from conftest import random_tokens, tiny_llama

pytestmark = pytest.mark.precision_gpu


@pytest.fixture
def batch() -> dict[str, object]:
    ids = random_tokens(batch=2, length=64, seed=0)
    return {"input_ids": ids, "labels": ids}


def test_tf32_and_reduced_reduction_change_numbers_on_gpu(precision, precision_device, batch):
    import torch

    assert precision_device == "cuda"
    flags_before = (
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    )
    report = precision.run(tiny_llama(), batch, variants=["fp32", "tf32", "bf16", "fp16", "bf16_reduced_reduction"])
    # fp32 forward is deterministic on CUDA for these kernels: exactly zero error.
    assert all(r.rms_abs == 0 for r in report.records("fp32", "fw"))
    # TF32 (10 mantissa bits in the matmul inputs) is visible on Ampere and later, and far below bf16.
    tf32 = report.get("tf32", "lm_head").rms_rel
    assert 0 < tf32 < report.get("bf16", "lm_head").rms_rel
    assert "cuda.matmul.fp32_precision" not in report.runs["tf32"].backend["no_effect"]
    # bf16 keeps 3 fewer mantissa bits than fp16: roughly 8x the error.
    ratio = report.get("bf16", "lm_head").rms_rel / report.get("fp16", "lm_head").rms_rel
    assert 4 < ratio < 16
    # The run restored the user's flags.
    assert flags_before == (
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    )
