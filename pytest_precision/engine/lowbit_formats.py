"""Formats below 16 bits, as a Variant names them: an fp8 training recipe, a torchao quantization config, an fp8
weight storage format. Plain values here (torchao is imported only when a run builds one); lowbit_build.py
applies them to a run's model."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_precision.base.errors import ConfigurationError

#: torchao.float8 training recipes (Float8LinearConfig.from_recipe_name).
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: fp8 weight storage formats: weights round-tripped through them (scaled per tensor).
STORAGE_FORMATS = ("float8_e4m3fn", "float8_e5m2")
#: How to get torchao, in every message that needs it.
LOWBIT_EXTRA = 'pip install "pytest-precision[lowbit]"'
#: The torchao quantization configs a variant may name (torchao 0.9 to 0.18; one this torchao lacks is refused
#: naming it). A fixed list, looked up in torchao.quantization only: a name is data, never a path to walk.
CONFIG_NAMES: frozenset[str] = frozenset(
    {
        "Float8DynamicActivationFloat8WeightConfig",
        "Float8DynamicActivationInt4WeightConfig",
        "Float8StaticActivationFloat8WeightConfig",
        "Float8WeightOnlyConfig",
        "FPXWeightOnlyConfig",
        "GemliteUIntXWeightOnlyConfig",
        "Int4DynamicActivationInt4WeightConfig",
        "Int4WeightOnlyConfig",
        "Int8DynamicActivationInt4WeightConfig",
        "Int8DynamicActivationInt8WeightConfig",
        "Int8DynamicActivationIntxWeightConfig",
        "Int8StaticActivationInt8WeightConfig",
        "Int8WeightOnlyConfig",
        "IntxWeightOnlyConfig",
        "UIntXWeightOnlyConfig",
    }
)
#: The torchao objects a config's argument may name ({"config": "PerRow"}): granularities, the fp8 matmul
#: settings and the layouts of older torchao.
ARGUMENT_NAMES: frozenset[str] = frozenset(
    {
        "PerAxis",
        "PerBlock",
        "PerGroup",
        "PerRow",
        "PerTensor",
        "PerToken",
        "Float8MMConfig",
        "PlainLayout",
        "TensorCoreTiledLayout",
        "Int4CPULayout",
        "Int4XPULayout",
        "MarlinSparseLayout",
        "SemiSparseLayout",
        "Float8Layout",
        "MarlinQQQLayout",
        "CutlassInt4PackedLayout",
    }
)
#: Where an argument object's name is looked up, in order.
ARGUMENT_NAMESPACES = ("torchao.quantization.granularity", "torchao.quantization", "torchao.dtypes")
#: The torch dtypes an argument may name as "torch.<name>" (weight_dtype="torch.float8_e5m2", ...).
TORCH_DTYPE_NAMES: frozenset[str] = frozenset(
    {
        "float64",
        "float32",
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        *(f"int{bits}" for bits in range(1, 8)),
        *(f"uint{bits}" for bits in range(1, 8)),
    }
)


def import_torchao(purpose: str) -> Any:
    """The torchao module, or a ConfigurationError saying `purpose` needs the lowbit extra."""
    try:
        return importlib.import_module("torchao")
    except ImportError as error:
        raise ConfigurationError(
            f"{purpose} needs torchao, which is not installed ({error}): {LOWBIT_EXTRA} (the torchao version "
            "tested with each torch is in docs/concepts/low-bit.md)"
        ) from None


@dataclass(frozen=True)
class QuantizeConfig:
    """A torchao quantization config by its class name and keyword arguments, built when a run needs it.

    `name` is one of CONFIG_NAMES, looked up in torchao.quantization. A keyword value may itself be
    {"config": "PerRow", ...} (one of ARGUMENT_NAMES) or "torch.float8_e4m3fn" (one of TORCH_DTYPE_NAMES).
    Every name is checked against these lists before anything is looked up (check_names), so a file names
    data, never a path to code.
    """

    name: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any], where: str) -> QuantizeConfig:
        """From {"config": name, **kwargs}; `where` heads the error of a spec without a config name."""
        name = spec.get("config")
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"{where}: quantize as a table needs 'config', a torchao config class name such as "
                f"'Int8WeightOnlyConfig', and its keyword arguments, got {dict(spec)!r}"
            )
        return cls(name, tuple(sorted((str(k), _frozen(v)) for k, v in spec.items() if k != "config")))

    def check_names(self, where: str) -> None:
        """Refuse a config, argument object or torch dtype name that is not listed; needs neither torch nor
        torchao."""
        _checked_name(self.name, CONFIG_NAMES, "config", where)
        for value in dict(self.kwargs).values():
            _check_argument_names(value, where)

    def build(self, where: str) -> Any:
        """The torchao config object."""
        self.check_names(where)
        return _build_object(self.name, dict(self.kwargs), where, config=True)

    def describe(self) -> str:
        arguments = ", ".join(f"{key}={_shown(value)}" for key, value in self.kwargs)
        return f"{self.name}({arguments})"


def _frozen(value: Any) -> Any:
    """A hashable copy of a JSON/TOML value (lists become tuples, tables sorted item tuples tagged as such)."""
    if isinstance(value, Mapping):
        return ("<table>", tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _is_table(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and value[0] == "<table>"


def _checked_name(name: object, allowed: frozenset[str], what: str, where: str) -> str:
    """`name` when it is one of `allowed`, else a ConfigurationError listing them."""
    if not isinstance(name, str) or name not in allowed:
        listed = ", ".join(sorted(allowed))
        if what == "config":
            raise ConfigurationError(
                f"{where}: quantize: torchao has no config {name!r} a variant may name; its configs: {listed}"
            )
        raise ConfigurationError(f"{where}: quantize: {name!r} is not a {what} a variant may name; use one of {listed}")
    return name


def _check_argument_names(value: Any, where: str) -> None:
    """Refuse an argument that names an unlisted torchao object or torch dtype, at any depth of lists."""
    if _is_table(value):
        table = dict(value[1])
        name = table.pop("config", None)
        if not isinstance(name, str):
            raise ConfigurationError(f"{where}: a table among quantize's arguments needs 'config', a class name")
        _checked_name(name, ARGUMENT_NAMES, "torchao argument object", where)
        for inner in table.values():
            _check_argument_names(inner, where)
    elif isinstance(value, tuple):
        for inner in value:
            _check_argument_names(inner, where)
    elif isinstance(value, str) and value.startswith("torch."):
        _checked_name(value.removeprefix("torch."), TORCH_DTYPE_NAMES, "torch dtype (torch.<name>)", where)


def _thawed(value: Any, where: str) -> Any:
    """The object a frozen keyword value stands for (its names checked by _check_argument_names): a torchao
    object for a table, a torch dtype for "torch.<name>"."""
    _check_argument_names(value, where)  # again here: no name reaches getattr unchecked
    if _is_table(value):
        table = dict(value[1])
        name = str(table.pop("config"))
        return _build_object(name, table, where, config=False)
    if isinstance(value, tuple):
        return [_thawed(v, where) for v in value]
    if isinstance(value, str) and value.startswith("torch."):
        import torch

        found = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(found, torch.dtype):
            raise ConfigurationError(
                f"{where}: quantize argument {value!r} is not a dtype of this torch ({torch.__version__})"
            )
        return found
    return value


def _shown(value: Any) -> str:
    if _is_table(value):
        table = dict(value[1])
        name = table.pop("config", "?")
        return f"{name}({', '.join(f'{k}={_shown(v)}' for k, v in sorted(table.items()))})"
    return repr(value)


def _build_object(name: str, kwargs: dict[str, Any], where: str, *, config: bool) -> Any:
    """A torchao config (`config`) or argument object named `name` (already checked against its list), built
    with `kwargs`."""
    torchao = import_torchao(f"{where}: quantize={name!r}")
    found: Any = None
    for namespace in ("torchao.quantization",) if config else ARGUMENT_NAMESPACES:
        try:
            module = importlib.import_module(namespace)
        except ImportError:
            continue
        found = getattr(module, name, None)
        if isinstance(found, type):
            break
    version = getattr(torchao, "__version__", "unknown")
    if not isinstance(found, type):
        raise ConfigurationError(f"{where}: quantize: this torchao ({version}) has no {name!r}; use another torchao")
    if config:
        from torchao.core.config import AOBaseConfig

        if not issubclass(found, AOBaseConfig):
            raise ConfigurationError(f"{where}: quantize: {name!r} is not a quantization config in torchao {version}")
    arguments = {key: _thawed(value, where) for key, value in kwargs.items()}
    try:
        return found(**arguments)
    except (TypeError, ValueError, ImportError, AssertionError) as error:
        raise ConfigurationError(f"{where}: quantize: {name}({_arguments(kwargs)}) was refused: {error}") from None


def _arguments(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{key}={_shown(value)}" for key, value in sorted(kwargs.items()))


def quantize_spec(value: Any, where: str) -> Any:
    """A Variant's `quantize`, normalised: None, a QuantizeConfig (from a class name or a {"config": ...}
    table), or a torchao config object kept as given."""
    if value is None:
        return value
    if isinstance(value, (str, Mapping, QuantizeConfig)):
        if isinstance(value, str):
            spec = QuantizeConfig(value) if value else _wrong_quantize(value, where)
        else:
            spec = value if isinstance(value, QuantizeConfig) else QuantizeConfig.from_mapping(value, where)
        spec.check_names(where)  # before anything is looked up: a name is data
        return spec
    if isinstance(value, (bool, int, float, list, tuple)):
        return _wrong_quantize(value, where)
    return value  # a torchao config object (AOBaseConfig); quantize_ checks it when the run builds


def _wrong_quantize(value: Any, where: str) -> Any:
    raise ConfigurationError(
        f"{where}: quantize must be a torchao config (e.g. torchao.quantization.Int8WeightOnlyConfig()), a config "
        f"class name, or {{'config': name, **kwargs}}; got {value!r}"
    )


def quantize_description(value: Any) -> str | None:
    """How reports and baselines name a variant's quantize config (the object's repr, one line)."""
    if value is None:
        return None
    if isinstance(value, QuantizeConfig):
        return value.describe()
    return " ".join(repr(value).split())


def built_quantize_config(value: Any, where: str) -> Any:
    """The torchao config object a normalised `quantize` stands for; anything but a torchao config is refused."""
    config = value.build(where) if isinstance(value, QuantizeConfig) else value
    from torchao.core.config import AOBaseConfig

    if not isinstance(config, AOBaseConfig):
        _wrong_quantize(config, where)
    return config


def storage_format(value: Any) -> Any:
    """A weight storage format given as text or as a torch dtype (torch.float8_e4m3fn), as text."""
    return str(value).removeprefix("torch.") if value is not None and not isinstance(value, str) else value


__all__ = [
    "ARGUMENT_NAMES",
    "CONFIG_NAMES",
    "FP8_RECIPES",
    "LOWBIT_EXTRA",
    "STORAGE_FORMATS",
    "TORCH_DTYPE_NAMES",
    "QuantizeConfig",
    "built_quantize_config",
    "import_torchao",
    "quantize_description",
    "quantize_spec",
    "storage_format",
]
