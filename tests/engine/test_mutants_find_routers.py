"""find_routers (engine/routers.py) on transformers 4.x-style MoE blocks, for issue 34's mutants: an nn.Linear
`gate` of a known SparseMoeBlock is a router read by its block; a gate elsewhere is not."""

from __future__ import annotations

import pytest
from torch import nn

from pytest_precision.engine.routers import find_routers

EXPERTS, K = 4, 2


def block(class_name: str, *, top_k: bool = True) -> nn.Module:
    """A block of the given class name holding an nn.Linear `gate` (and `top_k`, as transformers 4.x blocks do)."""
    module: nn.Module = type(class_name, (nn.Module,), {"top_k": K} if top_k else {})()
    module.add_module("gate", nn.Linear(3, EXPERTS, bias=False))
    return module


def model(**blocks: nn.Module) -> nn.Module:
    layer = nn.Module()
    for name, child in blocks.items():
        layer.add_module(name, child)
    root = nn.Module()
    root.layers = nn.ModuleList([layer])
    return root


@pytest.mark.parametrize(
    "class_name", ["Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "MixtralSparseMoeBlock"]
)
def test_the_linear_gate_of_a_known_block_is_a_router_read_by_its_block(class_name: str) -> None:
    moe = block(class_name)
    routers = find_routers(model(mlp=moe), None)
    assert list(routers) == ["layers.0.mlp.gate"]
    router = routers["layers.0.mlp.gate"]
    assert router.module is moe.gate and router.block is moe
    assert router.spec is None and router.kind == f"{class_name}.gate"


def test_a_gate_of_an_unknown_block_or_one_without_top_k_is_not_a_router() -> None:
    found = find_routers(
        model(
            mlp=block("Qwen3MoeSparseMoeBlock"),
            other=block("MyMoeBlock"),
            dense=block("MixtralSparseMoeBlock", top_k=False),
        ),
        None,
    )
    assert list(found) == ["layers.0.mlp.gate"]
    assert find_routers(model(mlp=block("Qwen3MoeSparseMoeBlock")), False) == {}
