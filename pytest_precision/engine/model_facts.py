"""Facts about a run's model: dtype counts, parameter categories, whether it is a causal LM, its logits."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from pytest_precision.distributed.sharding import is_dtensor, plain

if TYPE_CHECKING:
    import torch
    from torch import nn


def dtype_counts(tensors: Iterator[torch.Tensor]) -> dict[str, int]:
    counts = Counter(str(t.dtype).removeprefix("torch.") for t in tensors)
    return dict(sorted(counts.items()))


def parameter_categories(model: nn.Module) -> tuple[dict[str, str], bool | None]:
    """Parameter name -> category for the gradient summary, and whether the head is tied to the embedding."""
    from torch import nn

    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    head = get_output() if callable(get_output) else None
    tied = None
    if embedding is not None and head is not None:
        tied = getattr(head, "weight", None) is getattr(embedding, "weight", object())
    names = dict(model.named_parameters())
    categories: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for parameter_name, parameter in module.named_parameters(recurse=False):
            full = f"{module_name}.{parameter_name}" if module_name else parameter_name
            if full not in names:
                continue  # a tied parameter, reported under its first name
            if module is head:
                category = "lm_head"
            elif module is embedding or isinstance(module, nn.Embedding):
                category = "embedding"
            elif parameter_name == "bias":
                category = "bias"
            elif "norm" in type(module).__name__.lower():
                category = "norm"
            elif parameter.dim() >= 2:
                category = "linear"
            else:
                category = "other"
            categories[full] = category
    return categories, tied


def rank_average(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (a sharded parameter's gradient, already reduced by FSDP2 or tensor parallelism) as is; a plain
    tensor averaged over the ranks, as DDP does with gradients: each rank holds the gradient of its own rows."""
    import torch.distributed as dist

    if is_dtensor(tensor):
        return tensor
    averaged = tensor.detach().clone()
    dist.all_reduce(averaged, op=dist.ReduceOp.SUM)
    return averaged.div_(dist.get_world_size())


def is_causal_lm(model: nn.Module) -> bool:
    """Whether next-token log-probabilities mean something: a transformers model that can generate (not a
    masked LM or a classifier); any other model returning `.logits` is taken at its word."""
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else True


def logits_of(output: Any) -> torch.Tensor | None:
    """The (batch, positions, vocabulary) logits of a model output; a DTensor's gathered whole."""
    import torch

    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return plain(logits) if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None
