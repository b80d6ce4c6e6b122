"""Formats below 16 bits on a GPU, run with `pytest tests/gpu --precision-gpu` where CUDA is; skipped otherwise.

fp8 training with torchao's real kernels (torch._scaled_mm) on compute capability 8.9 or higher, fp8 dynamic
quantization (CUDA only), and the same recipes emulated, against each other. No baseline: what must hold on any
recent GPU.
"""

from __future__ import annotations

import pytest

from conftest import random_tokens, tiny_llama

pytestmark = pytest.mark.precision_gpu
pytest.importorskip("torchao", reason='the lowbit extra: pip install "pytest-precision[lowbit]"')

FP8_TRAINING = ["fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp"]


@pytest.fixture
def batch() -> dict[str, object]:
    ids = random_tokens(batch=2, length=64, seed=0)
    return {"input_ids": ids, "labels": ids}


def fp8_capable() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def test_fp8_training_runs_torchao_kernels_where_the_gpu_has_them(precision, precision_device, batch):
    assert precision_device == "cuda"
    report = precision.run(tiny_llama(), batch, variants=["bf16", *FP8_TRAINING])
    for name in FP8_TRAINING:
        assert report.runs[name].lowbit["kernels"] == ("native" if fp8_capable() else "emulated")
        assert report.runs[name].lowbit["modules"] == 28  # every Linear but the head
        for record in report.records(name):
            assert record.nonfinite == 0, (name, record.name, record.kind)
        # e4m3 keeps 3 mantissa bits to bf16's 7: several times bf16's error at the output, below 20%.
        head = report.get(name, "lm_head").rms_rel
        assert 2 * report.get("bf16", "lm_head").rms_rel < head < 0.2, name


def test_native_fp8_matches_torchaos_emulation(precision, batch):
    """The same casts, emulated: the errors agree within what another matmul's accumulation moves."""
    from pytest_precision import Variant, compare

    if not fp8_capable():
        pytest.skip("fp8 matmuls need compute capability 8.9 or higher")
    model = tiny_llama()
    native = precision.run(model, batch, variants=["fp8_rowwise"])
    # torchao emulates where fp8 matmuls are missing: the CPU.
    emulated = compare(model, batch, [Variant("fp8_rowwise", dtype="bfloat16", fp8_training="rowwise")], device="cpu")
    assert emulated.runs["fp8_rowwise"].lowbit["kernels"] == "emulated"
    for a, b in zip(native.records("fp8_rowwise", "fw"), emulated.records("fp8_rowwise", "fw"), strict=True):
        assert a.rms_rel == pytest.approx(b.rms_rel, rel=0.25), a.name


def test_fp8_dynamic_quantization_runs_on_fp8_gpus_and_skips_elsewhere(precision, batch):
    if not fp8_capable():
        with pytest.raises(pytest.skip.Exception, match=r"compute capability 8\.9 or higher"):
            precision.run(tiny_llama(), batch, variants=["fp8_dynamic"], backward=False)
        return
    report = precision.run(tiny_llama(), batch, variants=["fp8_weight_only", "fp8_dynamic", "int8_weight_only"])
    assert report.records("fp8_dynamic", "bw") == []  # quantized inference: forward only
    head = {name: report.get(name, "lm_head").rms_rel for name in report.variants}
    # Casting the activations too adds error to fp8 weights alone; int8 per-row weights keep more bits.
    assert head["int8_weight_only"] < head["fp8_weight_only"] <= head["fp8_dynamic"] < 0.2
