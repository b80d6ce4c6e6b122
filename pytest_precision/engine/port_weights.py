"""A port's weights both ways (engine/port_spec.py): the reference's weights as the other implementation's state dict
(to load them), the other implementation's tensors (weights and gradients) under the reference's names and layouts,
and the check that the two implementations hold the same weights."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.engine.port_spec import Converted, Fused, ParameterTarget, Port, Transposed, filled, matched

if TYPE_CHECKING:
    import torch
    from torch import nn

Tensors = dict[str, "torch.Tensor"]


def where(port: Port) -> str:
    """How messages name the port."""
    return f"implementation {port.label!r}"


class ParameterMap:
    """The parameter correspondence of a port, both ways, for one pair of models."""

    def __init__(self, port: Port, reference_shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.port = port
        self.shapes = reference_shapes

    def to_reference(self, tensors: Tensors) -> Tensors:
        """The other implementation's tensors (weights or gradients) by the reference's names, in its layouts."""
        port = self.port
        if port.parameters is None:
            assert port.to_reference is not None
            return _called(port.to_reference, tensors, port, "to_reference")
        result: Tensors = {}
        for name, tensor in tensors.items():
            target, values = self._entry(name)
            result.update(self._converted(target, values, tensor))
        return result

    def _entry(self, name: str) -> tuple[ParameterTarget, dict[str, str]]:
        """The parameter map's entry for the other implementation's parameter `name`, and its placeholder values."""
        assert self.port.parameters is not None
        for text, target in self.port.parameters.items():
            values = matched(text, name)
            if values is not None:
                return target, values
        raise ConfigurationError(
            f"{where(self.port)}: parameter {name!r} of the other implementation matches no pattern of "
            "parameters=; map it to the reference's parameter it holds"
        )

    def _converted(self, target: object, values: Mapping[str, str], tensor: torch.Tensor) -> Tensors:
        if isinstance(target, str):
            return {filled(target, values): tensor}
        if isinstance(target, Transposed):
            return {filled(target.name, values): tensor.transpose(0, 1)}
        if isinstance(target, Converted):
            return {filled(target.name, values): target.to_reference(tensor)}
        assert isinstance(target, Fused)
        names = [filled(n, values) for n in target.names]
        missing = [n for n in names if n not in self.shapes]
        if missing:
            raise ConfigurationError(f"{where(self.port)}: Fused names {', '.join(missing)}, not reference parameters")
        sizes = [self.shapes[n][target.dim] for n in names]
        import torch

        return dict(zip(names, torch.split(tensor, sizes, dim=target.dim), strict=True))

    def from_reference(self, tensors: Tensors, other_names: Sequence[str]) -> Tensors:
        """The reference's weights as the other implementation's state dict (for load_state_dict)."""
        port = self.port
        if port.parameters is None:
            assert port.from_reference is not None
            return _called(port.from_reference, tensors, port, "from_reference")
        import torch

        result: Tensors = {}
        for name in other_names:
            target, values = self._entry(name)
            if isinstance(target, Fused):
                parts = [_needed(tensors, filled(n, values), name, port) for n in target.names]
                result[name] = torch.cat(parts, dim=target.dim)
            elif isinstance(target, str):
                result[name] = _needed(tensors, filled(target, values), name, port)
            elif isinstance(target, Transposed):
                result[name] = _needed(tensors, filled(target.name, values), name, port).transpose(0, 1)
            else:
                result[name] = target.from_reference(_needed(tensors, filled(target.name, values), name, port))
        return result


def _needed(tensors: Tensors, name: str, other: str, port: Port) -> torch.Tensor:
    if name not in tensors:
        raise ConfigurationError(
            f"{where(port)}: parameters= maps {other!r} to {name!r}, which the reference model does not have"
        )
    return tensors[name]


def _called(function: Callable[[Tensors], Tensors], tensors: Tensors, port: Port, which: str) -> Tensors:
    try:
        result = function(dict(tensors))
    except (ConfigurationError, ModelRunError):
        raise
    except Exception as error:
        raise ModelRunError(f"{where(port)}: {which} raised {type(error).__name__}: {error}") from error
    if not isinstance(result, Mapping):
        raise ConfigurationError(f"{where(port)}: {which} returned {type(result).__name__}, not a state dict")
    return dict(result)


def load_weights(model: nn.Module, state: Tensors, port: Port) -> None:
    """Load `state` into the other implementation's parameters, refusing any it leaves out or does not have."""
    import torch

    parameters = dict(model.named_parameters(remove_duplicate=False))
    unknown = sorted(set(state) - set(parameters) - set(model.state_dict()))
    if unknown:
        raise ConfigurationError(
            f"{where(port)}: the converted weights name {', '.join(unknown[:6])}, which the other implementation "
            "does not have; check the parameter map"
        )
    left = [name for name in parameters if name not in state]
    if left:
        raise ConfigurationError(
            f"{where(port)}: the parameter map gives no weight for {', '.join(left[:6])} of the other implementation; "
            "map them to the reference's parameters"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            target = parameters.get(name)
            if target is None:
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                raise ConfigurationError(
                    f"{where(port)}: the weight for {name!r} has shape {tuple(tensor.shape)}, the other "
                    f"implementation's is {tuple(target.shape)}; check its entry in the parameter map"
                )
            target.copy_(tensor)


def check_same_weights(reference: Tensors, converted: Tensors, port: Port, aliases: set[str] | None = None) -> int:
    """Refuse two implementations holding different weights, naming the first reference parameter that differs (in
    the reference's order); the number of parameters compared. `aliases`: every name of the reference's parameters
    (tied ones under each of their names), which the map may also give."""
    import torch

    for name, weight in reference.items():
        other = converted.get(name)
        if other is None:
            raise ConfigurationError(
                f"{where(port)}: the reference's parameter {name!r} has no counterpart in the other implementation "
                "through the parameter map; map the parameter that holds it"
            )
        if tuple(other.shape) != tuple(weight.shape):
            raise ConfigurationError(
                f"{where(port)}: parameter {name!r} has shape {tuple(other.shape)} in the other implementation "
                f"(through the map), {tuple(weight.shape)} in the reference; check its entry in the parameter map"
            )
        same = torch.equal(other.detach().to(weight.device, weight.dtype), weight.detach())
        if not same:
            difference = (other.detach().double().to(weight.device) - weight.detach().double()).abs()
            largest = float(difference.nan_to_num(nan=float("inf")).max())
            raise ConfigurationError(
                f"{where(port)}: the two implementations hold different weights: parameter {name!r} differs "
                f"(max |difference| {largest:.3g}); comparing two implementations with different weights measures "
                "nothing: load the reference's weights (load_weights=True) or fix the parameter map"
            )
    extra = sorted(set(converted) - set(reference) - (aliases or set()))
    if extra:
        raise ConfigurationError(
            f"{where(port)}: the parameter map gives {', '.join(extra[:6])}, which the reference model does not have"
        )
    return len(reference)
