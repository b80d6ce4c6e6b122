"""The session cache never serves a stale reference: whatever can change the model's output is in its key,
or the cache is not used; and Reference.load refuses a model whose weights differ from the saved ones."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from conftest import random_tokens, tiny_llama
from pytest_precision import ConfigurationError, Reference, ReferenceCache, compare, reference
from pytest_precision.engine.fingerprint import CacheKey, cache_key
from pytest_precision.reports.report import PrecisionReport


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = 2.0  # a plain attribute read by forward
        self.offset = torch.zeros(8)  # a tensor attribute that is not a buffer
        self.activation = "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) * self.scale + self.offset.to(x.dtype)
        return torch.tanh(y) if self.activation == "tanh" else torch.relu(y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def inputs() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(3))


def loss(out: torch.Tensor, _inputs: Any) -> torch.Tensor:
    return out.square().mean()


def run(model: nn.Module, cache: ReferenceCache | None = None) -> PrecisionReport:
    return compare(model, inputs(), ["bf16"], loss_fn=loss, cache=cache)


def fw_numbers(report: PrecisionReport) -> dict[str, float | None]:
    return {f"{r.name}/{r.kind}": r.rms_rel for r in report.records("bf16")}


def test_an_unchanged_model_is_a_hit() -> None:
    model, cache = Net(), ReferenceCache()
    first = run(model, cache)
    second = run(model, cache)
    assert (cache.hits, cache.misses, cache.skipped) == (1, 1, 0)
    assert first.to_dict() == second.to_dict()


def hook_forward(model: Net) -> Callable[[], None]:
    handle = model.blocks[0].linear.register_forward_hook(lambda _m, _i, out: out * 3)
    return handle.remove


def hook_forward_pre(model: Net) -> Callable[[], None]:
    handle = model.blocks[1].register_forward_pre_hook(lambda _m, args: (args[0] * 0.5,))
    return handle.remove


def hook_backward(model: Net) -> Callable[[], None]:
    handle = model.blocks[1].register_full_backward_hook(lambda _m, grad_in, _grad_out: (grad_in[0] * 4,))
    return handle.remove


def hook_backward_pre(model: Net) -> Callable[[], None]:
    handle = model.head.register_full_backward_pre_hook(lambda _m, grad_out: (grad_out[0] * 5,))
    return handle.remove


def hook_global(_model: Net) -> Callable[[], None]:
    from torch.nn.modules.module import register_module_forward_hook

    def double_heads(module: nn.Module, _i: Any, out: Any) -> Any:
        return out * 2 if isinstance(module, nn.Linear) and module.out_features == 3 else None

    handle = register_module_forward_hook(double_heads)
    return handle.remove


def set_scale(model: Net) -> Callable[[], None]:
    model.blocks[0].scale = 0.5
    return lambda: None


def set_activation(model: Net) -> Callable[[], None]:
    model.blocks[1].activation = "relu"
    return lambda: None


def edit_tensor_attribute(model: Net) -> Callable[[], None]:
    model.blocks[0].offset[2] = 0.75  # in place: the same object, other bytes
    return lambda: None


def scaled_forward(block: Block, factor: float) -> Any:
    """A forward bound to `block` (so a copy of the model binds it to the copy) scaling Block's output."""
    return types.MethodType(lambda self, x: Block.forward(self, x) * factor, block)


def replace_forward(model: Net) -> Callable[[], None]:
    model.blocks[1].forward = scaled_forward(model.blocks[1], 2.0)  # type: ignore[method-assign]
    return lambda: None


def parametrize_weight(model: Net) -> Callable[[], None]:
    class Clamp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.limit = 0.1

        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight.clamp(-self.limit, self.limit)

    parametrize.register_parametrization(model.blocks[0].linear, "weight", Clamp())
    return lambda: None


class Doubled(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def swap_class(model: Net) -> Callable[[], None]:
    model.blocks[0].__class__ = Doubled  # what parametrize and some patching libraries do
    return lambda: None


def freeze_a_parameter(model: Net) -> Callable[[], None]:
    model.blocks[0].linear.bias.requires_grad_(False)
    return lambda: None


CHANGES: dict[str, Callable[[Net], Callable[[], None]]] = {
    "forward_hook": hook_forward,
    "forward_pre_hook": hook_forward_pre,
    "backward_hook": hook_backward,
    "backward_pre_hook": hook_backward_pre,
    "global_forward_hook": hook_global,
    "plain_attribute": set_scale,
    "string_attribute": set_activation,
    "tensor_attribute": edit_tensor_attribute,
    "instance_forward": replace_forward,
    "parametrization": parametrize_weight,
    "requires_grad": freeze_a_parameter,
    "class": swap_class,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_change_runs_the_reference_again(change: str) -> None:
    model, cache = Net(), ReferenceCache()
    before = run(model, cache)
    undo = CHANGES[change](model)
    try:
        after = run(model, cache)
        fresh = run(model)  # no cache at all
        assert (cache.hits, cache.misses) == (0, 2)
        assert after.to_dict() == fresh.to_dict()  # the numbers are those of the changed model
        assert after.to_dict() != before.to_dict()
        run(model, cache)
        assert cache.hits == 1  # the changed model, unchanged since: a hit
    finally:
        undo()


def test_training_of_a_submodule_is_in_the_key() -> None:
    model, cache = Net(), ReferenceCache()
    run(model, cache)
    model.blocks[1].train(False)
    run(model, cache)
    assert (cache.hits, cache.misses) == (0, 2)


def test_a_parametrizations_own_attribute_is_in_the_key() -> None:
    model, cache = Net(), ReferenceCache()
    parametrize_weight(model)
    before = run(model, cache)
    model.blocks[0].linear.parametrizations.weight[0].limit = 0.05
    after = run(model, cache)
    assert (cache.hits, cache.misses) == (0, 2)
    assert after.to_dict() == run(model).to_dict() != before.to_dict()


def test_a_replaced_forward_whose_predecessor_was_freed_is_a_miss() -> None:
    # The second function may take the first one's id once the first is freed: the entry must not match it.
    model, cache = Net(), ReferenceCache()
    block = model.blocks[1]
    block.forward = scaled_forward(block, 2.0)  # type: ignore[method-assign]
    before = run(model, cache)
    block.forward = scaled_forward(block, 3.0)  # type: ignore[method-assign]
    after = run(model, cache)
    assert cache.hits == 0
    assert after.to_dict() == run(model).to_dict() != before.to_dict()


def test_an_entry_naming_a_freed_object_is_never_a_hit() -> None:
    import gc

    class Anchor:
        pass

    model, cache = Net(), ReferenceCache()
    ref = reference(model, inputs(), loss_fn=loss)
    anchor = Anchor()
    cache.put(CacheKey(("some", "key"), (), (anchor,)), model, ref)
    lookup = CacheKey(("some", "key"), ())
    assert cache.get(lookup, model) is not None
    del anchor
    gc.collect()
    assert cache.get(lookup, model) is None and len(cache) == 0  # its id may now be another object's


def test_a_nan_attribute_still_hits() -> None:
    model, cache = Net(), ReferenceCache()
    model.blocks[0].unused = float("nan")
    run(model, cache)
    run(model, cache)
    assert cache.hits == 1


def test_a_hook_removed_and_another_added_is_a_miss() -> None:
    model, cache = Net(), ReferenceCache()
    hook_forward(model)()
    run(model, cache)
    remove = hook_forward(model)
    try:
        run(model, cache)
    finally:
        remove()
    assert cache.hits == 0


class Opaque:
    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value


@pytest.mark.parametrize("value", [Opaque(1.0), range(3)], ids=["slots_object", "range"])
def test_a_model_that_cannot_be_fingerprinted_skips_the_cache(value: Any) -> None:
    model, cache = Net(), ReferenceCache()
    model.blocks[0].opaque = value
    run(model, cache)
    run(model, cache)
    assert (cache.hits, cache.misses, cache.skipped, len(cache)) == (0, 0, 2, 0)


def test_a_module_outside_the_model_held_as_attribute_skips_the_cache() -> None:
    model, cache = Net(), ReferenceCache()
    object.__setattr__(model.blocks[0], "helper", nn.Linear(2, 2))  # not registered: its weights are unseen
    run(model, cache)
    assert cache.skipped == 1


def test_a_stateless_module_outside_the_model_is_fingerprinted() -> None:
    # transformers >= 5.25 keeps kernel functions as unregistered, parameter-free modules (`_kernel_funcs`).
    model, cache = Net(), ReferenceCache()
    helper = nn.GELU()
    object.__setattr__(model.blocks[0], "_kernel_funcs", {"act": helper})
    run(model, cache)
    run(model, cache)
    assert (cache.hits, cache.misses, cache.skipped) == (1, 1, 0)
    helper.approximate = "tanh"  # its attributes are in the key
    run(model, cache)
    assert (cache.hits, cache.misses) == (1, 2)


def test_modules_as_one_string_is_one_regex_in_the_key() -> None:
    model, cache = tiny_llama(layers=1), ReferenceCache()
    ids = random_tokens(length=8)
    one = compare(model, {"input_ids": ids}, ["bf16"], modules="lm_head", backward=False, cache=cache)
    compare(model, {"input_ids": ids}, ["bf16"], modules=["lm_head"], backward=False, cache=cache)
    assert cache.hits == 1
    assert [r.name for r in one.records("bf16", "fw")] == ["lm_head"]


def test_a_transformers_model_is_fingerprinted() -> None:
    model, cache = tiny_llama(layers=1), ReferenceCache()
    ids = random_tokens(length=8)
    for _ in range(2):
        compare(model, {"input_ids": ids, "labels": ids}, ["bf16"], cache=cache)
    assert (cache.hits, cache.misses, cache.skipped) == (1, 1, 0)
    model.config.rms_norm_eps = 0.5  # the config is part of the key (modules hold it as an attribute)
    compare(model, {"input_ids": ids, "labels": ids}, ["bf16"], cache=cache)
    assert cache.misses == 2


# Reference.load checks the model's weights.


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[nn.Module, Path]]:
    model = Net()
    path = tmp_path / "ref.safetensors"
    reference(model, inputs(), loss_fn=loss).save(path)
    yield model, path


def test_load_accepts_the_same_weights(saved: tuple[nn.Module, Path]) -> None:
    model, path = saved
    loaded = Reference.load(path, model=model, loss_fn=loss)
    assert compare(loaded, variants=["bf16"]).records("bf16")
    model.train(not model.training)  # the mode is not a weight: every run is in eval mode
    Reference.load(path, model=model, loss_fn=loss)


def test_load_refuses_other_weights(saved: tuple[nn.Module, Path]) -> None:
    model, path = saved
    with torch.no_grad():
        model.blocks[1].linear.weight[0, 0] += 0.01
    with pytest.raises(
        ConfigurationError, match=r"ref\.safetensors.*the model's weights differ from those the reference"
    ):
        Reference.load(path, model=model, loss_fn=loss)
    with pytest.raises(ConfigurationError, match="the model differs from the one the reference was computed with"):
        Reference.load(path, model=tiny_llama(layers=1))  # another architecture altogether


def test_load_without_a_module_does_not_check(saved: tuple[nn.Module, Path]) -> None:
    _model, path = saved
    assert Reference.load(path).model is None
    factory: Callable[[torch.dtype, torch.device], nn.Module] = lambda dtype, _device: Net().to(dtype)  # noqa: E731
    assert Reference.load(path, model=factory).model is factory


def test_the_loss_fn_and_prepare_are_named_by_identity_and_anchored() -> None:
    from pytest_precision.engine.batch import to_batch
    from pytest_precision.engine.variants import Variant

    def prepare(model: nn.Module) -> nn.Module:
        return model

    variant = Variant("fp32", dtype="float32", prepare=prepare)
    settings: dict[str, Any] = {
        "backward": True,
        "modules": None,
        "device": torch.device("cpu"),
        "temperature": 1.0,
        "clip_eps": 0.2,
        "offload": False,
    }
    net = Net()
    keyed = cache_key(net, to_batch(inputs()), variant, loss_fn=loss, **settings)
    assert keyed is not None
    assert any(a is loss for a in keyed.anchors) and any(a is prepare for a in keyed.anchors)
    other = cache_key(net, to_batch(inputs()), variant, loss_fn=lambda out, _i: out.sum(), **settings)
    assert other is not None and other.key != keyed.key


def test_an_input_that_starts_requiring_grad_is_a_new_reference() -> None:
    """The same values with requires_grad on give the first block a bw row: a cached reference without it would
    lack the tensor the variant produces."""
    cache = ReferenceCache()
    model, x = Net(), inputs()
    first = compare(model, x, ["bf16"], loss_fn=loss, cache=cache)
    assert [r.name for r in first.records("bf16", "bw")] == ["blocks.1"]
    second = compare(model, x.clone().requires_grad_(True), ["bf16"], loss_fn=loss, cache=cache)
    assert (cache.hits, cache.misses) == (0, 2)
    assert [r.name for r in second.records("bf16", "bw")] == ["blocks.1", "blocks.0"]
