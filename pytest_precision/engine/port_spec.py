"""Ports: another implementation of the reference model, and how its modules and parameters map onto the reference's.

A `Port` is data about the other implementation: how to build it (`model`), which of its modules correspond to which of
the reference's (`modules`, patterns over layer indices such as ``"layers.{i}" -> "model.layers.{i}"``, each with an
optional adapter for the layout of its tensors), and how its parameters correspond (`parameters`, a pattern map of
renames, transposes, fused weights and converters; or the whole-state-dict functions a framework ships, `to_reference`
and `from_reference`). engine/port_build.py builds the run's model from it; a variant runs it with
`Variant(implementation=port)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pytest_precision.base.errors import ConfigurationError

if TYPE_CHECKING:
    import torch
    from torch import nn

#: A tensor layout adapter: the other implementation's tensor -> the reference's layout.
Adapter = Callable[["torch.Tensor"], "torch.Tensor"]
#: A whole-state-dict converter, as frameworks ship them (torchtune's hf_to_tune / tune_to_hf, ...).
StateDictConverter = Callable[[dict[str, "torch.Tensor"]], dict[str, "torch.Tensor"]]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Adapted:
    """A module map target: the reference's module `name` (a pattern), with adapters from the other implementation's
    layouts to the reference's: `output` for its forward output (the fw row), `input` for the gradient at its input
    (the bw row). A ``[seq, batch, hidden]`` module against a ``[batch, seq, hidden]`` one takes both,
    ``Adapted(name, output=seq_first, input=seq_first)``; a projection whose output columns are ordered otherwise takes
    `output` only."""

    name: str
    output: Adapter | None = field(default=None, compare=False)
    input: Adapter | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Transposed:
    """A parameter map target: the reference's parameter `name`, stored transposed by the other implementation."""

    name: str


@dataclass(frozen=True)
class Fused:
    """A parameter map target: the other implementation's parameter is the reference's `names` concatenated along
    `dim` (a fused QKV projection's weight: ``Fused(("...q_proj.weight", "...k_proj.weight", "...v_proj.weight"))``).
    Its gradient is split back by the reference's sizes along `dim`."""

    names: tuple[str, ...]
    dim: int = 0


@dataclass(frozen=True)
class Converted:
    """A parameter map target: the reference's parameter `name`, related by two functions of one tensor:
    `to_reference` (the other implementation's tensor -> the reference's layout; also applied to gradients, so it must
    be a re-indexing: a permutation, a reshape, a transpose) and `from_reference` (its inverse, for loading weights)."""

    name: str
    to_reference: Adapter = field(compare=False)
    from_reference: Adapter = field(compare=False)


ModuleTarget = str | Adapted
ParameterTarget = str | Transposed | Fused | Converted


@dataclass(frozen=True)
class Layout:
    """An adapter both ways: `to_reference` (the other implementation's layout -> the reference's; what an adapter
    does) and `from_reference` (back). Calling it is `to_reference`. Isolated runs (isolate=True) need the way back,
    to feed a module the reference's input and drive its backward from the reference's gradient."""

    to_reference: Adapter = field(compare=False)
    from_reference: Adapter = field(compare=False)
    name: str = ""

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.to_reference(tensor)


def _transposed_01(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(0, 1)


#: The adapter for a ``[seq, batch, ...]`` tensor (Megatron-style layouts) against ``[batch, seq, ...]``, both ways.
seq_first = Layout(_transposed_01, _transposed_01, "seq_first")


def way_back(adapter: Adapter | None) -> tuple[bool, Adapter | None]:
    """Whether an adapter goes both ways, and its way back (the reference's layout -> the other implementation's):
    (True, None) without an adapter (the layouts are the same), (True, from_reference) for a Layout, (False, None)
    for a one-way adapter (a plain function)."""
    if adapter is None:
        return True, None
    if isinstance(adapter, Layout):
        return True, adapter.from_reference
    return False, None


@dataclass(frozen=True)
class Port:
    """Another implementation of the reference model (see the module docstring and docs/concepts/ports.md).

    model: the other implementation: an nn.Module (each run uses a copy), or a factory ``(reference) -> nn.Module``
        called with the reference's fp32 model (which it must not change) that builds the other implementation, in
        fp32, from the reference's configuration. Its weights are loaded from the reference's (see load_weights).
    modules: the other implementation's module names (patterns with ``{i}``-style placeholders over indices) to the
        reference's: a name, an Adapted(name, output=..., input=...), or a list of them (a fused module against
        several: their input-gradient rows are not comparable and are not made). Rows are named by the reference's
        modules.
    parameters: the other implementation's parameter names (patterns) to the reference's: a name, Transposed(name),
        Fused(names, dim) or Converted(name, to_reference, from_reference). Or give instead:
    to_reference, from_reference: whole-state-dict converters (other -> reference names and layouts, and back), as a
        framework ships them; `to_reference` also converts the gradients, so it must only re-index.
    load_weights: load the reference's weights into the other implementation through the map (default); False when
        the model already holds them. Either way, before anything runs, the two must hold the same weights.
    forward: ``forward(model, inputs) -> output`` calling the other implementation on the reference's inputs and
        returning what the reference's loss reads (``.loss`` / ``.logits``, or what loss_fn takes); default: the
        reference's call, the same inputs (``model(**inputs)`` for a dict, ``model(x)`` for a tensor).
        pytest_precision.ports.causal_lm_forward serves models returning logits.
    name: how reports name the implementation (default: the model's class name).
    """

    model: Any
    modules: Mapping[str, ModuleTarget | Sequence[ModuleTarget]]
    parameters: Mapping[str, ParameterTarget] | None = None
    to_reference: StateDictConverter | None = field(default=None, compare=False)
    from_reference: StateDictConverter | None = field(default=None, compare=False)
    load_weights: bool = True
    forward: Callable[[Any, Any], Any] | None = field(default=None, compare=False)
    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigurationError(f"Port: name must be a non-empty string (how reports name it), got {self.name!r}")
        where = f"Port({self.label})"
        if not isinstance(self.modules, Mapping) or not self.modules:
            raise ConfigurationError(
                f"{where}: modules must map the other implementation's module names to the reference's, e.g. "
                "{'layers.{i}': 'model.layers.{i}'}"
            )
        object.__setattr__(self, "modules", {str(k): _module_targets(k, v, where) for k, v in self.modules.items()})
        if (self.parameters is None) == (self.to_reference is None):
            raise ConfigurationError(
                f"{where}: give the parameter correspondence once: parameters={{...}} (a pattern map) or "
                "to_reference=<state-dict converter> (with from_reference to load weights)"
            )
        if self.parameters is not None:
            if not isinstance(self.parameters, Mapping):
                raise ConfigurationError(f"{where}: parameters must be a dict, got {type(self.parameters).__name__}")
            object.__setattr__(
                self, "parameters", {str(k): _parameter_target(k, v, where) for k, v in self.parameters.items()}
            )
        for function in ("to_reference", "from_reference", "forward"):
            value = getattr(self, function)
            if value is not None and not callable(value):
                raise ConfigurationError(f"{where}: {function} must be a callable, got {type(value).__name__}")
        if not isinstance(self.load_weights, bool):
            raise ConfigurationError(f"{where}: load_weights must be True or False, got {self.load_weights!r}")
        if self.load_weights and self.to_reference is not None and self.from_reference is None:
            raise ConfigurationError(
                f"{where}: load_weights=True with to_reference needs from_reference (reference state dict -> the "
                "other implementation's) to load the weights; or load_weights=False when the model holds them"
            )

    @property
    def module_targets(self) -> dict[str, tuple[Adapted, ...]]:
        """The module map, each entry's targets as Adapted (as __post_init__ normalised them)."""
        return cast(dict[str, tuple[Adapted, ...]], self.modules)

    @property
    def label(self) -> str:
        """The implementation's name in reports: `name`, else the model's class, else the factory's name."""
        if self.name:
            return self.name
        if hasattr(self.model, "named_modules"):
            return type(self.model).__name__
        named = str(getattr(self.model, "__name__", "") or "")
        return named if named and named != "<lambda>" else "port"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: the name, the module map's patterns and how parameters correspond."""
        modules = {other: [target.name for target in targets] for other, targets in self.module_targets.items()}
        return {
            "name": self.label,
            "modules": modules,
            "parameters": "state-dict converter" if self.parameters is None else len(self.parameters),
        }


def _module_targets(other: object, value: object, where: str) -> tuple[Adapted, ...]:
    pattern(str(other), where)
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    targets: list[Adapted] = []
    for item in items:
        if isinstance(item, str):
            item = Adapted(item)
        if not isinstance(item, Adapted) or not isinstance(item.name, str):
            raise ConfigurationError(
                f"{where}: modules[{other!r}] must be a reference module name, Adapted(name, output=..., input=...) "
                "or a list of "
                f"them, got {type(item).__name__}"
            )
        for adapter in (item.output, item.input):
            if adapter is not None and not callable(adapter):
                raise ConfigurationError(f"{where}: modules[{other!r}]: an adapter must be a callable tensor -> tensor")
        _same_placeholders(str(other), item.name, where, "modules")
        targets.append(item)
    if not targets:
        raise ConfigurationError(f"{where}: modules[{other!r}] is empty")
    return tuple(targets)


def _parameter_target(other: object, value: object, where: str) -> ParameterTarget:
    pattern(str(other), where)
    if isinstance(value, (str, Transposed, Converted)):
        name = value if isinstance(value, str) else value.name
        _same_placeholders(str(other), name, where, "parameters")
        if isinstance(value, Converted) and not (callable(value.to_reference) and callable(value.from_reference)):
            raise ConfigurationError(f"{where}: parameters[{other!r}]: Converted needs two callables")
        return value
    if isinstance(value, Fused):
        if isinstance(value.names, str) or not value.names or not all(isinstance(n, str) for n in value.names):
            raise ConfigurationError(f"{where}: parameters[{other!r}]: Fused needs the reference's parameter names")
        for name in value.names:
            _same_placeholders(str(other), name, where, "parameters")
        object.__setattr__(value, "names", tuple(value.names))
        return value
    raise ConfigurationError(
        f"{where}: parameters[{other!r}] must be a reference parameter name, Transposed, Fused or Converted, got "
        f"{type(value).__name__}"
    )


def _same_placeholders(other: str, reference: str, where: str, table: str) -> None:
    if set(_PLACEHOLDER.findall(other)) != set(_PLACEHOLDER.findall(reference)):
        raise ConfigurationError(
            f"{where}: {table}[{other!r}] -> {reference!r}: both sides must use the same placeholders (such as {{i}})"
        )


def pattern(text: str, where: str) -> re.Pattern[str]:
    """The full-match regex of a name pattern: literal text, and ``{name}`` placeholders matching an index."""
    if not isinstance(text, str) or not text:
        raise ConfigurationError(f"{where}: a name pattern must be a non-empty string, got {text!r}")
    parts: list[str] = []
    seen: set[str] = set()
    position = 0
    for match in _PLACEHOLDER.finditer(text):
        parts.append(re.escape(text[position : match.start()]))
        key = match.group(1)
        parts.append(f"(?P={key})" if key in seen else f"(?P<{key}>[0-9]+)")
        seen.add(key)
        position = match.end()
    parts.append(re.escape(text[position:]))
    return re.compile("".join(parts))


def matched(text: str, name: str) -> dict[str, str] | None:
    """The placeholder values when `name` matches the pattern `text`, else None."""
    found = pattern(text, "pattern").fullmatch(name)
    return None if found is None else found.groupdict()


def filled(text: str, values: Mapping[str, str]) -> str:
    """The pattern `text` with its placeholders filled from `values`."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def modules_of(model: nn.Module) -> list[str]:
    """A model's module names, the root left out."""
    return [name for name, _ in model.named_modules() if name]
