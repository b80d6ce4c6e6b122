"""GPU checks of isolated error and arrangements, run with `pytest tests/gpu --precision-gpu` on a machine with
CUDA; skipped otherwise. No baseline: what must hold on any recent GPU."""

from __future__ import annotations

import math

import pytest

from conftest import load_trained_lm, random_tokens, tiny_llama, trained_lm_text_batch

pytestmark = pytest.mark.precision_gpu


def test_isolated_rows_on_cuda(precision, precision_device):
    assert precision_device == "cuda"
    ids = random_tokens(batch=2, length=64, seed=0)
    report = precision.run(tiny_llama(), {"input_ids": ids, "labels": ids}, variants=["fp32", "bf16"], isolate=True)
    # fp32 forward kernels are deterministic on CUDA: the isolated forward rows are exact, like the propagated ones.
    assert all(r.rms_abs == 0 for r in report.records("fp32", "fw_isolated"))
    for kind in ("fw", "bw", "grad"):
        isolated = report.records("bf16", f"{kind}_isolated")
        assert isolated and all(r.nonfinite == 0 and math.isfinite(r.rms_rel) for r in isolated)
    # Each block adds less than what reaches the last one.
    last = report.records("bf16", "fw")[-1]
    assert report.get("bf16", last.name, "fw_isolated").rms_rel < last.rms_rel


def test_decode_against_full_forward_on_cuda(precision, precision_device):
    """On a GPU, decode runs other kernels than the full forward (one query row, SDPA's decode path): the bf16
    trainer-sampler mismatch is non-zero, and the fp32 arrangement error stays at rounding level."""
    assert precision_device == "cuda"
    batch = trained_lm_text_batch(batch=2, length=128)
    variants = ["fp32_decode", "bf16", "bf16_decode"]
    report = precision.run(load_trained_lm, batch, variants=variants, backward=False)
    assert report.get("fp32_decode", "logprob", "logprob").delta_rms < 1e-4
    mismatch = report.logprob_mismatch([("bf16", "bf16_decode")])
    row = mismatch.get("bf16 vs bf16_decode", "logprob", "logprob")
    assert row.rms_e_diff is not None and row.rms_e_diff > 0
    print(report.format(full=False), mismatch.format(full=False), sep="\n\n")
