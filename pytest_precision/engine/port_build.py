"""Build a port's run model (engine/port_spec.py): the other implementation, holding the reference's weights through
the parameter map (checked equal before anything runs), and translate its captured tensors into the reference's rows.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.engine.port_spec import (
    Adapted,
    Port,
    filled,
    matched,
    modules_of,
    way_back,
)
from pytest_precision.engine.port_weights import ParameterMap, check_same_weights, load_weights, where

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pytest_precision.engine.capture import Sink
    from pytest_precision.engine.isolated import Counterpart
    from pytest_precision.engine.variants import Variant


def reference_model(source: Any, device: torch.device) -> nn.Module:
    """The reference implementation's fp32 model: the user's model itself (read only), or a factory's product."""
    import torch
    from torch import nn

    if isinstance(source, nn.Module):
        return source
    if callable(source):
        model = source(torch.float32, device)
        if isinstance(model, nn.Module):
            return model
    raise ConfigurationError(
        "a port variant compares another implementation against the reference's model: pass the model (or a factory "
        "(dtype, device) -> nn.Module), unsharded, in one process"
    )


def _other_model(port: Port, reference: nn.Module, device: torch.device) -> nn.Module:
    """The other implementation in fp32 on `device`: a copy of the given model, or the factory's product."""
    from torch import nn

    from pytest_precision.engine.model_build import cast_parameters

    if isinstance(port.model, nn.Module):
        model = copy.deepcopy(port.model)
    elif callable(port.model):
        try:
            model = port.model(reference)
        except (ConfigurationError, ModelRunError):
            raise
        except Exception as error:
            raise ModelRunError(
                f"{where(port)}: its factory raised {type(error).__name__}: {error} (a port's factory is called as "
                "factory(reference_model) and returns the other implementation)"
            ) from error
    else:
        raise ConfigurationError(f"{where(port)}: model must be an nn.Module or a factory (reference) -> nn.Module")
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"{where(port)}: the factory returned {type(model).__name__}, not an nn.Module")
    _check_own(model, reference, port)
    model = model.to(device)
    cast_parameters(model, "float32")
    for parameter in model.parameters():
        parameter.grad = None
    return model


#: The models port factories returned, held weakly: one returned twice would be loaded, cast and run by two runs.
_PRODUCTS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _check_own(model: nn.Module, reference: nn.Module, port: Port) -> None:
    """Refuse a factory product that is not the run's own: the reference model (or one sharing its parameters), or a
    model a factory returned before. The run loads weights into it and casts it: the caller's model would change."""

    def storages(module: nn.Module) -> set[int]:
        return {p.data_ptr() for p in module.parameters() if p.numel()}

    shared = storages(reference) & storages(model)
    if model is reference or shared:
        raise ConfigurationError(
            f"{where(port)}: the factory returned the reference model, or a model sharing its parameters; it must "
            "build a new model of the other implementation (the run loads the reference's weights into it)"
        )
    if model in _PRODUCTS:
        raise ConfigurationError(
            f"{where(port)}: the factory returned the same {type(model).__name__} object for two runs; build a new "
            "model each call, or pass the model itself as Port(model=...), which each run copies"
        )
    _PRODUCTS.add(model)


@dataclass
class PortModel:
    """A port's model built for one run, and how its captured tensors become the reference's rows."""

    model: nn.Module
    parameter_map: ParameterMap
    #: The other implementation's module name -> the reference's modules its rows stand for (selected ones only).
    rows: dict[str, tuple[Adapted, ...]]
    unmapped_reference: list[str]
    unmapped_other: list[str]
    weights_checked: int
    reference_order: list[str] = field(default_factory=list)
    #: The reference's parameters that require grad: the only ones with "grad" rows.
    reference_trainable: set[str] = field(default_factory=set)
    #: Every module of the other implementation the map matched -> the reference module it stands for.
    counterparts: dict[str, str] = field(default_factory=dict)

    @property
    def captured(self) -> list[str]:
        """The other implementation's modules to hook."""
        return list(self.rows)

    @property
    def port(self) -> Port:
        return self.parameter_map.port

    def facts(self) -> dict[str, Any]:
        """What the run's RunInfo records of the port."""
        return {
            **self.parameter_map.port.to_dict(),
            "class": type(self.model).__name__,
            "weights_checked": self.weights_checked,
            "unmapped_reference": list(self.unmapped_reference),
            "unmapped_implementation": list(self.unmapped_other),
        }

    def sink(self, sink: Sink) -> Sink:
        """`sink` fed the reference's row names: fw and bw rows renamed through the module map and adapted."""

        def translated(name: str, kind: str, tensor: torch.Tensor) -> None:
            if kind not in ("fw", "bw"):
                sink(name, kind, tensor)
                return
            base, hash_sign, call = name.partition("#")
            targets = self.rows.get(base)
            if targets is None:  # not a module's row: the logits' gradient
                sink(name, kind, tensor)
                return
            if kind == "bw" and len(targets) > 1:
                return  # a fused module's input gradient sums its parts': no reference row is it
            for target in targets:
                adapt = target.output if kind == "fw" else target.input
                try:
                    adapted = tensor if adapt is None else adapt(tensor)
                except Exception as error:
                    raise ModelRunError(
                        f"{where(self.parameter_map.port)}: the adapter of {base!r} -> {target.name!r} raised "
                        f"{type(error).__name__}: {error} on its {kind} tensor of shape {tuple(tensor.shape)}"
                    ) from error
                sink(target.name + hash_sign + call, kind, adapted)

        return translated

    def isolation_boundaries(self, boundaries: Sequence[str]) -> dict[str, Counterpart]:
        """The other implementation's modules standing for the reference's isolation boundaries, each with the way
        back from the reference's layouts (isolated.Counterpart). A boundary without a counterpart is left out (it
        has no rows: the report lists it unmapped); one standing in a fused module, or whose adapter only goes one
        way, is a ConfigurationError naming it."""
        heading = f"isolate=True with {where(self.port)}"
        found: dict[str, Counterpart] = {}
        for boundary in boundaries:
            other = next((o for o, reference in self.counterparts.items() if reference == boundary), None)
            targets = self.rows.get(other, ()) if other is not None else ()
            if other is None or not targets:
                continue
            if len(targets) > 1:
                raise ConfigurationError(
                    f"{heading}: {other!r} stands for {len(targets)} reference modules (a fused module); its input is "
                    f"not {boundary!r}'s alone: select modules around it"
                )
            target = targets[0]
            (input_ok, input_back), (output_ok, output_back) = way_back(target.input), way_back(target.output)
            if not (input_ok and output_ok):
                raise ConfigurationError(
                    f"{heading}: the adapter of {other!r} -> {boundary!r} goes one way; give a "
                    "pytest_precision.ports.Layout(to_reference, from_reference) so that its module can be fed the "
                    "reference's input and gradient"
                )
            found[other] = (boundary, input_back, output_back)
        return found

    def owned(self, boundaries: Sequence[str]) -> set[str]:
        """The other implementation's parameters used only inside its boundary modules (isolated.owned_parameters)."""
        from pytest_precision.engine.isolated import owned_parameters

        return owned_parameters(self.model, boundaries)

    def gradients(self, sink: Sink, only: set[str] | None = None) -> None:
        """After backward: the other implementation's parameter gradients (of `only` when given), converted to the
        reference's names and layouts, streamed to `sink` as "grad" rows (in the reference's reverse parameter order,
        as backward fills them)."""
        grads = {
            n: p.grad
            for n, p in self.model.named_parameters()
            if p.requires_grad and p.grad is not None and (only is None or n in only)
        }
        converted = self.parameter_map.to_reference(grads)
        for name in reversed(self.reference_order):
            if name in converted and name in self.reference_trainable:
                sink(name, "grad", converted[name])

    def origin(self, where: str) -> str:
        """Where NaN/Inf first appeared ("name (fw)", a module of the other implementation), by the reference's
        module name where the map has one, else by the other implementation's own, said so."""
        name, _, kind = where.rpartition(" ")
        base, hash_sign, call = name.partition("#")
        counterpart = self.counterparts.get(base)
        if counterpart is not None:
            return f"{counterpart}{hash_sign}{call} {kind}"
        if base not in dict(self.model.named_modules()):  # the model itself, named by its class
            return f"the top-level forward of {self.port.label} {kind}"
        return f"{name} {kind} (a module of {self.port.label}, mapped to none of the reference's)"

    def weights(self, sink: Sink, kind: str) -> None:
        """The other implementation's parameters, as the reference's, streamed to `sink` as `kind` rows."""
        from pytest_precision.engine.lowbit_build import dequantized

        held = {n: dequantized(p) for n, p in self.model.named_parameters() if p.is_floating_point()}
        converted = self.parameter_map.to_reference(held)
        for name in self.reference_order:
            if name in converted:
                sink(name, kind, converted[name])


def _module_rows(
    port: Port, other: nn.Module, selected: Sequence[str]
) -> tuple[dict[str, tuple[Adapted, ...]], set[str], dict[str, str]]:
    """Per module of the other implementation, the selected reference modules it stands for; every module of the
    other implementation that any pattern matched; and per reference module, the other implementation's module
    mapped to it."""
    wanted = set(selected)
    rows: dict[str, tuple[Adapted, ...]] = {}
    sources: dict[str, str] = {}
    used = dict.fromkeys(port.modules, False)
    matched_modules: set[str] = set()
    for name in modules_of(other):
        for text, targets in port.module_targets.items():
            values = matched(text, name)
            if values is None:
                continue
            used[text] = True
            matched_modules.add(name)
            resolved = []
            for target in targets:
                reference_name = filled(target.name, values)
                if reference_name in sources:
                    raise ConfigurationError(
                        f"{where(port)}: modules {sources[reference_name]!r} and {name!r} both map to the reference's "
                        f"{reference_name!r}; map one module to it"
                    )
                sources[reference_name] = name
                if reference_name in wanted:
                    resolved.append(Adapted(reference_name, target.output, target.input))
            if resolved:
                rows[name] = tuple(resolved)
            break
    unused = [text for text, hit in used.items() if not hit]
    if unused:
        sample = ", ".join(modules_of(other)[:8])
        raise ConfigurationError(
            f"{where(port)}: module pattern(s) {', '.join(map(repr, unused))} match no module of "
            f"{type(other).__name__} (its modules: {sample}, ...)"
        )
    return rows, matched_modules, sources


def _mark_head(other: nn.Module, reference: nn.Module, sources: Mapping[str, str]) -> None:
    """Give the other implementation (the run's own copy) the reference's `get_output_embeddings` through the module
    map, when it has none: its output head is then what "<output head>" names in fp32_modules, kept in high precision
    by the low-bit formats and returning fp32 logits when computed in fp32, as the reference's head is."""
    from pytest_precision.engine.model_build import head_module_name

    if callable(getattr(other, "get_output_embeddings", None)):
        return
    try:
        mapped = sources.get(head_module_name(reference))
    except ConfigurationError:  # the reference has no output head to map
        return
    if mapped is None:
        return
    module = other.get_submodule(mapped)
    object.__setattr__(other, "get_output_embeddings", lambda: module)


def _unmapped_other(other: nn.Module, matched_modules: set[str]) -> list[str]:
    """Modules of the other implementation holding parameters of their own that no mapped module contains."""
    unmapped = []
    for name, module in other.named_modules():
        if not name or not any(p is not None for p in module._parameters.values()):
            continue
        if not any(name == m or name.startswith(m + ".") for m in matched_modules):
            unmapped.append(name)
    return unmapped


def build_port_model(
    source: Any,
    port: Port,
    device: torch.device,
    selected: Sequence[str],
) -> tuple[nn.Module, PortModel]:
    """The other implementation in fp32 holding the reference's weights (checked equal through the map), and how its
    tensors become the reference's rows. The caller casts and prepares it for the variant."""
    reference = reference_model(source, device)
    weights = {n: p.detach() for n, p in reference.named_parameters()}
    all_names = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    shapes = {n: tuple(t.shape) for n, t in all_names.items()}
    parameter_map = ParameterMap(port, shapes)
    other = _other_model(port, reference, device)
    if port.load_weights:
        # Copies: a converter may work in place, and these are the caller's model's own tensors.
        state = parameter_map.from_reference(
            {n: t.float().clone() for n, t in all_names.items()},
            [n for n, _ in other.named_parameters(remove_duplicate=False)],
        )
        load_weights(other, state, port)
    held = {n: p.detach() for n, p in other.named_parameters()}
    converted = parameter_map.to_reference(held)
    checked = check_same_weights({n: t.float() for n, t in weights.items()}, converted, port, aliases=set(all_names))
    rows, matched_modules, sources = _module_rows(port, other, selected)
    counterparts = {other_name: name for name, other_name in sources.items()}
    _mark_head(other, reference, sources)
    mapped = {t.name for targets in rows.values() for t in targets}
    built = PortModel(
        model=other,
        parameter_map=parameter_map,
        rows=rows,
        unmapped_reference=[name for name in selected if name not in mapped],
        unmapped_other=_unmapped_other(other, matched_modules),
        weights_checked=checked,
        reference_order=list(weights),
        reference_trainable={n for n, p in reference.named_parameters() if p.requires_grad},
        counterparts=counterparts,
    )
    return other, built


def build_port_run_model(
    source: Any, variant: Variant, device: torch.device, selected: Sequence[str] | None
) -> tuple[nn.Module, PortModel]:
    """The model a port variant's run uses: the other implementation holding the reference's weights (checked equal),
    then cast and prepared as the variant says (model_build.build_run_model), and how its tensors become the
    reference's rows. `selected`: the reference's module selection (None: the reference has not run)."""
    import dataclasses

    from pytest_precision.engine.model_build import build_run_model

    port = variant.port
    assert port is not None
    if selected is None:
        raise ConfigurationError(f"variant {variant.name!r}: the reference runs the reference implementation")
    other, built = build_port_model(source, port, device, selected)
    model = build_run_model(lambda _dtype, _device: other, dataclasses.replace(variant, implementation=None), device)
    built.model = model
    return model, built
