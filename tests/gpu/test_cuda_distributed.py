"""Sharded comparisons on GPUs with nccl (issue 12): one GPU per rank, launched by the precision_distributed
marker with `pytest tests/gpu --precision-gpu`; skipped without --precision-gpu, and by the launcher on a
machine with fewer GPUs than ranks."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pytest_precision import compare, sharded

sys.path.insert(0, str(Path(__file__).parent.parent / "distributed"))
from sharded_models import fsdp_per_layer, mse, tensor_parallel, two_mlps

from conftest import tiny_llama

pytestmark = [pytest.mark.precision_gpu, pytest.mark.precision_distributed(world_size=2)]


def test_fsdp2_on_nccl_measures_the_bf16_reduction(precision_device: str) -> None:
    assert dist.get_backend() == "nccl" and precision_device == f"cuda:{dist.get_rank()}"
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    mine = ids[2 * dist.get_rank() :][:2]
    variants = ["fsdp_bf16", "fsdp_bf16_reduce_bf16"]
    report = compare(
        sharded(tiny_llama(layers=2), fsdp_per_layer),
        {"input_ids": mine, "labels": mine},
        variants,
        device=precision_device,
    )
    assert report.distributed["world_size"] == 2 and report.device.startswith("cuda")
    fp32_reduce, bf16_reduce = (report.records(v, "grad") for v in variants)
    assert statistics.mean(r.rms_rel for r in bf16_reduce) > statistics.mean(r.rms_rel for r in fp32_reduce)
    for record in report.records("fsdp_bf16"):
        assert record.nonfinite == 0 and record.rms_rel is not None and record.rms_rel < 0.05, record.name


def test_tensor_parallel_on_nccl_counts_the_row_parallel_output_once(precision_device: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (2,))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    report = compare(
        sharded(two_mlps(), lambda model, variant: tensor_parallel(model, mesh)),
        x,
        ["bf16", "tf32"],
        loss_fn=mse,
        modules=[r"layers\.\d", r"layers\.\d\.(up|down)"],
        device=precision_device,
    )
    assert report.get("bf16", "layers.0.down").count == 8 * 32
    assert report.get("bf16", "layers.0.up.weight", "grad").shape == (64, 32)
    assert 0 < report.get("tf32", "layers.0.down").rms_rel < report.get("bf16", "layers.0.down").rms_rel
