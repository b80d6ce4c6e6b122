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
#: Where a config name given as text is looked up, in order.
CONFIG_NAMESPACES = ("torchao.quantization", "torchao.quantization.granularity", "torchao.dtypes")


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

    `name` is looked up in torchao.quantization (then its granularity module and torchao.dtypes). A keyword
    value may itself be {"config": "PerRow", ...} (another torchao object by name) or "torch.float8_e4m3fn"
    (a torch attribute such as a dtype).
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

    def build(self, where: str) -> Any:
        """The torchao config object."""
        return _build_object(self.name, dict(self.kwargs), where)

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


def _thawed(value: Any, where: str) -> Any:
    """The object a frozen keyword value stands for: a torchao object for a table, a torch attribute for
    "torch.<name>"."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "<table>":
        table = dict(value[1])
        name = table.pop("config", None)
        if not isinstance(name, str):
            raise ConfigurationError(f"{where}: a table among quantize's arguments needs 'config', a class name")
        return _build_object(name, table, where)
    if isinstance(value, tuple):
        return [_thawed(v, where) for v in value]
    if isinstance(value, str) and value.startswith("torch."):
        import torch

        found = getattr(torch, value.removeprefix("torch."), None)
        if found is None:
            raise ConfigurationError(f"{where}: quantize argument {value!r} is not a torch attribute")
        return found
    return value


def _shown(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "<table>":
        table = dict(value[1])
        name = table.pop("config", "?")
        return f"{name}({', '.join(f'{k}={_shown(v)}' for k, v in sorted(table.items()))})"
    return repr(value)


def _build_object(name: str, kwargs: dict[str, Any], where: str) -> Any:
    import_torchao(f"{where}: quantize={name!r}")
    for namespace in CONFIG_NAMESPACES:
        try:
            module = importlib.import_module(namespace)
        except ImportError:
            continue
        found = getattr(module, name, None)
        if isinstance(found, type):
            break
    else:
        from torchao import quantization

        known = sorted(n for n in dir(quantization) if n.endswith("Config") and not n.startswith("_"))
        raise ConfigurationError(
            f"{where}: quantize: torchao has no config {name!r} (looked in {', '.join(CONFIG_NAMESPACES)}); "
            f"its configs: {', '.join(known)}"
        )
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
    if value is None or isinstance(value, QuantizeConfig):
        return value
    if isinstance(value, str):
        return QuantizeConfig(value) if value else _wrong_quantize(value, where)
    if isinstance(value, Mapping):
        return QuantizeConfig.from_mapping(value, where)
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
    "FP8_RECIPES",
    "LOWBIT_EXTRA",
    "STORAGE_FORMATS",
    "QuantizeConfig",
    "built_quantize_config",
    "import_torchao",
    "quantize_description",
    "quantize_spec",
    "storage_format",
]
