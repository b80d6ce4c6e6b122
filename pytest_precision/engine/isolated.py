"""Isolated (local) error: each selected module run on the reference's input, so that its row measures the
error the module itself adds rather than everything upstream of it (torch.ao.ns's "shadow" idea, extended to
backward and parameter gradients).

The isolation boundaries are the outermost selected modules (a selected module inside another selected one is
not a boundary). In an isolated run of a variant:
- forward: each boundary module's primary input (its first floating tensor argument, positional first, then by
  keyword: the hidden state) is replaced by the reference run's input to the same call, cast to the dtype and
  device the variant's own input had; other arguments (masks, position embeddings) are the variant's own;
- backward: no loss is backpropagated; each boundary module's backward is driven by the reference run's
  gradient at that module's output (times the fp16 loss scale), and the graph is cut at every boundary's
  input, so no gradient crosses from one boundary module into another.
A boundary's fw, bw and parameter-gradient rows then measure that module alone: its bw row is compared with
the reference's gradient through that module alone (where its input has other uses, a residual around it, the
propagated bw row holds their gradient too). A selected module nested in a boundary measures what accumulated
from the start of its boundary module. A parameter used outside the boundary modules (none of them, or a weight
tied to an unselected module) gets no isolated row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.engine.capture import first_floating_tensor, floating_tensors

if TYPE_CHECKING:
    import torch
    from torch import nn

#: The suffix of a kind measured in isolation: "fw_isolated", "bw_isolated", "grad_isolated".
SUFFIX = "_isolated"
ISOLATED_KINDS = ("fw" + SUFFIX, "bw" + SUFFIX, "grad" + SUFFIX)
#: Where a module's primary input sits: ("arg", position) or ("kwarg", name).
Slot = tuple[str, Any]
#: Another implementation's boundary module (engine/port_build.py): the reference's module it stands for, and the
#: layouts back from the reference's for its input and for the gradient at its output (None: the same layout).
Counterpart = tuple[
    str, "Callable[[torch.Tensor], torch.Tensor] | None", "Callable[[torch.Tensor], torch.Tensor] | None"
]


def isolated_kind(kind: str) -> str:
    return kind + SUFFIX


def base_kind(kind: str) -> str:
    """The propagated kind an isolated kind is measured against ("fw_isolated" -> "fw")."""
    return kind.removesuffix(SUFFIX)


def boundaries(module_names: Sequence[str]) -> list[str]:
    """The outermost of the selected modules: those with no selected ancestor."""
    selected = set(module_names)
    return [
        name
        for name in module_names
        if not any(".".join(name.split(".")[:i]) in selected for i in range(1, name.count(".") + 1))
    ]


def owned_parameters(model: nn.Module, boundary_names: Sequence[str]) -> set[str]:
    """Names (as model.named_parameters() gives them) of the parameters used only inside boundary modules (a
    weight tied to a module outside them gets part of its gradient from outside: it gets no isolated row)."""
    inside = {id(p) for name in boundary_names for p in model.get_submodule(name).parameters()}
    prefixes = tuple(f"{name}." for name in boundary_names)
    outside = {
        id(p)
        for module_name, module in model.named_modules()
        if module_name not in boundary_names and not module_name.startswith(prefixes)
        for p in module.parameters(recurse=False)
    }
    return {name for name, parameter in model.named_parameters() if id(parameter) in inside - outside}


def _primary_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Slot, torch.Tensor] | None:
    """The first top-level floating tensor argument with at least one dimension, and where it sits."""
    import torch

    for position, value in enumerate(args):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
            return ("arg", position), value
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
            return ("kwarg", key), value
    return None


@dataclass
class Recorded:
    """What the reference run gave each boundary call: its primary input, the gradient at its output and the
    gradient its own backward produced at its input."""

    inputs: dict[str, tuple[Slot, torch.Tensor]] = field(default_factory=dict)
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The gradient at each boundary call's primary input through that module alone.
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)


class _Calls:
    """Labels of module calls as capture gives them: `name`, then `name#1`, `name#2`, ..."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def next(self, name: str) -> str:
        index = self.counts[name] = self.counts.get(name, -1) + 1
        return name if index == 0 else f"{name}#{index}"


@contextlib.contextmanager
def _hooked(
    model: nn.Module, names: Sequence[str], before: Callable[..., Any], after: Callable[..., Any]
) -> Iterator[None]:
    handles = []
    try:
        for name in names:
            module = model.get_submodule(name)
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, k, n=name: before(n, a, k), with_kwargs=True, prepend=True
                )
            )
            handles.append(module.register_forward_hook(lambda m, a, o, n=name: after(n, o)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def record(model: nn.Module, boundary_names: Sequence[str], *, backward: bool, into: Recorded) -> Iterator[None]:
    """Record into `into`, during a reference run, each boundary call's primary input (a copy) and, after its
    backward, the gradients at its primary output and, through the module alone, at its primary input."""
    recorded = into
    calls = _Calls()
    current: dict[str, str] = {}

    def before(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        label = current[name] = calls.next(name)
        recorded.calls.append(label)
        found = _primary_input(args, kwargs)
        if found is not None:
            slot, tensor = found
            recorded.inputs[label] = (slot, tensor.detach().clone())
            if backward and tensor.requires_grad:
                # An alias (an identity view) that only this module consumes: its gradient is the module's own
                # share of the gradient at its input, without that of the input's other uses (a residual).
                alias = tensor.view_as(tensor)

                def keep_input_grad(grad: torch.Tensor) -> None:
                    recorded.input_grads[label] = grad.detach().clone()

                alias.register_hook(keep_input_grad)  # type: ignore[no-untyped-call]
                return _placed(args, kwargs, slot, alias)
            return None
        if any(True for _ in floating_tensors((args, kwargs))):
            raise ConfigurationError(
                f"isolate=True: module {label!r} gets its floating inputs inside a tuple, list or dict, not as a "
                "tensor argument, so they cannot be replaced by the reference's; select modules taking the hidden "
                "state as an argument (modules=[...])"
            )
        return None

    def after(name: str, output: Any) -> None:
        label = current[name]
        tensor = first_floating_tensor(output)
        if backward and tensor is not None and tensor.requires_grad:

            def keep(grad: torch.Tensor) -> None:
                recorded.output_grads[label] = grad.detach().clone()

            tensor.register_hook(keep)  # type: ignore[no-untyped-call]

    with _hooked(model, boundary_names, before, after):
        yield


class IsolatedRun:
    """A variant's run with every boundary module fed the reference's input (see `isolate`)."""

    def __init__(
        self, recorded: Recorded, scale: float, variant: str, counterparts: dict[str, Counterpart] | None = None
    ) -> None:
        self.recorded = recorded
        self.scale = scale
        self.variant = variant
        self.outputs: list[tuple[str, torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]] = []
        self.calls = _Calls()
        self.current: dict[str, str] = {}
        #: Another implementation's boundary modules by their own names (None: the reference's model).
        self.counterparts = counterparts

    def _reference_name(self, name: str) -> str:
        return name if self.counterparts is None else self.counterparts[name][0]

    def before(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        label = self.current[name] = self.calls.next(self._reference_name(name))
        if label not in self.recorded.calls:
            raise ModelRunError(
                f"isolated run {self.variant!r}: module {label!r} was called more often than in the reference "
                "run: the variant changed the model's control flow"
            )
        found = _primary_input(args, kwargs)
        kept = self.recorded.inputs.get(label)
        if (found is None) != (kept is None):
            raise ModelRunError(
                f"isolated run {self.variant!r}: module {label!r} got a floating input in one run and none in "
                "the other; isolation needs the same inputs in the reference and the variant"
            )
        new_args, new_kwargs = list(args), dict(kwargs)
        # Cut the graph at the boundary: other arguments needing a gradient (an encoder's states) are detached.
        for position, value in enumerate(new_args):
            new_args[position] = _detached(value)
        for key, value in new_kwargs.items():
            new_kwargs[key] = _detached(value)
        if found is not None and kept is not None:
            (kind, where), actual = found
            reference = kept[1]
            back = None if self.counterparts is None else self.counterparts[name][1]
            if back is not None:
                reference = back(reference)
            if tuple(reference.shape) != tuple(actual.shape):
                raise ModelRunError(
                    f"isolated run {self.variant!r}: module {label!r}'s input has shape {tuple(actual.shape)}, "
                    f"the reference's {tuple(reference.shape)}"
                )
            replacement = reference.to(device=actual.device, dtype=actual.dtype, copy=True)
            replacement.requires_grad_(actual.requires_grad)
            if kind == "arg":
                new_args[where] = replacement
            else:
                new_kwargs[where] = replacement
        return tuple(new_args), new_kwargs

    def after(self, name: str, output: Any) -> None:
        tensor = first_floating_tensor(output)
        if tensor is not None and tensor.requires_grad:
            back = None if self.counterparts is None else self.counterparts[name][2]
            self.outputs.append((self.current[name], tensor, back))

    def backward(self) -> None:
        """Each boundary module's backward from the reference's gradient at its output (times the scale)."""
        import torch

        roots, gradients = [], []
        for label, output, back in self.outputs:
            gradient = self.recorded.output_grads.get(label)
            if gradient is None:
                continue  # the reference's loss did not depend on this output
            if back is not None:
                gradient = back(gradient)
            if self.scale != 1:
                gradient = gradient.to(torch.float64) * self.scale
            roots.append(output)
            gradients.append(gradient.to(device=output.device, dtype=output.dtype))
        self.outputs.clear()
        if roots:
            torch.autograd.backward(roots, gradients)


def _placed(args: tuple[Any, ...], kwargs: dict[str, Any], slot: Slot, tensor: Any) -> tuple[Any, Any]:
    """(args, kwargs) with `tensor` in `slot`."""
    kind, where = slot
    if kind == "arg":
        return (*args[:where], tensor, *args[where + 1 :]), kwargs
    return args, {**kwargs, where: tensor}


def _detached(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach()
    return value


@contextlib.contextmanager
def isolate(
    model: nn.Module,
    boundary_names: Sequence[str],
    recorded: Recorded,
    *,
    scale: float,
    variant: str,
    counterparts: dict[str, Counterpart] | None = None,
) -> Iterator[IsolatedRun]:
    """Feed each boundary module of `model` the reference's input; `run.backward()` drives the backward. With
    `counterparts` (another implementation's boundary modules by name: see Counterpart), `boundary_names` are its
    own modules, each fed its reference module's recorded input in its own layout."""
    run = IsolatedRun(recorded, scale, variant, counterparts)
    with _hooked(model, boundary_names, run.before, run.after):
        yield run


def check_isolatable(module_names: Sequence[str], *, distributed: bool, sharded: bool) -> None:
    """Isolation's preconditions, with what to do when they do not hold."""
    if sharded or distributed:
        raise ConfigurationError(
            "isolate=True is not supported under torch.distributed or for sharded(...) models: a shard's input "
            "is not the module's whole input; measure isolated error on the unsharded model in one process"
        )
    if not module_names:
        raise ConfigurationError("isolate=True: no module is selected; pass modules=[regex, ...]")
