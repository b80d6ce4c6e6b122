"""Apply a variant's format below 16 bits to its run's model, as production does: torchao's float8 training
(`convert_to_float8_training`), torchao's quantized inference (`quantize_`), or fp8 weight storage round trips.

Which modules take the format: by default every `nn.Linear` but the output head (torchao's recipes keep it in
high precision), for fp8 training only those whose two dimensions are multiples of 16 (torchao's hardware rule);
with the variant's `lowbit_filter(module, name)`, those it accepts (asked about every module, the head included:
quantize_ configs exist for embeddings too; fp8 training asks about nn.Linear modules only). Never a module of
`fp32_modules`.

A conversion is checked, not trusted: what torchao raised, and a conversion that left every chosen module as it
was, fail the run naming the variant (a run that measured bf16 weights must never carry an int8 label). The
modules recorded are those actually converted, so a gate can compare them with its baseline's (gate.lowbit_check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError, ModelRunError, NotSupportedHere
from pytest_precision.engine.backend_flags import precision_kept
from pytest_precision.engine.lowbit_formats import built_quantize_config, import_torchao, quantize_description

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pytest_precision.engine.variants import Variant

#: The CUDA compute capability from which fp8 matmuls (torch._scaled_mm) run natively.
FP8_CAPABILITY = (8, 9)
#: quantize_ configs that need fp8 matmul kernels (CUDA of FP8_CAPABILITY), refused elsewhere.
FP8_MATMUL_CONFIGS = ("Float8DynamicActivationFloat8WeightConfig", "Float8StaticActivationFloat8WeightConfig")


@dataclass(frozen=True)
class LowbitApplied:
    """What a run's model got: the format, whether its kernels ran natively or emulated, and on which modules."""

    format: str
    kernels: str
    modules: tuple[str, ...]
    torchao: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: `modules` the count (as baselines before module_names held it), `module_names` sorted."""
        return {
            "format": self.format,
            "kernels": self.kernels,
            "modules": len(self.modules),
            "module_names": sorted(self.modules),
            "torchao": self.torchao,
        }


#: The format each built run model got (see model_build.build_run_model), for its RunInfo.
APPLIED_FORMATS: weakref.WeakKeyDictionary[nn.Module, LowbitApplied] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def torchao_settings_kept() -> Iterator[None]:
    """Undo the process-wide settings torchao changes while it converts a model: quantize_ sets inductor's config
    (and, before torchao 0.13, the float32 matmul precision: the run pinned its own, which stays)."""
    import importlib

    inductor = importlib.import_module("torch._inductor.config")  # torchao imports it anyway
    saved = inductor.get_config_copy()
    try:
        with precision_kept():
            yield
    finally:
        now = inductor.get_config_copy()
        # Only what changed: loading every key would warn about each deprecated one (torch >= 2.14).
        changed = {key: value for key, value in saved.items() if now.get(key) != value}
        if changed:
            inductor.load_config(changed)


def fp8_native(device: torch.device) -> bool:
    """Whether `device` has fp8 matmul kernels (CUDA of compute capability 8.9 or higher)."""
    import torch

    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def lowbit_modules(
    model: nn.Module, variant: Variant, excluded: Collection[str], *, multiples_of_16: bool
) -> list[str]:
    """The names of the modules that take the variant's format (see the module docstring)."""
    from torch import nn

    def outside(name: str) -> bool:
        return not any(name == other or name.startswith(other + ".") for other in excluded)

    chosen: list[str] = []
    for name, module in model.named_modules():
        if not name or not outside(name):
            continue
        if variant.fp8_training is not None and not isinstance(module, nn.Linear):
            continue  # Float8Linear replaces nn.Linear modules only
        if variant.lowbit_filter is not None:
            try:
                taken = variant.lowbit_filter(module, name)
            except Exception as error:
                raise ModelRunError(
                    f"variant {variant.name!r}: lowbit_filter raised {type(error).__name__} on module {name!r}: {error}"
                ) from error
            if taken:
                chosen.append(name)
            continue
        if not isinstance(module, nn.Linear):
            continue
        if multiples_of_16 and (module.in_features % 16 or module.out_features % 16):
            continue
        chosen.append(name)
    return chosen


def apply_lowbit(
    model: nn.Module, variant: Variant, device: torch.device, excluded: Collection[str]
) -> LowbitApplied | None:
    """Give `model` the variant's format below 16 bits (None: the variant has none). `excluded`: module names
    kept in high precision (fp32_modules, and the head unless the variant has a filter)."""
    if variant.fp8_training is not None:
        return _fp8_training(model, variant, device, excluded)
    if variant.quantize is not None:
        return _quantized(model, variant, device, excluded)
    if variant.weight_storage is not None:
        return _stored(model, variant, excluded)
    return None


def _no_modules(variant: Variant, model: nn.Module, what: str) -> ConfigurationError:
    return ConfigurationError(
        f"variant {variant.name!r}: no module of {type(model).__name__} takes {what}: it applies to nn.Linear modules "
        "other than the output head and fp32_modules (fp8 training: both dimensions multiples of 16); pass "
        "lowbit_filter=lambda module, name: ... to choose them"
    )


def _converted(
    model: nn.Module, variant: Variant, names: list[str], what: str, converted: Callable[[str, nn.Module], bool]
) -> tuple[str, ...]:
    """The chosen `names` that `converted(name, module)` says took the format; a ModelRunError when none did (the
    run would measure the high-precision model under the format's label)."""
    modules = dict(model.named_modules())
    taken = tuple(name for name in names if name in modules and converted(name, modules[name]))
    if not taken:
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        raise ModelRunError(
            f"variant {variant.name!r}: {what} converted none of the {len(names)} module(s) chosen ({shown}); the "
            "run would measure unconverted weights under the format's label. Choose modules it converts with "
            "lowbit_filter=lambda module, name: ..."
        )
    return taken


def _parameter_types(module: nn.Module) -> dict[str, tuple[type, Any]]:
    """Each of a module's own parameters' type and dtype: quantize_ swaps weights for torchao tensor subclasses
    (or swaps the module)."""
    return {name: (type(p), p.dtype) for name, p in module.named_parameters(recurse=False)}


def _fp8_training(model: nn.Module, variant: Variant, device: torch.device, excluded: Collection[str]) -> LowbitApplied:
    torchao = import_torchao(f"variant {variant.name!r} (fp8 training)")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    names = lowbit_modules(model, variant, excluded, multiples_of_16=variant.lowbit_filter is None)
    if not names:
        raise _no_modules(variant, model, f"fp8 training ({variant.fp8_training})")
    native = fp8_native(device)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(variant.fp8_training), emulate=not native)
    chosen = frozenset(names)
    try:
        with torchao_settings_kept():
            convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    except Exception as error:
        raise ModelRunError(
            f"variant {variant.name!r}: torchao's convert_to_float8_training raised {type(error).__name__}: {error}"
        ) from error
    what = "torchao's convert_to_float8_training"
    taken = _converted(model, variant, names, what, lambda _, module: isinstance(module, Float8Linear))
    return LowbitApplied(
        f"fp8 training, {variant.fp8_training} recipe",
        "native" if native else "emulated",
        taken,
        str(getattr(torchao, "__version__", "unknown")),
    )


def _quantized(model: nn.Module, variant: Variant, device: torch.device, excluded: Collection[str]) -> LowbitApplied:
    where = f"variant {variant.name!r}"
    torchao = import_torchao(f"{where} (quantize)")
    from torchao.quantization import quantize_

    config = runnable_quantize_config(variant, device)
    kind = type(config).__name__
    names = lowbit_modules(model, variant, excluded, multiples_of_16=False)
    if not names:
        raise _no_modules(variant, model, f"quantize={quantize_description(variant.quantize)}")
    chosen = frozenset(names)
    modules = dict(model.named_modules())
    before = {name: (modules[name], _parameter_types(modules[name])) for name in names}
    try:
        with torchao_settings_kept():
            quantize_(model, config, filter_fn=lambda module, name: name in chosen)
    except Exception as error:
        raise ModelRunError(
            f"{where}: torchao's quantize_ with {kind} raised {type(error).__name__}: {error}"
        ) from error

    def quantized(name: str, module: nn.Module) -> bool:
        was, types = before[name]
        return module is not was or _parameter_types(module) != types

    taken = _converted(model, variant, names, f"torchao's quantize_ with {kind}", quantized)
    kernels = "native"
    if device.type == "cpu" and "Int8DynamicActivation" in kind and not int8_matmul_exact():
        kernels = "native, inexact int8 matmuls (oneDNN without VNNI: torch._int_mm saturates)"
    return LowbitApplied(
        f"quantized inference, {quantize_description(variant.quantize)}",
        kernels,
        taken,
        str(getattr(torchao, "__version__", "unknown")),
    )


@functools.cache
def int8_matmul_exact() -> bool:
    """Whether this CPU's int8 matmul (torch._int_mm, which torchao's int8 dynamic quantization runs) is exact.
    oneDNN without VNNI instructions (AVX2, AVX-512 without VNNI, or ONEDNN_MAX_CPU_ISA set to either) sums
    pairs of int8 products in saturating int16: full-range operands come out wrong by tens of thousands."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=generator)
    b = torch.randint(-127, 128, (64, 32), dtype=torch.int8, generator=generator)
    try:
        product = torch._int_mm(a, b)
    except RuntimeError:
        return True  # no CPU int8 matmul at all: torchao falls back to another path
    return bool(torch.equal(product.long(), a.long() @ b.long()))


def runnable_quantize_config(variant: Variant, device: torch.device) -> Any:
    """The variant's torchao config, refused (NotSupportedHere) where its kernels cannot run on `device`."""
    where = f"variant {variant.name!r}"
    config = built_quantize_config(variant.quantize, where)
    kind = type(config).__name__
    if kind in FP8_MATMUL_CONFIGS and not fp8_native(device):
        raise NotSupportedHere(
            f"{where}: {kind} runs fp8 matmuls, which need CUDA of compute capability "
            f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or higher (this run is on {_device_text(device)}); use "
            "fp8_weight_only here, or run on such a GPU"
        )
    return config


def check_runnable(variants: Iterable[Variant], device: torch.device) -> None:
    """Before any run: every variant below 16 bits has what it needs here (torchao, a config torchao builds,
    the kernels the device has), so that a comparison fails at once, not after the reference and other runs."""
    for variant in variants:
        if variant.fp8_training is not None:
            import_torchao(f"variant {variant.name!r} (fp8 training)")
        if variant.quantize is not None:
            import_torchao(f"variant {variant.name!r} (quantize)")
            runnable_quantize_config(variant, device)


def _device_text(device: torch.device) -> str:
    import torch

    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda of compute capability {major}.{minor}"


def _stored(model: nn.Module, variant: Variant, excluded: Collection[str]) -> LowbitApplied:
    import torch

    names = lowbit_modules(model, variant, excluded, multiples_of_16=False)
    if not names:
        raise _no_modules(variant, model, f"weight_storage={variant.weight_storage}")
    storage = getattr(torch, str(variant.weight_storage))
    chosen, stored = frozenset(names), set()
    try:
        with torch.no_grad():
            for name, module in model.named_modules():
                weight = getattr(module, "weight", None) if name in chosen else None
                if isinstance(weight, torch.Tensor) and weight.is_floating_point():
                    weight.copy_(storage_round_trip(weight, storage))
                    stored.add(name)
    except Exception as error:
        raise ModelRunError(
            f"variant {variant.name!r}: storing weights as {variant.weight_storage} raised "
            f"{type(error).__name__}: {error}"
        ) from error
    what = f"weight_storage={variant.weight_storage} (a floating-point weight each)"
    taken = _converted(model, variant, names, what, lambda name, _: name in stored)
    described = f"fp8 weight storage, {variant.weight_storage} scaled per tensor"
    return LowbitApplied(described, "plain casts", taken, None)


def storage_round_trip(weight: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """`weight` stored in `storage` and read back, as an fp8 checkpoint stores it: scaled so that its largest
    magnitude is the format's largest finite value (one fp32 scale per tensor), cast, then unscaled."""
    import torch

    values = weight.detach().float()
    amax = values.abs().amax()
    largest = torch.finfo(storage).max
    scale = torch.where(amax > 0, largest / amax, torch.ones_like(amax))
    return ((values * scale).to(storage).float() / scale).to(weight.dtype)


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as the run computes with it: a torchao quantized tensor dequantized (one that wraps its
    weight with an activation quantizer, torchao < 0.13's LinearActivationQuantizedTensor, through the weight
    it wraps), any other as is."""
    import torch

    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor.detach()
    wrapped = getattr(tensor, "original_weight_tensor", None)
    if isinstance(wrapped, torch.Tensor):
        return dequantized(wrapped)
    dequantize: Callable[[], torch.Tensor] | None = getattr(tensor, "dequantize", None)
    return dequantize().detach() if callable(dequantize) else tensor.detach()


__all__ = [
    "LowbitApplied",
    "apply_lowbit",
    "check_runnable",
    "dequantized",
    "fp8_native",
    "lowbit_modules",
    "storage_round_trip",
]
