"""compare(repeats=N): run-to-run spread of rms_rel; nonfinite_origin: where a variant's first NaN/Inf appeared."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from conftest import random_tokens, tiny_llama
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import Record
from pytest_precision.engine.compare import compare
from pytest_precision.engine.variants import Variant
from pytest_precision.reports.report import PrecisionReport

NOISY_BLOCK = 1
#: Two blocks keep the backward passes (the slow part on CPU) short.
LAYERS = 2


def make_batch() -> dict[str, Any]:
    ids = random_tokens()
    return {"input_ids": ids, "labels": ids.clone()}


def urandom_seeds() -> Iterator[int]:
    """Seeds from the OS: a source nothing in the comparison can reseed."""
    while True:
        yield int.from_bytes(os.urandom(4), "little")


def noisy_block(seeds: Iterator[int], block: int = NOISY_BLOCK) -> Callable[[Any], Any]:
    """A `prepare` adding ~1e-3 relative Gaussian noise, drawn with the next seed, to one block's output."""

    def prepare(model: Any) -> Any:
        layer = model.model.layers[block]
        original = layer.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            hidden = output[0] if isinstance(output, tuple) else output
            generator = torch.Generator().manual_seed(next(seeds))
            noise = torch.randn(hidden.shape, generator=generator, dtype=torch.float32)
            scale = 1e-3 * float(hidden.detach().float().pow(2).mean().sqrt())
            hidden = hidden + (noise * scale).to(hidden.dtype)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        layer.forward = forward
        return model

    return prepare


def without_spread(records: list[Record]) -> list[Record]:
    return [dataclasses.replace(r, spread=None) for r in records]


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    model: nn.Module = tiny_llama(layers=LAYERS)
    return model


@pytest.fixture(scope="module")
def single(llama: nn.Module) -> PrecisionReport:
    return compare(llama, make_batch(), ["fp16"])


@pytest.fixture(scope="module")
def repeated(llama: nn.Module) -> PrecisionReport:
    return compare(llama, make_batch(), ["fp16"], repeats=3)


# --- repeats ---------------------------------------------------------------------------------------------


def test_cpu_repeats_have_zero_spread_and_the_same_records(single: PrecisionReport, repeated: PrecisionReport) -> None:
    assert repeated.variants == single.variants
    for variant in repeated.variants:
        records = repeated.records(variant)
        assert {r.kind for r in records} >= {"fw", "bw", "grad", "logprob", "loss"}
        assert all(r.spread == 0.0 for r in records if r.rms_rel is not None)
        assert all(r.spread is None for r in records if r.rms_rel is None)
        assert without_spread(records) == single.records(variant)
        assert all(r.spread is None for r in single.records(variant))
        assert repeated.runs[variant].repeats == 3
        assert single.runs[variant].repeats == 1
        # fp16 is calibrated once; its repeats reuse that loss scale.
        assert repeated.runs[variant].loss_scale == single.runs[variant].loss_scale
    assert repeated.reference.repeats == 3


def test_noisy_variant_has_spread_from_the_noisy_block_on(llama: nn.Module) -> None:
    noisy = Variant("noisy_bf16", dtype="bfloat16", prepare=noisy_block(urandom_seeds()))
    report = compare(llama, make_batch(), [noisy, "bf16"], repeats=3, backward=False)
    forward = report.records("noisy_bf16", "fw")
    names = [r.name for r in forward]
    assert names[0] == "model.embed_tokens"
    first_noisy = names.index(f"model.layers.{NOISY_BLOCK}")
    assert forward[0].spread == 0.0
    for record in forward[1:first_noisy]:
        assert record.spread == 0.0, record.name
    for record in forward[first_noisy:]:
        assert record.spread is not None and record.spread > 0, record.name
        # The spread comes from noise ~1e-3 of the block's output: the same order as its rms_rel or below.
        assert record.spread < 0.1, record.name
    assert report.get("noisy_bf16", "logprob", "logprob").spread > 0  # type: ignore[operator]
    # The deterministic variant beside it is untouched by the other's noise.
    assert all(r.spread == 0.0 for r in report.records("bf16") if r.rms_rel is not None)


def test_variant_spread_equals_max_minus_min_of_single_runs(llama: nn.Module) -> None:
    """With the noise's seeds fixed in order, each pass of repeats=3 is reproduced by a repeats=1 run."""
    seeds = [11, 22, 33]
    batch = make_batch()
    repeated = compare(
        llama,
        batch,
        [Variant("noisy", dtype="bfloat16", prepare=noisy_block(iter(seeds)))],
        repeats=3,
        backward=False,
    )
    singles = [
        compare(llama, batch, [Variant("noisy", dtype="bfloat16", prepare=noisy_block(iter([seed])))], backward=False)
        for seed in seeds
    ]
    for index, record in enumerate(repeated.records("noisy")):
        values = [single.records("noisy")[index].rms_rel for single in singles]
        assert without_spread([record]) == [singles[0].records("noisy")[index]]  # the first pass's record
        if record.rms_rel is None:
            assert record.spread is None
            continue
        assert all(v is not None for v in values)
        assert record.spread == max(values) - min(values)  # type: ignore[type-var,operator]
    spreads = [r.spread for r in repeated.records("noisy", "fw")]
    assert spreads[0] == 0.0 and all(s is not None and s > 0 for s in spreads[NOISY_BLOCK + 1 :])


def test_reference_noise_enters_the_spread(llama: nn.Module) -> None:
    """A non-deterministic reference: a deterministic variant's spread is the largest rms_rel of a reference
    repeat against the reference's first run, computed here as variants against that first run."""
    batch = make_batch()
    reference = Variant("noisy_ref", dtype="float32", prepare=noisy_block(iter([1, 2, 3])))
    repeated = compare(llama, batch, ["fp32"], reference=reference, repeats=3, backward=False)
    independent = compare(
        llama,
        batch,
        [
            Variant("second", dtype="float32", prepare=noisy_block(iter([2]))),
            Variant("third", dtype="float32", prepare=noisy_block(iter([3]))),
        ],
        reference=Variant("first", dtype="float32", prepare=noisy_block(iter([1]))),
        backward=False,
    )
    for record in repeated.records("fp32"):
        others = [independent.get(v, record.name, record.kind).rms_rel for v in ("second", "third")]
        if record.rms_rel is None:
            continue
        assert record.spread == max(o or 0.0 for o in others), (record.name, record.kind)
    assert repeated.get("fp32", "model.embed_tokens").spread == 0.0
    assert repeated.get("fp32", f"model.layers.{NOISY_BLOCK}").spread > 0  # type: ignore[operator]


@pytest.mark.parametrize("repeats", [0, -1, 1.5, "2", True, None])
def test_invalid_repeats(llama: nn.Module, repeats: Any) -> None:
    with pytest.raises(ConfigurationError, match="repeats"):
        compare(llama, make_batch(), ["bf16"], repeats=repeats)


# --- where NaN/Inf started -------------------------------------------------------------------------------

HOT_MODULE = "model.layers.1.mlp.down_proj"


class _Built:
    """A `prepare` that records every model it was given (each run's copy) and applies `change`."""

    def __init__(self, change: Callable[[nn.Module], None]) -> None:
        self.change = change
        self.models: list[nn.Module] = []

    def __call__(self, model: nn.Module) -> nn.Module:
        self.change(model)
        self.models.append(model)
        return model


def overflow_down_proj(model: nn.Module) -> None:
    with torch.no_grad():
        model.get_submodule(HOT_MODULE).weight.mul_(2e6)  # type: ignore[operator]


class _InfiniteGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf


def infinite_gradient_in_down_proj(model: nn.Module) -> None:
    module = model.get_submodule(HOT_MODULE)
    original = module.forward

    def forward(tensor: torch.Tensor) -> torch.Tensor:
        return original(_InfiniteGradient.apply(tensor))  # type: ignore[no-any-return,no-untyped-call]

    module.forward = forward  # type: ignore[method-assign]


def hook_count(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        count += len(module._forward_hooks) + len(module._forward_pre_hooks)
        count += len(module._backward_hooks) + len(module._backward_pre_hooks)
    for parameter in model.parameters():
        count += len(getattr(parameter, "_post_accumulate_grad_hooks", None) or {})
        count += len(parameter._backward_hooks or {})
    return count


@pytest.fixture(scope="module")
def hot() -> tuple[nn.Module, dict[str, torch.Tensor], _Built, PrecisionReport]:
    model = tiny_llama(layers=LAYERS + 1)  # a layer after the overflowing one
    before = copy.deepcopy(model.state_dict())
    built = _Built(overflow_down_proj)
    variants: list[str | Variant] = [Variant("hot_fp16", dtype="float16", prepare=built), "bf16"]
    report = compare(model, make_batch(), variants, repeats=2, backward=False)
    return model, before, built, report


def test_forward_overflow_origin_is_the_exact_module(
    hot: tuple[nn.Module, dict[str, torch.Tensor], _Built, PrecisionReport],
) -> None:
    _, _, _, report = hot
    assert report.get("hot_fp16", "model.layers.1").nonfinite > 0
    assert report.get("hot_fp16", "model.layers.0").nonfinite == 0
    # Exactly the Linear: not its MLP, not the block, not a later layer.
    assert report.nonfinite_origin == {"hot_fp16": f"{HOT_MODULE} (fw)"}


def test_diagnostic_run_leaves_no_hooks_and_the_model_untouched(
    hot: tuple[nn.Module, dict[str, torch.Tensor], _Built, PrecisionReport],
) -> None:
    model, before, built, _ = hot
    # Each built a model: the measured pass, its exact rerun (its float32 sums met NaN/Inf, see metrics.py), the
    # diagnostic run, and the repeat with its own exact rerun.
    assert len(built.models) == 5
    for run_model in built.models:
        assert hook_count(run_model) == 0
    assert hook_count(model) == 0
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_backward_only_nonfinite_origin() -> None:
    model = tiny_llama(layers=LAYERS)
    variant = Variant("bad_backward", dtype="bfloat16", prepare=_Built(infinite_gradient_in_down_proj))
    report = compare(model, make_batch(), [variant])
    assert all(r.nonfinite == 0 for r in report.records("bad_backward") if r.kind in ("fw", "logprob", "loss"))
    assert any(r.nonfinite for r in report.records("bad_backward", "bw"))
    assert report.nonfinite_origin == {"bad_backward": f"{HOT_MODULE} (bw)"}
    assert hook_count(model) == 0


def test_finite_run_has_no_origin_and_no_diagnostic_run(llama: nn.Module) -> None:
    built = _Built(lambda model: None)
    report = compare(llama, make_batch(), [Variant("plain_bf16", dtype="bfloat16", prepare=built)], backward=False)
    assert report.nonfinite_origin == {}
    assert len(built.models) == 1  # no second run when everything stayed finite
    assert hook_count(built.models[0]) == 0


# --- the report ------------------------------------------------------------------------------------------


def test_round_trip_with_spread_and_origin(
    hot: tuple[nn.Module, dict[str, torch.Tensor], _Built, PrecisionReport], single: PrecisionReport
) -> None:
    _, _, _, report = hot
    data = report.to_dict()
    assert data["nonfinite_origin"] == {"hot_fp16": f"{HOT_MODULE} (fw)"}
    assert data["variants"]["bf16"]["run"]["repeats"] == 2
    assert any("spread" in r for r in data["variants"]["bf16"]["records"])
    restored = PrecisionReport.from_dict(json.loads(json.dumps(data)))
    # Compared as JSON: the overflowing variant's log-ratio statistics are NaN, and NaN != NaN.
    assert json.dumps(restored.to_dict()) == json.dumps(data)
    assert restored.nonfinite_origin == report.nonfinite_origin
    assert restored.records("bf16") == report.records("bf16")
    assert [r.spread for r in restored.records("hot_fp16")] == [r.spread for r in report.records("hot_fp16")]
    # A single run writes neither field, and a dict without them reads back as before.
    plain = single.to_dict()
    assert "repeats" not in plain["variants"]["fp16"]["run"]
    assert all("spread" not in r for r in plain["variants"]["fp16"]["records"])
    assert plain["nonfinite_origin"] == {}
    del plain["nonfinite_origin"]
    assert PrecisionReport.from_dict(plain) == single
