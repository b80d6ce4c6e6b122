"""Reference sharing on a GPU (issue 5): offloaded captures, the on-device checksum, peak device memory.

Run with `pytest tests/gpu --precision-gpu` on a machine with CUDA; skipped otherwise.
"""

from __future__ import annotations

import copy

import pytest

from conftest import random_tokens, tiny_llama
from pytest_precision import compare, reference
from pytest_precision.engine.references import ReferenceCache

pytestmark = pytest.mark.precision_gpu


@pytest.fixture
def batch() -> dict[str, object]:
    ids = random_tokens(batch=2, length=64, seed=0)
    return {"input_ids": ids, "labels": ids}


def test_offloaded_captures_live_on_the_host_and_give_the_same_records(precision_device, batch):
    model = tiny_llama().to(precision_device)
    kept = reference(model, batch, device=precision_device, offload=True)
    assert all(t.device.type == "cpu" for t in kept.stored.values())
    on_device = compare(model, batch, ["bf16", "fp16"], device=precision_device, offload=False)
    offloaded = compare(kept, variants=["bf16", "fp16"])
    for variant in ("bf16", "fp16"):
        assert offloaded.records(variant) == on_device.records(variant)


def test_the_on_device_checksum_sees_an_in_place_edit(precision_device, batch):
    import torch

    model = tiny_llama().to(precision_device)
    cache = ReferenceCache()
    first = compare(model, batch, ["bf16"], device=precision_device, cache=cache)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 0.5
    edited = compare(model, batch, ["bf16"], device=precision_device, cache=cache)
    fresh = compare(copy.deepcopy(model), batch, ["bf16"], device=precision_device)
    assert edited.records("bf16") == fresh.records("bf16")
    assert edited.records("bf16") != first.records("bf16")


def _peak_bytes(run) -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_peak_device_memory_is_a_bare_run_plus_what_is_compared(precision_device, batch):
    """With offload, the device holds one run's model, activations and gradients plus the tensors being
    compared; the reference run's own fp32 footprint bounds it from below."""
    import torch

    model = tiny_llama(layers=4).to(precision_device)
    inputs = {k: v.to(precision_device) for k, v in batch.items()}

    def bare(dtype: torch.dtype) -> None:
        run_model = copy.deepcopy(model).to(dtype)
        run_model(**inputs).loss.backward()

    bare_fp32 = _peak_bytes(lambda: bare(torch.float32))
    bare_bf16 = _peak_bytes(lambda: bare(torch.bfloat16))
    logits_fp32 = 2 * 64 * model.config.vocab_size * 4
    offloaded = _peak_bytes(lambda: compare(model, batch, ["bf16"], device=precision_device, offload=True))
    print(
        f"peak MiB: bare fp32 {bare_fp32 / 2**20:.1f}, bare bf16 {bare_bf16 / 2**20:.1f}, "
        f"compare offload {offloaded / 2**20:.1f}"
    )
    # The reference run is an fp32 run; the variant run adds one reference tensor at a time (at most the
    # fp32 logits, with their float64 chunk temporaries) to the bf16 run.
    assert offloaded <= 1.25 * max(bare_fp32, bare_bf16 + 4 * logits_fp32)
