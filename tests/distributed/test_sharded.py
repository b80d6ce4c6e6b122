"""Comparisons under torch.distributed, each test run on 2 gloo ranks that the precision_distributed marker
launches (a plain `pytest` starts them; under `torchrun --nproc_per_node 2 -m pytest` they run in place).

"One process" below is the same comparison with the process group hidden from the plugin, on the whole
batch and the unsharded model: what the sharded comparison must reproduce on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from sharded_models import (
    fsdp_per_layer,
    mse,
    poison_rows_starting_with_zero,
    rowwise_lm,
    tensor_parallel,
    token_batch,
    two_mlps,
)

import pytest_precision.distributed.ranks as distributed_module
from conftest import requires_transformers_routers, tiny_llama, tiny_moe
from pytest_precision import PrecisionReport, RankFailure, Variant, compare, sharded
from pytest_precision.base.records import Record
from pytest_precision.base.torch_version import torch_version
from pytest_precision.distributed.sharding import FSDP_ON_CPU_SINCE
from pytest_precision.engine import variant_pass

pytestmark = pytest.mark.precision_distributed(world_size=2)

#: FSDP2 runs on the CPU from torch 2.7; on older torch the run refuses it (see the refusal test below).
fsdp_on_cpu = pytest.mark.skipif(torch_version() < FSDP_ON_CPU_SINCE, reason="FSDP2 runs on the CPU from torch 2.7")

IDENTITY = ("name", "kind", "shape", "count", "nonfinite")
FLOATS = [f.name for f in dataclasses.fields(Record) if f.name not in (*IDENTITY, "spread")]


def one_process(run: Callable[[], PrecisionReport]) -> PrecisionReport:
    """`run` with the process group hidden, and the exact (float64) metric pass that sharded runs take."""
    with (
        mock.patch.object(distributed_module, "active", lambda: False),
        mock.patch.object(variant_pass, "fast_pass_applies", lambda reference, variant: False),
    ):
        return run()


def assert_same_numbers(split: PrecisionReport, whole: PrecisionReport, *, rel: float, skip: tuple[str, ...]) -> None:
    assert split.variants == whole.variants
    for variant in whole.variants:
        pairs = [(a, b) for a, b in zip(split.records(variant), whole.records(variant), strict=True)]
        for a, b in pairs:
            if a.kind in skip:
                continue
            assert [getattr(a, f) for f in IDENTITY] == [getattr(b, f) for f in IDENTITY], (variant, a.name)
            for field in FLOATS:
                got, want = getattr(a, field), getattr(b, field)
                if want is None or (isinstance(want, float) and math.isnan(want)):
                    assert got is None or math.isnan(got), (variant, a.name, a.kind, field)
                else:
                    assert got == pytest.approx(want, rel=rel, abs=1e-15), (variant, a.name, a.kind, field)


def every_rank_holds(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def test_data_parallel_numbers_equal_one_process_on_the_whole_batch() -> None:
    model = rowwise_lm()
    ids = token_batch(rows=4)
    ids[:, 0] = torch.tensor([3, 5, 7, 0])  # only sequence 3 (rank 1's) is poisoned by the variant below
    poisoned = Variant("bf16_poisoned", dtype="bfloat16", prepare=poison_rows_starting_with_zero)
    rows = [slice(0, 1), slice(1, 4)][dist.get_rank()]  # uneven: 1 and 3 sequences
    variants: list[Any] = ["bf16", "fp16", poisoned]
    split = compare(model, {"input_ids": ids[rows], "labels": ids[rows]}, variants, backward=False)
    whole = one_process(lambda: compare(model, {"input_ids": ids, "labels": ids}, variants, backward=False))
    # The loss row is the mean of the ranks' losses (as DDP reports it), not the whole batch's.
    assert_same_numbers(split, whole, rel=1e-9, skip=("loss",))
    assert split.get("bf16", "blocks.1").shape == (4, 12, 16)
    logprob = split.get("bf16", "logprob", "logprob")
    assert logprob.count == 4 * 11 and logprob.kl_mean is not None and logprob.top1_agreement is not None
    assert split.get("bf16_poisoned", "blocks.1").nonfinite == 12 * 16  # rank 0 sees rank 1's NaN too
    assert split.nonfinite_origin == whole.nonfinite_origin == {"bf16_poisoned": "blocks.1 (fw)"}
    as_text = json.dumps(split.to_dict(), sort_keys=True)  # text: NaN equals NaN
    assert every_rank_holds(as_text) == [as_text] * 2


def test_an_unsharded_model_gets_its_gradients_averaged_over_the_ranks_as_ddp_does() -> None:
    model = rowwise_lm()
    ids = token_batch(rows=4)
    half = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)  # equal halves: the mean of means is the mean
    split = compare(model, {"input_ids": ids[half], "labels": ids[half]}, ["bf16"])
    whole = one_process(lambda: compare(model, {"input_ids": ids, "labels": ids}, ["bf16"]))
    for name, parameter in model.named_parameters():
        got, want = split.get("bf16", name, "grad"), whole.get("bf16", name, "grad")
        assert (got.shape, got.count) == (want.shape, want.count) == (tuple(parameter.shape), parameter.numel())
        # The fp32 reference's own gradient: one process's, up to the order of the sums.
        assert got.ref_rms == pytest.approx(want.ref_rms, rel=1e-5), name
    assert split.get("bf16", "loss", "loss").count == 2  # each rank's loss


@fsdp_on_cpu
def test_fsdp2_gradients_match_one_process_within_what_the_reduction_changes() -> None:
    model = tiny_llama(layers=2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    half = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    split = compare(sharded(model, fsdp_per_layer), {"input_ids": ids[half], "labels": ids[half]}, ["bf16"])
    # The caller's model is left as it was: each run sharded a copy.
    assert type(model).__name__ == "LlamaForCausalLM" and not any(m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(p.grad is None and type(p).__name__ != "DTensor" for p in model.parameters())
    whole = one_process(lambda: compare(model, {"input_ids": ids, "labels": ids}, ["bf16"]))
    # Sharded gradients are read after backward, in parameter order; one process's as autograd accumulates them.
    sharded_grads = sorted(split.records("bf16", "grad"), key=lambda r: r.name)
    whole_grads = sorted(whole.records("bf16", "grad"), key=lambda r: r.name)
    assert [(r.name, r.shape, r.count) for r in sharded_grads] == [(r.name, r.shape, r.count) for r in whole_grads]
    assert split.get("bf16", "model.embed_tokens.weight", "grad").shape == (256, 64)  # whole, not a shard
    # Each rank's bf16 gradient is rounded before FSDP2 averages the two (in bf16: the parameters' dtype), where
    # one process rounds the whole batch's once: a rounding of the same size as the error measured, so single
    # tensors move (measured on this model: 0.94x to 1.09x) while the typical error holds (median ratio 1.02).
    ratios = [a.rms_rel / b.rms_rel for a, b in zip(sharded_grads, whole_grads, strict=True)]
    assert 0.9 < statistics.median(ratios) < 1.1, ratios
    assert all(0.5 < ratio < 2.0 for ratio in ratios), ratios
    # The forward holds no reduction: the same numbers up to the batch size's kernel choices.
    assert_same_numbers(dataclasses.replace(split), whole, rel=1e-5, skip=("grad", "bw", "loss", "logprob"))


@fsdp_on_cpu
def test_bf16_gradient_reduction_costs_more_than_fp32_reduction() -> None:
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    half = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    variants = ["fsdp_bf16", "fsdp_bf16_reduce_bf16"]
    report = compare(sharded(model, fsdp_per_layer), {"input_ids": ids[half], "labels": ids[half]}, variants)
    fp32_reduce, bf16_reduce = (report.records(v, "grad") for v in variants)
    # The forward and the activations' gradients do not reduce across ranks: identical.
    for kind in ("fw", "bw", "logprob"):
        assert [r.rms_rel for r in report.records(variants[0], kind)] == [
            r.rms_rel for r in report.records(variants[1], kind)
        ]
    larger = [b.rms_rel > a.rms_rel for a, b in zip(fp32_reduce, bf16_reduce, strict=True)]
    assert sum(larger) >= 0.8 * len(larger), larger
    assert statistics.mean(r.rms_rel for r in bf16_reduce) > statistics.mean(r.rms_rel for r in fp32_reduce)
    assert report.distributed == {"world_size": 2, "mesh": [2], "mesh_dims": None}


def test_tensor_parallel_mlp_measures_the_row_parallel_reduction() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = two_mlps()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))  # the same input on every rank
    modules = [r"layers\.\d", r"layers\.\d\.(up|down)"]
    options: dict[str, Any] = {"loss_fn": mse, "modules": modules}
    split = compare(sharded(model, lambda m, v: tensor_parallel(m, mesh)), x, ["bf16"], **options)
    whole = one_process(lambda: compare(model, x, ["bf16"], **options))
    down = split.get("bf16", "layers.0.down")
    assert down.count == 8 * 32  # replicated over the two ranks after the reduction: counted once
    assert split.get("bf16", "layers.0.up").count == 8 * 64  # column shards: both count
    assert split.get("bf16", "layers.0.up.weight", "grad").shape == (64, 32)
    assert split.get("bf16", "layers.0.down.weight", "grad").shape == (32, 64)
    counts = [sorted((r.kind, r.name, r.count) for r in report.records("bf16")) for report in (split, whole)]
    assert counts[0] == counts[1]
    # The row-parallel output is two bf16 partial products summed (in bf16) instead of one fp32-accumulated
    # matmul rounded once: the same size of error, not the same bits.
    assert 0.5 < down.rms_rel / whole.get("bf16", "layers.0.down").rms_rel < 2.0
    up = split.get("bf16", "layers.0.up")
    assert up.rms_rel == pytest.approx(whole.get("bf16", "layers.0.up").rms_rel, rel=1e-6)  # no reduction
    assert split.distributed["mesh_dims"] == ["tp"]


def test_a_reference_not_finite_on_one_rank_fails_every_rank() -> None:
    model = rowwise_lm()
    poison_rows_starting_with_zero(model)  # the user's model itself: the reference is poisoned
    ids = token_batch(rows=2, seed=3)
    ids[:, 0] = torch.tensor([4, 0]) if dist.get_rank() == 1 else torch.tensor([4, 5])
    expected = (
        r"^every rank failed: ModelRunError: on rank\(s\) 1: the fp32 reference is not finite: NaN/Inf first appear "
        r"in blocks\.1 \(fw\)"
    )
    # Forward only: rank 0's own tensors are all finite (averaged gradients would carry rank 1's NaN to it).
    with pytest.raises(RankFailure, match=expected):
        compare(model, {"input_ids": ids, "labels": ids}, ["bf16"], backward=False)


@pytest.mark.skipif(torch_version() >= FSDP_ON_CPU_SINCE, reason="this torch runs FSDP2 on the CPU")
def test_fsdp2_on_the_cpu_is_refused_before_torch_2_7_naming_the_version() -> None:
    model = tiny_llama(layers=2)
    ids = token_batch(rows=2)
    with pytest.raises(RankFailure, match=r"FSDP2 \(fully_shard\) runs on the CPU from torch 2\.7; this is torch 2\."):
        compare(sharded(model, fsdp_per_layer), {"input_ids": ids, "labels": ids}, ["bf16"])


def test_an_error_on_one_rank_is_raised_on_every_rank_with_its_message() -> None:
    def refuse_on_rank_1(model: torch.nn.Module) -> torch.nn.Module:
        if dist.get_rank() == 1:
            raise ValueError("no bf16 kernels on this rank")
        return model

    ids = token_batch(rows=2)
    variant = Variant("bf16_refused", dtype="bfloat16", prepare=refuse_on_rank_1)
    with pytest.raises(RankFailure, match=r"rank 1 failed: ModelRunError: .*no bf16 kernels on this rank"):
        compare(rowwise_lm(), {"input_ids": ids, "labels": ids}, ["bf16", variant])


@fsdp_on_cpu
@pytest.mark.precision_distributed(world_size=4)
def test_fsdp2_over_tensor_parallel_on_a_2x2_mesh_gives_one_process_numbers() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def shard(model: torch.nn.Module, variant: Variant) -> torch.nn.Module:
        tensor_parallel(model, mesh["tp"])
        for layer in model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh["dp"], mp_policy=variant.mp_policy())
        fully_shard(model, mesh=mesh["dp"], mp_policy=variant.mp_policy())
        return model

    model = two_mlps()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    mine = x[4 * mesh.get_local_rank("dp") :][:4]  # data-parallel rows; the same on both tensor-parallel ranks
    options: dict[str, Any] = {"loss_fn": mse}
    split = compare(sharded(model, shard), mine, ["fsdp_bf16"], **options)
    whole = one_process(lambda: compare(model, x, ["bf16"], **options))
    assert split.distributed == {"world_size": 4, "mesh": [2, 2], "mesh_dims": ["dp", "tp"]}
    counts = [
        sorted((r.kind, r.name, r.count) for r in report.records(variant) if r.kind != "loss")
        for report, variant in ((split, "fsdp_bf16"), (whole, "bf16"))
    ]
    assert counts[0] == counts[1]  # every element once: rows over dp, shards over tp, replicas deduplicated
    assert split.get("fsdp_bf16", "loss", "loss").count == 2  # one loss per data-parallel group
    grads = {r.name: r for r in split.records("fsdp_bf16", "grad")}
    assert grads["layers.0.up.weight"].shape == (64, 32) and grads["layers.1.down.bias"].shape == (32,)
    for name, record in grads.items():  # as large as one process's bf16 gradient errors (see the FSDP2 test)
        ratio = record.rms_rel / whole.get("bf16", name, "grad").rms_rel
        assert 0.5 < ratio < 2.0, (name, ratio)
    as_text = json.dumps(split.to_dict(), sort_keys=True)
    assert every_rank_holds(as_text) == [as_text] * 4


@requires_transformers_routers
def test_moe_routing_is_refused_when_asked_for_and_off_otherwise_under_torch_distributed() -> None:
    """Routing rows are measured in one process: asked for (replay, or Routers) under torch.distributed, every rank
    refuses with the reason; found automatically, a sharded MoE runs without routing rows, its other rows as ever."""
    ids = token_batch(rows=2)
    batch = {"input_ids": ids, "labels": ids}
    with pytest.raises(RankFailure, match=r"routing rows and routing replay are measured in one process, not under "):
        compare(tiny_moe(seed=0), batch, ["bf16_replay"])
    report = compare(tiny_moe(seed=0), batch, ["bf16"])
    assert report.records("bf16", "routing") == []
    assert report.records("bf16", "fw") and report.distributed["world_size"] == 2


@fsdp_on_cpu
@requires_transformers_routers
def test_an_fsdp_sharded_moe_runs_without_routing_rows() -> None:
    ids = token_batch(rows=2)
    report = compare(sharded(tiny_moe(seed=0), fsdp_per_layer), {"input_ids": ids, "labels": ids}, ["bf16"])
    assert report.records("bf16", "routing") == [] and report.records("bf16", "grad")
