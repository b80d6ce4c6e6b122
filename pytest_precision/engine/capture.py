"""Select the modules to watch and stream their tensors to a sink with hooks that are always removed.

Kinds of tensor:
- `fw`: a module's forward output (its first floating tensor that is not a loss);
- `bw`: the gradient at the module's input, i.e. what the module's own backward produced, so a backward
  bug in block k shows in block k's row; none for a module whose input needs no gradient (the embedding);
- `grad`: each parameter's gradient (a tied parameter once, under its first name).
A module called more than once per forward gets rows `name`, `name#1`, `name#2`, ...
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.routers import ROUTING_KIND, Router, packed, replay_indices, routing_grid

if TYPE_CHECKING:
    import torch
    from torch import nn

Sink = Callable[[str, str, "torch.Tensor"], None]
#: (tensor name, kind): a captured tensor.
TensorKey = tuple[str, str]
GRADIENT_KINDS = ("bw", "grad")
#: compare(weight_cast=True): each parameter as the variant holds it, against the reference's.
WEIGHT_KIND = "weight_cast"
#: Kinds without range statistics: scalars and per-token log-probabilities, not tensors a dtype holds.
NO_RANGE_KINDS = ("logprob", "loss")
#: Internal kind: the reference's logits, kept to compare whole next-token distributions.
LOGITS_KIND = "logits"


def _largest_block_list(model: nn.Module) -> tuple[str, nn.Module] | None:
    from torch import nn

    best: tuple[int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, module)
    return None if best is None else (best[1], best[2])


def _name_of(model: nn.Module, target: object) -> str | None:
    if target is None:
        return None
    for name, module in model.named_modules():
        if module is target and name:
            return str(name)
    return None


def default_module_names(model: nn.Module) -> list[str]:
    """Input embedding, every block of the main ModuleList, the final norm and the output head.

    The main ModuleList is the one holding the most parameters (`model.layers`, `transformer.h`,
    `encoder.layer`); the final norm is a norm module beside it. A model without one gets its top-level
    children that hold parameters.
    """
    from torch import nn

    names: list[str] = []
    get_input = getattr(model, "get_input_embeddings", None)
    embedding = _name_of(model, get_input()) if callable(get_input) else None
    if embedding is None:
        embedding = next((n for n, m in model.named_modules() if isinstance(m, nn.Embedding)), None)
    if embedding:
        names.append(embedding)
    blocks = _largest_block_list(model)
    if blocks is None or not blocks[0]:
        names += [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    else:
        list_name, block_list = blocks
        names += [f"{list_name}.{child}" for child, _ in block_list.named_children()]
        parent_name = list_name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        prefix = f"{parent_name}." if parent_name else ""
        names += [
            prefix + child
            for child, module in parent.named_children()
            if "norm" in type(module).__name__.lower() or child.startswith(("ln_f", "norm", "final_layer_norm"))
        ]
    get_output = getattr(model, "get_output_embeddings", None)
    head = _name_of(model, get_output()) if callable(get_output) else None
    if head:
        names.append(head)
    return list(dict.fromkeys(names))


def select_modules(model: nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """Module names to capture: the default selection, or every name full-matching one of `patterns`."""
    if patterns is None:
        names = default_module_names(model)
        if not names:
            raise ConfigurationError(
                f"{type(model).__name__}: no modules to capture by default; pass modules=[regex, ...]"
            )
        return names
    if isinstance(patterns, str):
        patterns = [patterns]
    all_names = [name for name, _ in model.named_modules() if name]
    for pattern in patterns:
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise ConfigurationError(f"modules: {pattern!r} is not a valid regex ({error})") from None
        if not any(compiled.fullmatch(name) for name in all_names):
            raise ConfigurationError(
                f"modules: {pattern!r} matches no module of {type(model).__name__} (full match on names "
                f"from named_modules(), e.g. {', '.join(all_names[:6])})"
            )
    return [name for name in all_names if any(re.fullmatch(p, name) for p in patterns)]


def first_floating_tensor(value: Any, *, skip_scalars: bool = False) -> torch.Tensor | None:
    """The first floating tensor in an output: tensors, tuples/lists, dicts and model outputs (not `loss`)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not (skip_scalars and value.dim() == 0):
            return value
        return None
    if isinstance(value, dict):
        items: Any = [v for k, v in value.items() if k != "loss"]
    elif isinstance(value, (tuple, list)):
        items = value
    else:
        return None
    for item in items:
        found = first_floating_tensor(item, skip_scalars=True)
        if found is not None:
            return found
    return None


def _first_grad_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
            return value
    return None


class CallCounts(dict[str, int]):
    """How often each captured module was called in the current forward (labels `name#k`)."""

    def restart(self) -> None:
        """A new forward of the model begins: labels start again at `name` (an arrangement's next call)."""
        self.clear()


@contextlib.contextmanager
def capture(
    model: nn.Module,
    module_names: Sequence[str],
    sink: Sink,
    *,
    backward: bool,
    parameter_grads: bool = True,
    routers: Mapping[str, Router] | None = None,
    replay: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[CallCounts]:
    """Stream fw, bw and grad tensors of `model` to `sink(name, kind, tensor)` while inside the block (the
    parameters' gradients only with `parameter_grads`: else the caller reads them after backward), and each of
    `routers`' choices as a "routing" tensor (see routers.py). With `replay` (routing tensors by router label), each
    router chooses the experts recorded there instead of its own, its weights computed from its own scores."""
    modules = dict(model.named_modules())
    missing = [name for name in module_names if name not in modules]
    if missing:
        raise ConfigurationError(
            f"modules {', '.join(missing)} are not in this run's {type(model).__name__}; a model factory must "
            "build the same architecture for every dtype"
        )
    handles: list[Any] = []
    calls = CallCounts()

    def label(name: str) -> str:
        index = calls[name]
        return name if index == 0 else f"{name}#{index}"

    def make_hooks(name: str) -> tuple[Callable[..., None], Callable[..., None]]:
        def before(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[name] = calls.get(name, -1) + 1
            if not backward:
                return
            tensor = _first_grad_input(args, kwargs)
            if tensor is not None:
                row = label(name)
                handles.append(tensor.register_hook(lambda grad: sink(row, "bw", grad)))  # type: ignore[no-untyped-call]

        def after(_module: nn.Module, _args: Any, output: Any) -> None:
            tensor = first_floating_tensor(output)
            if tensor is not None:
                sink(label(name), "fw", tensor)

        return before, after

    def make_router_hooks(router: Router) -> tuple[Callable[..., None], Callable[..., Any]]:
        grid: list[tuple[int, int] | None] = [None]

        def before(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if router.name not in module_names:
                calls[router.name] = calls.get(router.name, -1) + 1
            grid[0] = routing_grid(args, kwargs) or parent_grid.get(router.name)

        def after(_module: nn.Module, _args: Any, output: Any) -> Any:
            row = label(router.name)
            if replay is not None:
                recorded = replay.get(row)
                if recorded is None:
                    raise ConfigurationError(
                        f"routing replay: router {row!r} has no recorded routing to replay (the recorded run's routers "
                        f"are {', '.join(replay) or 'none'}); replay needs the same model"
                    )
                choice = router.read(output)
                output = router.replayed(output, replay_indices(recorded, choice.indices.shape[0]))
            sink(row, ROUTING_KIND, packed(router.read(output), grid[0]))
            return output

        return before, after

    parent_grid: dict[str, tuple[int, int] | None] = {}

    def make_parent_hook(router_name: str) -> Callable[..., None]:
        def before(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            parent_grid[router_name] = routing_grid(args, kwargs)

        return before

    try:
        for name in module_names:
            before, after = make_hooks(name)
            handles.append(modules[name].register_forward_pre_hook(before, with_kwargs=True))
            handles.append(modules[name].register_forward_hook(after))
        for router in (routers or {}).values():
            parent = router.name.rpartition(".")[0]
            if parent in modules:
                handles.append(
                    modules[parent].register_forward_pre_hook(make_parent_hook(router.name), with_kwargs=True)
                )
            router_before, router_after = make_router_hooks(router)
            # Registered last: the router's fw row (if captured) and the routing row see the replayed output.
            handles.append(modules[router.name].register_forward_pre_hook(router_before, with_kwargs=True))
            handles.append(modules[router.name].register_forward_hook(router_after, prepend=True))
        if backward and parameter_grads:
            for param_name, parameter in model.named_parameters():
                if parameter.requires_grad:
                    handles.append(
                        parameter.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                            lambda p, n=param_name: sink(n, "grad", p.grad)
                        )
                    )
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every floating tensor in a nest of tensors, tuples/lists, dicts and model outputs."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from floating_tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from floating_tensors(item)


def _all_finite(value: Any) -> bool:
    import torch

    return all(bool(torch.isfinite(t).all()) for t in floating_tensors(value))


class NonfiniteTrace:
    """Where a run's first NaN/Inf appeared: the first module (in execution order) whose forward output
    was non-finite while its floating inputs were finite, else the first (in backward order) whose
    gradient at its inputs or parameters was non-finite while the gradient at its output was finite."""

    def __init__(self) -> None:
        self.forward: str | None = None
        self.backward: str | None = None

    def origin(self) -> str | None:
        """`"name (fw)"`, `"name (bw)"`, or None when every tensor stayed finite (or no module was to blame)."""
        if self.forward is not None:
            return f"{self.forward} (fw)"
        if self.backward is not None:
            return f"{self.backward} (bw)"
        return None


@contextlib.contextmanager
def _removed(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def trace_nonfinite(
    model: nn.Module, *, backward: bool, compiled_regions: Sequence[str] = ()
) -> Iterator[NonfiniteTrace]:
    """Watch every module of `model` for the first non-finite value, with hooks that are always removed.

    A module inside one of `compiled_regions` (names; "" the whole model) is not watched: a hook there would sit in
    compiled code. Its region is, and owns its parameters. Costs a device synchronisation per module and tensor:
    for a diagnostic run only.
    """
    trace = NonfiniteTrace()
    handles: list[Any] = []
    # Per module, a stack of "inputs were finite" (a module may be re-entered before it returns).
    inputs_finite: dict[str, list[bool]] = {}
    output_grad_finite: dict[str, bool] = {}

    def make_hooks(
        name: str,
    ) -> tuple[Callable[..., None], Callable[..., None], Callable[..., None], Callable[..., None]]:
        def before(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            inputs_finite.setdefault(name, []).append(trace.forward is None and _all_finite((args, kwargs)))

        def after(_module: nn.Module, _args: Any, output: Any) -> None:
            stack = inputs_finite.get(name)
            finite_in = stack.pop() if stack else False
            if trace.forward is None and finite_in and not _all_finite(output):
                trace.forward = name

        def before_backward(_module: nn.Module, grad_output: Any) -> None:
            output_grad_finite[name] = _all_finite(grad_output)

        def after_backward(_module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if trace.backward is None and _all_finite(grad_output) and not _all_finite(grad_input):
                trace.backward = name

        return before, after, before_backward, after_backward

    with warnings.catch_warnings(), _removed(handles):
        # Full backward hooks warn about modules whose output is not a tensor (a model's output dataclass)
        # or whose inputs need no gradient (the embedding): expected here, and harmless.
        warnings.filterwarnings("ignore", message="For backward hooks to be called", category=UserWarning)
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        owners: dict[int, str] = {}
        regions = set(compiled_regions)
        for name, module in model.named_modules():
            if any(name.startswith(region + ".") or (region == "" and name) for region in regions):
                continue
            label = name or type(model).__name__
            before, after, before_backward, after_backward = make_hooks(label)
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after))
            if backward:
                handles.append(module.register_full_backward_pre_hook(before_backward))
                handles.append(module.register_full_backward_hook(after_backward))
                for parameter in module.parameters(recurse=name in regions):
                    owners.setdefault(id(parameter), label)
        if backward:
            import torch

            def make_grad_hook(owner: str) -> Callable[[torch.Tensor], None]:
                def accumulated(parameter: torch.Tensor) -> None:
                    # A parameter's gradient overflowing while its module's output gradient was finite.
                    if (
                        trace.backward is None
                        and output_grad_finite.get(owner, False)
                        and parameter.grad is not None
                        and not bool(torch.isfinite(parameter.grad).all())
                    ):
                        trace.backward = owner

                return accumulated

            for parameter in model.parameters():
                if parameter.requires_grad and id(parameter) in owners:
                    handles.append(
                        parameter.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                            make_grad_hook(owners[id(parameter)])
                        )
                    )
        yield trace
