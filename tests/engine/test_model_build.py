"""How a run's model is built from the user's: copied straight to its dtype, the user's model untouched."""

from __future__ import annotations

import copy

import torch
from torch import nn

from conftest import tiny_llama
from pytest_precision.engine.model_build import build_run_model, copy_cast
from pytest_precision.engine.variants import BUILTIN_VARIANTS


class TaggedParameter(nn.Parameter):
    """A Parameter subclass (as some libraries use): copied by its own __deepcopy__, then cast."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.norm_scale = TaggedParameter(torch.ones(6))
        self.register_buffer("frequencies", torch.linspace(0, 1, 6))
        self.body.bias.requires_grad_(False)  # frozen
        self.body.weight.marker = "kept"  # an attribute on a parameter


def test_copy_cast_casts_once_keeps_ties_flags_attributes_and_leaves_the_source_alone() -> None:
    net = Net()
    net.body.weight.grad = torch.ones_like(net.body.weight)
    before = copy.deepcopy(net.state_dict())
    copied = copy_cast(net, "bfloat16", torch.device("cpu"))
    assert copied.head.weight is copied.embed.weight  # still tied, one parameter
    assert {p.dtype for p in copied.parameters()} == {torch.bfloat16}
    assert isinstance(copied.norm_scale, TaggedParameter) and copied.norm_scale.dtype == torch.bfloat16
    assert copied.frequencies.dtype == torch.float32  # buffers keep their dtype
    assert copied.body.bias.requires_grad is False and copied.body.weight.requires_grad is True
    assert copied.body.weight.marker == "kept"
    assert all(p.grad is None for p in copied.parameters())
    torch.testing.assert_close(copied.body.weight.float(), net.body.weight.detach().bfloat16().float())
    # The source: same values, dtype, gradient and parameters, sharing no storage with the copy.
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert net.body.weight.grad is not None and net.body.weight.dtype == torch.float32
    source_storages = {p.untyped_storage().data_ptr() for p in net.parameters()}
    assert not source_storages & {p.untyped_storage().data_ptr() for p in copied.parameters()}


def test_an_fp32_copy_owns_its_parameters() -> None:
    net = Net()
    copied = copy_cast(net, "float32", torch.device("cpu"))
    with torch.no_grad():
        copied.body.weight.add_(1.0)
    assert not torch.equal(copied.body.weight, net.body.weight)


def test_keep_in_fp32_modules_stay_fp32_in_a_copy() -> None:
    model = tiny_llama(layers=1)
    model._keep_in_fp32_modules = ["post_attention_layernorm"]
    run_model = build_run_model(model, BUILTIN_VARIANTS["fp16"], torch.device("cpu"))
    dtypes = {name: p.dtype for name, p in run_model.named_parameters()}
    assert dtypes["model.layers.0.post_attention_layernorm.weight"] == torch.float32
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.float16
    assert next(model.parameters()).dtype == torch.float32
