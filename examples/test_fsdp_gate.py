"""A sharded precision gate: the bundled tiny Llama (tests/data/tiny-llama) under FSDP2 on 2 ranks (gloo on
CPU), each rank with its own rows of the batch; bf16 compute over fp32 master weights, with the gradients
reduce-scattered in fp32 and in bf16, held against baselines/examples/test_fsdp_gate/.

    pytest examples/test_fsdp_gate.py --precision-tables            # the marker launches the 2 ranks
    torchrun --nproc_per_node 2 -m pytest examples/test_fsdp_gate.py  # or torchrun does
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import pytest_precision
from conftest import load_tiny_llama, random_tokens
from pytest_precision.base.torch_version import torch_version
from pytest_precision.distributed.sharding import FSDP_ON_CPU_SINCE


def shard(model: Any, variant: pytest_precision.Variant) -> None:
    """FSDP2 as a training script applies it: each decoder layer, then the root, with the variant's policy."""
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=variant.mp_policy())
    fully_shard(model, mp_policy=variant.mp_policy())


@pytest.mark.skipif(torch_version() < FSDP_ON_CPU_SINCE, reason="FSDP2 runs on the CPU from torch 2.7")
@pytest.mark.precision_distributed(world_size=2)
def test_fsdp_mixed_precision(precision, assert_precision_within):
    ids = random_tokens(batch=4, length=64, seed=0)
    mine = ids[2 * dist.get_rank() :][:2]  # this rank's rows
    variants = ["fsdp_bf16", "fsdp_bf16_reduce_bf16"]
    report = precision.run(
        pytest_precision.sharded(load_tiny_llama(), shard), {"input_ids": mine, "labels": mine}, variants
    )
    assert_precision_within(report)
    # The reduction dtype changes the parameter gradients only, and reducing in bf16 costs precision.
    assert [r.rms_rel for r in report.records("fsdp_bf16", "fw")] == [
        r.rms_rel for r in report.records("fsdp_bf16_reduce_bf16", "fw")
    ]
    fp32_reduce, bf16_reduce = (statistics.mean(r.rms_rel for r in report.records(v, "grad")) for v in variants)
    assert bf16_reduce > fp32_reduce
