"""Models and shard functions for the distributed tests (imported inside the ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 32
HIDDEN = 16


class Block(nn.Module):
    """h + tanh(h * w + b): element-wise, so a row's result never depends on the other rows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN) * 0.5 + 1.0)
        self.bias = nn.Parameter(torch.randn(HIDDEN) * 0.1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(hidden * self.weight + self.bias)


class Head(nn.Module):
    """Logits by a broadcast product and a last-dimension sum (no matmul kernel that blocks by batch size)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.unsqueeze(-2) * self.weight).sum(-1)


class RowwiseLM(nn.Module):
    """A causal LM whose every number for a sequence depends on that sequence alone, bit for bit: a data-parallel
    split of the batch cannot change any of them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = Head()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(self.norm(hidden))
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"logits": logits, "loss": loss}


def rowwise_lm() -> RowwiseLM:
    torch.manual_seed(0)
    return RowwiseLM()


def token_batch(rows: int = 4, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def poison_rows_starting_with_zero(model: nn.Module) -> nn.Module:
    """Variant prepare: NaN in block 1's output for the sequences whose first token is 0."""
    seen: dict[str, Any] = {}
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.update(ids=kwargs["input_ids"]), with_kwargs=True)

    def poison(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        rows = seen["ids"][:, 0] == 0
        return torch.where(rows[:, None, None], torch.full_like(output, float("nan")), output)

    model.blocks[1].register_forward_hook(poison)
    return model


def fsdp_per_layer(model: Any, variant: Any, mesh: Any = None) -> None:
    """FSDP2 as training scripts apply it: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=variant.mp_policy())
    fully_shard(model, mesh=mesh, mp_policy=variant.mp_policy())


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class TwoMLPs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLP(), MLP()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def two_mlps() -> TwoMLPs:
    torch.manual_seed(0)
    return TwoMLPs()


def tensor_parallel(model: Any, mesh: Any) -> Any:
    """Megatron-style: up column-parallel, down row-parallel (its output summed over the ranks)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.layers:
        parallelize_module(layer, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def mse(output: torch.Tensor, inputs: Any) -> torch.Tensor:
    return output.square().mean()
