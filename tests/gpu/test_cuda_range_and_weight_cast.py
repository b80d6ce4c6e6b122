"""GPU checks of range statistics and weight-cast rows, run with `pytest tests/gpu --precision-gpu` on a machine
with CUDA; skipped otherwise. No baseline: what must hold on any recent GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import random_tokens, tiny_llama
from pytest_precision.numbers.range_stats import range_stats

pytestmark = pytest.mark.precision_gpu


def test_range_statistics_on_cuda_equal_the_cpu_count(precision, precision_device):
    """The counts are exact comparisons, so a CUDA reference gives the CPU's numbers for the same tensor, and
    every record carries them."""
    assert precision_device == "cuda"
    values = torch.logspace(-30, 6, 10_000, dtype=torch.float32) * torch.randn(10_000).sign()
    for dtype in (torch.float16, torch.bfloat16):
        for scale in (1.0, 2.0**16):
            assert range_stats(values.cuda(), dtype, scale=scale) == range_stats(values, dtype, scale=scale)
    ids = random_tokens(batch=2, length=64, seed=0)
    report = precision.run(tiny_llama(), {"input_ids": ids, "labels": ids}, variants=["fp16"], range_stats=True)
    rows = [r for r in report.records("fp16") if r.kind in ("fw", "bw", "grad")]
    assert rows and all(r.underflow_frac is not None and 0 <= r.underflow_frac <= 1 for r in rows)


def test_weight_cast_rows_on_cuda(precision, precision_device):
    assert precision_device == "cuda"
    ids = random_tokens(batch=2, length=64, seed=0)
    report = precision.run(
        tiny_llama(), {"input_ids": ids, "labels": ids}, variants=["fp32", "bf16", "bf16_autocast"], weight_cast=True
    )
    assert all(r.max_abs == 0 for r in report.records("fp32", "weight_cast"))
    assert all(r.max_abs == 0 for r in report.records("bf16_autocast", "weight_cast"))
    bf16 = [r.rms_rel for r in report.records("bf16", "weight_cast") if r.rms_rel]
    assert bf16 and all(1e-4 < value < 4e-3 for value in bf16)  # bf16 rounding: 2^-9 relative at most
