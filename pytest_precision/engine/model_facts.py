"""Facts about a run's model: dtype counts, parameter categories, whether it is a causal LM, its logits, and
what besides its weights' values defines it (model_description, which a saved Reference records)."""

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


#: Keys of a transformers config that change no number a run computes, left out of a model's description: where
#: it was loaded from, the transformers version that wrote it, the class names it suggests (the module tree
#: records the classes themselves) and its dtype (each parameter's own dtype is recorded).
CONFIG_BOOKKEEPING = frozenset(
    {"_name_or_path", "transformers_version", "_commit_hash", "architectures", "torch_dtype", "dtype"}
)
#: Values of plain types; anything else is described by its type's name alone.
_PLAIN = (bool, int, float, str, type(None))
#: Where torch.nn's own module classes live: their plain attributes are their constructor's settings (a
#: LayerNorm's eps, a Dropout's p, a convolution's stride), fixed once built. Other classes' attributes may be
#: bookkeeping that changes as the model runs (a rotary cache's length, a checkpoint's path), so they are not
#: recorded: a transformers model's settings are in its config.
_TORCH_NN = "torch.nn.modules."


def plain_value(value: Any, depth: int = 0) -> Any:
    """`value` as JSON: plain values as they are, lists and tuples as lists, dicts with their keys as strings;
    any other object (and anything nested deeper than 8) as "<TypeName>", so that a change of type shows but no
    object's own text (an address) does."""
    if isinstance(value, _PLAIN):
        return value
    if depth < 8 and isinstance(value, (list, tuple)):
        return [plain_value(item, depth + 1) for item in value]
    if depth < 8 and isinstance(value, Mapping):
        return {str(key): plain_value(item, depth + 1) for key, item in value.items()}
    return f"<{type(value).__qualname__}>"


def config_description(model: nn.Module) -> dict[str, Any] | None:
    """A model's `config` as JSON (a transformers PretrainedConfig's `to_dict()` with its attention
    implementation, which to_dict leaves out; a dataclass's fields; a dict), less CONFIG_BOOKKEEPING; None for
    a model without one."""
    import dataclasses

    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        try:
            values = to_dict()
        except Exception as error:  # a config that cannot say what it holds: its type and the failure stand for it
            return {"<to_dict>": f"<{type(config).__qualname__}: to_dict() raised {type(error).__name__}>"}
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        values = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        values = config
    else:
        return None
    if not isinstance(values, Mapping):
        return None
    attention = getattr(config, "_attn_implementation", None)  # eager and sdpa attention round differently
    if isinstance(attention, str):
        values = {**values, "_attn_implementation": attention}
    return {str(k): plain_value(v) for k, v in sorted(values.items(), key=str) if k not in CONFIG_BOOKKEEPING}


def model_description(model: nn.Module) -> dict[str, Any]:
    """What besides its weights' values defines a model, as JSON: its module tree (qualified name and class of
    each module), the settings of torch.nn's own modules (their plain public attributes), each parameter's and
    buffer's name, shape and dtype, and its config (see config_description)."""
    modules: list[list[str]] = []
    settings: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        modules.append([name, type(module).__qualname__])
        if type(module).__module__.startswith(_TORCH_NN):
            plain = {
                key: plain_value(value)
                for key, value in sorted(vars(module).items())
                if not key.startswith("_") and key != "training" and isinstance(value, (*_PLAIN, tuple, list))
            }
            if plain:
                settings[name] = plain
    tensors = [
        [name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    ]
    return {"modules": modules, "settings": settings, "tensors": tensors, "config": config_description(model)}
