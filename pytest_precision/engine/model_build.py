"""Build each run's model the way production builds it, never by mutating the user's model.

A run's model is a deep copy of the user's model (or a fresh one from the user's factory), with
parameters cast as transformers casts a checkpoint loaded in a lower dtype: parameters take the dtype,
floating buffers such as rotary `inv_freq` keep theirs, `_keep_in_fp32_modules` stay in fp32 (in fp16 runs;
`_keep_in_fp32_modules_strict` in fp16 and bf16 runs). One exception to "buffers keep their dtype": the
running statistics of normalization layers that track them (BatchNorm, InstanceNorm with
track_running_stats) take their module's weight dtype, as `model.to(dtype)` does, since those layers refuse
statistics of another dtype than their input.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import re
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pytest_precision.base.dtypes import torch_dtype
from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.engine.lowbit_build import APPLIED_FORMATS, apply_lowbit
from pytest_precision.engine.variants import HEAD_MODULE, Variant

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pytest_precision.distributed.sharding import ShardedModel

from pytest_precision.base.dtypes import ModelFactory


def is_module(model: object) -> bool:
    from torch import nn

    return isinstance(model, nn.Module)


def map_floating(value: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `function` to every floating-point tensor in a nest of tuples, lists and dicts."""
    import torch

    if isinstance(value, torch.Tensor):
        return function(value) if value.is_floating_point() else value
    if isinstance(value, tuple):
        mapped = [map_floating(v, function) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else tuple(mapped)
    if isinstance(value, list):
        return [map_floating(v, function) for v in value]
    if isinstance(value, dict):
        result = copy.copy(value)
        for key in list(value.keys()):
            result[key] = map_floating(value[key], function)
        return result
    return value


def first_floating_dtype(value: Any) -> torch.dtype | None:
    """The dtype of the first floating tensor in a nest of tuples, lists and dicts."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = first_floating_dtype(item)
        if found is not None:
            return found
    return None


def _keep_in_fp32_patterns(model: nn.Module, dtype: str) -> list[str]:
    """transformers' rule: `_keep_in_fp32_modules` for fp16, `_keep_in_fp32_modules_strict` for fp16/bf16."""
    patterns: list[str] = []
    if dtype == "float16":
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if dtype in ("float16", "bfloat16"):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return patterns


def parameter_dtypes(model: nn.Module, dtype: str) -> dict[str, torch.dtype]:
    """The dtype each floating parameter (tied ones once) takes in a `dtype` run: `dtype`, or fp32 for
    fp32-pinned modules."""
    import torch

    target = torch_dtype(dtype)
    keep = [re.compile(fnmatch.translate(f"*{p}*").replace(r"\Z", "")) for p in _keep_in_fp32_patterns(model, dtype)]
    return {
        name: torch.float32 if any(k.match(name) for k in keep) else target
        for name, parameter in model.named_parameters()
        if parameter.is_floating_point()
    }


def cast_parameters(model: nn.Module, dtype: str) -> None:
    """Cast floating parameters (tied ones once) to `dtype`, keeping buffers and fp32-pinned modules."""
    wanted = parameter_dtypes(model, dtype)
    for name, parameter in model.named_parameters():
        if name in wanted and parameter.dtype != wanted[name]:
            parameter.data = parameter.data.to(wanted[name])


def cast_running_stats(model: nn.Module, dtype: str) -> None:
    """Cast the floating buffers (running mean and variance) of every normalization layer tracking running
    statistics to the dtype its weight has in this run (the run's dtype for a layer without weight)."""
    import torch
    from torch.nn.modules.batchnorm import _NormBase

    target = torch_dtype(dtype)
    for module in model.modules():
        if not isinstance(module, _NormBase) or not module.track_running_stats:
            continue
        weight = module.weight if isinstance(module.weight, torch.Tensor) else None
        wanted = weight.dtype if weight is not None and weight.is_floating_point() else target
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != wanted:
                module._buffers[name] = buffer.to(wanted)


def copy_cast(model: nn.Module, dtype: str, device: torch.device) -> nn.Module:
    """A deep copy of `model` on `device` with its parameters already cast (see cast_parameters): each
    parameter is copied once, straight to its dtype and device, instead of copied in full precision and then
    cast (half the bytes written for a bf16 run, and no transient full-precision copy)."""
    from torch import nn

    wanted = parameter_dtypes(model, dtype)
    memo: dict[int, Any] = {}
    subclassed = False
    for name, parameter in model.named_parameters():
        if type(parameter) is not nn.Parameter:
            subclassed = True  # a Parameter subclass: left to its own __deepcopy__, cast afterwards
            continue
        data = parameter.detach().to(device=device, dtype=wanted.get(name, parameter.dtype), copy=True)
        copied = nn.Parameter(data, requires_grad=parameter.requires_grad)
        memo[id(parameter)] = copied
        copied.__dict__.update(copy.deepcopy(parameter.__dict__, memo))
    result = copy.deepcopy(model, memo).to(device)
    if subclassed:
        cast_parameters(result, dtype)
        for parameter in result.parameters():
            parameter.grad = None
    return result


def head_module_name(model: nn.Module) -> str:
    """The name of the model's output embeddings (the LM head), for `<output head>` in fp32_modules."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is not None:
        for name, module in model.named_modules():
            if module is head:
                return str(name)
    raise ConfigurationError(
        f"fp32_modules: '{HEAD_MODULE}' needs a model with get_output_embeddings() (a transformers LM); "
        f"{type(model).__name__} has none: name the head module by regex instead, e.g. fp32_modules=('lm_head',)"
    )


@contextlib.contextmanager
def _parameters_in_fp32(module: nn.Module) -> Iterator[None]:
    """Swap every floating parameter and buffer of `module` for an fp32 upcast (autograd flows back)."""
    import torch

    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for submodule in module.modules():
            for store in (submodule._parameters, submodule._buffers):
                for name, tensor in list(store.items()):
                    if tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float32:
                        swapped.append((store, name, tensor))
                        store[name] = tensor.float()  # type: ignore[assignment]
        yield
    finally:
        for store, name, tensor in reversed(swapped):
            store[name] = tensor


def compute_in_fp32(module: nn.Module, device_type: str, *, keep_output_fp32: bool) -> None:
    """Make `module` compute in fp32 at call time: inputs and weights upcast, autocast off inside.

    The stored weights keep their dtype, so a head tied to the embedding leaves the embedding in the low
    dtype. The output stays fp32 for the output head (fp32 logits, as inference engines return them) and
    is cast back to the input's dtype elsewhere, so the next module receives what it expects.
    """
    import torch

    original_forward = module.forward

    def forward_in_fp32(*args: Any, **kwargs: Any) -> Any:
        input_dtype = first_floating_dtype((args, kwargs))
        args, kwargs = map_floating((args, kwargs), lambda t: t.float())
        with torch.autocast(device_type=device_type, enabled=False), _parameters_in_fp32(module):
            output = original_forward(*args, **kwargs)
        if keep_output_fp32 or input_dtype is None:
            return output
        return map_floating(output, lambda t: t.to(input_dtype))

    module.forward = forward_in_fp32  # type: ignore[method-assign]


def _matching_modules(model: nn.Module, patterns: tuple[str, ...]) -> tuple[list[str], str | None]:
    try:
        head: str | None = head_module_name(model)
    except ConfigurationError:
        head = None
    resolved: list[str] = []
    for pattern in patterns:
        if pattern == HEAD_MODULE:
            resolved.append(re.escape(head_module_name(model)))
        else:
            resolved.append(pattern)
    names = [name for name, _ in model.named_modules() if name and any(re.fullmatch(p, name) for p in resolved)]
    for pattern in resolved:
        if not any(re.fullmatch(pattern, name) for name in names):
            raise ConfigurationError(
                f"fp32_modules: {pattern!r} matches no module of {type(model).__name__} (full match on names "
                f"from named_modules(), e.g. {', '.join(_sample_names(model))})"
            )
    # An fp32 module inside another fp32 module is already covered by the outer one.
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    return outer, head


def _sample_names(model: nn.Module, count: int = 6) -> list[str]:
    return [name for name, _ in model.named_modules() if name][:count]


def set_attn_implementation(model: nn.Module, implementation: str) -> None:
    """Switch a transformers model's attention implementation ("eager", "sdpa", ...)."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(implementation)
        return
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ConfigurationError(
            f"attn_implementation={implementation!r} needs a transformers model; {type(model).__name__} has "
            "no config._attn_implementation: use Variant(prepare=...) to switch attention yourself"
        )
    config._attn_implementation = implementation


class FactoryProducts:
    """The models a factory returned within one comparison, held weakly: a factory returning one of them
    again (`lambda dtype, device: model`) would have every run mutate, and share, one model."""

    def __init__(self) -> None:
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def check(self, model: nn.Module) -> None:
        if model in self._models:
            raise ConfigurationError(
                f"model factory: the factory returned the same module object for two runs (a "
                f"{type(model).__name__}); return a new model each call (build or load it inside the factory), or "
                "pass the model itself, which each run copies"
            )
        self._models.add(model)


def build_run_model(
    source: nn.Module | ModelFactory | ShardedModel,
    variant: Variant,
    device: torch.device,
    products: FactoryProducts | None = None,
) -> nn.Module:
    """The model one run uses: a copy (or a factory product) cast and prepared for `variant`. `products`
    collects a factory's models to refuse one returned twice."""
    from torch import nn

    from pytest_precision.distributed.sharding import ShardedModel, check_policy

    if isinstance(source, ShardedModel):
        if variant.lowbit:
            raise ConfigurationError(
                f"variant {variant.name!r}: formats below 16 bits are measured on unsharded models (torchao's "
                "float8 with FSDP2 is not built here yet); compare the unsharded model in one process"
            )
        unsharded = dataclasses.replace(variant, param_dtype=None, reduce_dtype=None, output_dtype=None)
        model = build_run_model(source.model, unsharded, device, products)
        try:
            result = source.shard(model, variant)
        except Exception as error:
            raise ModelRunError(
                f"run {variant.name!r}: the shard function raised {type(error).__name__}: {error}"
            ) from error
        if result is not None and not isinstance(result, nn.Module):
            raise ConfigurationError(
                f"run {variant.name!r}: the shard function returned {type(result).__name__}; return the sharded "
                "model (or None when it shards in place)"
            )
        model = model if result is None else result
        check_policy(model, variant, device.type)
        return model
    if variant.fsdp_knobs:
        raise ConfigurationError(
            f"variant {variant.name!r} sets FSDP2 mixed precision ({variant.fsdp_description()}), which needs a "
            "sharded model: pass pytest_precision.sharded(model, shard) whose shard(model, variant) calls "
            "fully_shard(..., mp_policy=variant.mp_policy()), under torch.distributed"
        )
    if isinstance(source, nn.Module):
        model = copy_cast(source, variant.weight_dtype, device)  # parameters cast, without .grad
    else:
        model = source(torch_dtype(variant.weight_dtype), device)
        if not isinstance(model, nn.Module):
            raise ConfigurationError(
                f"model factory returned {type(model).__name__}, expected a torch.nn.Module; a factory is "
                "called as factory(dtype, device)"
            )
        if products is not None:
            products.check(model)
        model = model.to(device)
        cast_parameters(model, variant.weight_dtype)
        for parameter in model.parameters():
            parameter.grad = None
    cast_running_stats(model, variant.weight_dtype)
    if not any(p.is_floating_point() for p in model.parameters()):
        raise ConfigurationError(
            f"{type(model).__name__} has no floating-point parameters to measure: pass the model that holds "
            "the weights (or a factory building it), not a wrapper or a parameter-free module"
        )
    # transformers checkpoints only in training mode, but switch it off so no run recomputes activations.
    if getattr(model, "supports_gradient_checkpointing", False):
        # transformers 5 renamed gradient_checkpointing_disable (which now warns) to activation_...
        disable = getattr(model, "activation_checkpointing_disable", None) or getattr(
            model, "gradient_checkpointing_disable", None
        )
        if callable(disable):
            disable()
    model.eval()
    if variant.attn_implementation is not None:
        set_attn_implementation(model, variant.attn_implementation)
    fp32_names, head = _matching_modules(model, variant.fp32_modules)
    modules = dict(model.named_modules())
    for name in fp32_names:
        compute_in_fp32(modules[name], device.type, keep_output_fp32=name == head)
    applied = None
    if variant.lowbit:
        # The head stays high precision unless the variant's own filter takes it; fp32_modules always do.
        kept = [*fp32_names, *([head] if head is not None and variant.lowbit_filter is None else [])]
        applied = apply_lowbit(model, variant, device, kept)
    if variant.prepare is not None:
        try:
            prepared = variant.prepare(model)
        except Exception as error:
            raise ModelRunError(f"variant {variant.name!r}: prepare raised {type(error).__name__}: {error}") from error
        if not isinstance(prepared, nn.Module):
            raise ConfigurationError(
                f"variant {variant.name!r}: prepare returned {type(prepared).__name__}; it must return the model"
            )
        model = prepared
    if applied is not None:
        APPLIED_FORMATS[model] = applied
    return model
