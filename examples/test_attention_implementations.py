"""Attention implementations: SDPA against eager, in fp32 (kernel differences alone) and in bf16.

pytest examples/test_attention_implementations.py --precision-tables
"""

from __future__ import annotations

from conftest import tiny_llama, trained_lm_text_batch


def test_eager_against_sdpa(precision, assert_precision_within):
    model = tiny_llama()  # built with eager attention: the reference
    report = precision.run(model, trained_lm_text_batch(length=64), variants=["fp32_sdpa", "bf16_eager", "bf16_sdpa"])
    assert_precision_within(report)
    # In fp32 the two kernels differ only by rounding order: far below bf16's error.
    assert max(r.rms_rel for r in report.records("fp32_sdpa")) < 1e-5
    assert report.get("fp32_sdpa", "lm_head").rms_rel < report.get("bf16_eager", "lm_head").rms_rel / 100
