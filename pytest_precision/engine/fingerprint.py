"""Fingerprints of models and inputs: the parameter checksum and the ReferenceCache key.

What the cache key covers (see cache_key): a hit needs all of
- the same model object (held weakly: an entry goes with its model);
- the same values of every parameter and buffer (a float64 sum and position-weighted sum of each), with the
  same names, shapes, dtypes, devices and `requires_grad`;
- per module (every one of `named_modules()`): its class (`torch.nn.utils.parametrize` swaps it), its
  `training` flag, its forward/backward (pre-)hooks (by handle: any hook registered or removed since is a
  change), a `forward` assigned on the instance and every other plain attribute in its `__dict__` (numbers,
  strings, None, dtypes, devices, tuples/lists/sets/dicts of those, tensors not registered as parameters or
  buffers by their bytes, plain objects such as a transformers config by their own attributes, functions by
  identity); parametrizations are covered as modules (their originals are parameters);
- the global module hooks (`torch.nn.modules.module.register_module_forward_hook` and the like);
- the inputs (every tensor's bytes, or a checksum on an accelerator), the reference variant and every setting
  of the run (modules, loss_fn object, backward, device, temperature, clip_eps, offload).
A model holding an attribute of any other kind (or nested too deep) cannot be fingerprinted safely: the
cache is then not used for that call (`ReferenceCache.skipped` counts them) and the reference runs again.
Not covered: the code of a function (a hook or `forward` is the same object, so state inside its closure
or a global it reads is not seen), class attributes, and global state outside torch's module hooks.
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_precision.engine.batch import Batch
from pytest_precision.engine.variants import Variant

if TYPE_CHECKING:
    import torch
    from torch import nn


def same_checksum(stored: Any, current: tuple[Any, ...], rel_tol: float = 1e-9) -> bool:
    """Whether a saved checksum (JSON lists) matches `current`: same names, shapes and dtypes (devices may
    differ), and sums equal up to `rel_tol` (another device sums in another order)."""
    try:
        training, (layout, sums) = stored
        now_training, (now_layout, now_sums) = json.loads(json.dumps(current))
        del training, now_training  # every run is in eval mode: the flag changes no weight
        if len(layout) != len(now_layout) or len(sums) != len(now_sums):
            return False
        if any(list(a[:3]) != list(b[:3]) for a, b in zip(layout, now_layout, strict=True)):
            return False
        return all(
            math.isclose(float(a), b, rel_tol=rel_tol, abs_tol=rel_tol) for a, b in zip(sums, now_sums, strict=True)
        )
    except (TypeError, ValueError):
        return False


#: Per device and chunk size: the fixed pseudo-random weights of one checksum chunk, made once (sin in float64
#: is not cheap).
_CHUNK_WEIGHTS: dict[tuple[torch.device, int], torch.Tensor] = {}
#: Chunk k's weighted sum counts (1 + k * this): a value moved to the same offset of another chunk still shows.
_CHUNK_FACTOR = 0.6180339887498949


def _chunk_weights(device: torch.device) -> torch.Tensor:
    """Fixed pseudo-random weights in [0.5, 1.5) for the positions of one chunk (float64, on `device`)."""
    import torch

    from pytest_precision.numbers.metrics import chunk_elements

    size = chunk_elements(device)
    weights = _CHUNK_WEIGHTS.get((device, size))
    if weights is None:
        positions = torch.arange(size, dtype=torch.float64, device=device)
        weights = torch.frac(torch.sin(positions * 12.9898 + 78.233).abs() * 43758.5453) + 0.5
        _CHUNK_WEIGHTS[(device, size)] = weights
    return weights


def _tensor_sums(tensor: torch.Tensor) -> torch.Tensor:
    """(sum, position-weighted sum) of a tensor in float64, on its device, a cache-sized chunk at a time."""
    import torch

    flat = tensor.detach().reshape(-1)
    weights = _chunk_weights(flat.device)
    step = weights.numel()
    total = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for index, start in enumerate(range(0, flat.numel(), step)):
        piece = flat[start : start + step].to(torch.float64)
        weighted = torch.dot(piece, weights[: piece.numel()]) * (1.0 + index * _CHUNK_FACTOR)
        total += torch.stack([piece.sum(), weighted])
    return total


def _checksum(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[Any, ...]:
    """Names, shapes, dtypes, devices and (sum, weighted sum) of each tensor, with one host copy per device."""
    import torch

    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, tensor in named:
        by_device.setdefault(tensor.device, []).append(_tensor_sums(tensor))
    sums: list[float] = []
    for parts in by_device.values():
        sums += torch.stack(parts).reshape(-1).cpu().tolist()
    layout = tuple((name, tuple(t.shape), str(t.dtype), str(t.device)) for name, t in named)
    return (layout, tuple(sums))


def state_checksum(model: nn.Module) -> tuple[Any, ...]:
    """A cheap fingerprint of every parameter and buffer (and the training flag): any in-place edit of a
    value changes it (up to float64 rounding of a sum: an edit smaller than that can slip through)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return (model.training, _checksum(named))


def _input_fingerprint(value: Any) -> Hashable:
    """Hashable fingerprint of an input; raises TypeError for a value that has none."""
    import torch

    if isinstance(value, torch.Tensor):
        described = (tuple(value.shape), str(value.dtype), str(value.device), bool(value.requires_grad))
        if value.device.type == "cpu":
            data = value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            return ("tensor", described, hashlib.sha256(data).hexdigest())
        return ("tensor", described, _checksum([("", value)]))
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_input_fingerprint(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _input_fingerprint(v)) for k, v in value.items()))
    raise TypeError(f"no fingerprint for {type(value).__name__}")


class Unfingerprintable(Exception):
    """A model attribute whose value cannot be fingerprinted safely: the cache is not used."""


#: nn.Module's own bookkeeping in a module's __dict__: covered otherwise (parameters, buffers, submodules,
#: hooks by handle) or irrelevant to the output (state-dict and registration hooks).
_MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_is_full_backward_hook",
        "training",
    }
)
#: Hook dicts of a module (keys: handle ids, unique for the process's life).
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_FINGERPRINT_DEPTH = 6


class _Fingerprinter:
    """Fingerprints of attribute values; each function or other object compared by identity is kept in
    `anchors` so an entry can check it is still alive (a dead object's id may be reused)."""

    def __init__(self, modules: Mapping[int, str]) -> None:
        self.modules = modules
        self.anchors: list[object] = []
        self._memo: dict[int, Hashable] = {}

    def value(self, value: Any, depth: int = 0) -> Hashable:
        import enum
        import types

        import torch
        from torch import nn

        if value is None or isinstance(value, (bool, int, str, bytes, complex)):
            return (type(value).__name__, value)
        if isinstance(value, float):
            return ("float", repr(value))  # NaN equal to itself
        if isinstance(value, type):
            self.anchors.append(value)
            return ("class", id(value))
        if isinstance(value, (torch.dtype, torch.device, torch.Size, enum.Enum)):
            return ("repr", type(value).__qualname__, repr(value))
        if isinstance(value, torch.Tensor):
            return _input_fingerprint(value.detach())
        if isinstance(value, nn.Module):
            if id(value) in self.modules:
                return ("module", self.modules[id(value)])  # one of the model's own: fingerprinted as such
            if any(True for _ in value.parameters()) or any(True for _ in value.buffers()):
                # Its values are in no checksum.
                raise Unfingerprintable(f"a module outside the model holding tensors ({type(value).__name__})")
        if depth >= _FINGERPRINT_DEPTH:
            raise Unfingerprintable("nested too deep")
        known = self._memo.get(id(value))
        if known is not None:
            return known
        self._memo[id(value)] = ("cycle", id(value))
        result: Hashable
        if isinstance(value, (tuple, list, set, frozenset)):
            items = [self.value(v, depth + 1) for v in value]
            result = (
                type(value).__qualname__,
                tuple(sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items),
            )
        elif isinstance(value, dict):
            result = ("dict", tuple((self.value(k, depth + 1), self.value(v, depth + 1)) for k, v in value.items()))
        elif isinstance(
            value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)
        ) or (callable(value) and not hasattr(value, "__dict__")):
            result = ("callable", id(value))
            self.anchors.append(value)
        elif isinstance(value, nn.Module):
            # A stateless module outside the model (transformers' kernel functions, `_kernel_funcs`): by its
            # class, its mode and its own attributes, as the model's modules are.
            self.anchors.append(type(value))
            attributes = tuple(
                (k, self.value(v, depth + 1)) for k, v in vars(value).items() if k not in _MODULE_INTERNALS
            )
            result = ("foreign module", id(type(value)), value.training, attributes)
        elif hasattr(value, "__dict__") and not isinstance(value, types.ModuleType):
            # A plain object (a transformers config, a dataclass): by its class and its own attributes.
            attributes = tuple((k, self.value(v, depth + 1)) for k, v in vars(value).items())
            result = ("object", type(value).__module__, type(value).__qualname__, attributes)
            if callable(value):
                self.anchors.append(value)
                result = (result, id(value))
        else:
            raise Unfingerprintable(f"a {type(value).__name__}")
        self._memo[id(value)] = result
        return result


def model_fingerprint(model: nn.Module) -> tuple[Hashable, list[object]]:
    """What besides parameter and buffer values can change the model's output (see the module docstring),
    and the objects compared by identity; raises Unfingerprintable when a value has no safe fingerprint."""
    from torch.nn.modules import module as module_module

    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    fingerprinter = _Fingerprinter(names)
    parts: list[Hashable] = []
    for name, module in model.named_modules(remove_duplicate=False):
        state = vars(module)
        hooks = tuple((hook_dict, tuple(state.get(hook_dict, {}))) for hook_dict in _HOOK_DICTS)
        attributes = tuple(
            (key, fingerprinter.value(value))
            for key, value in state.items()
            if key not in _MODULE_INTERNALS and key not in _HOOK_DICTS
        )
        parts.append((name, id(type(module)), module.training, hooks, attributes))
        fingerprinter.anchors.append(type(module))
    requires_grad = tuple(p.requires_grad for p in model.parameters())
    global_hooks = tuple(
        (key, tuple(value))
        for key, value in sorted(vars(module_module).items())
        if key.startswith("_global_") and key.endswith("hooks") and isinstance(value, dict)
    )
    return (tuple(parts), requires_grad, global_hooks), fingerprinter.anchors


@dataclass(frozen=True)
class CacheKey:
    """A ReferenceCache key, the model's state_checksum, and the objects the key names by identity."""

    key: Hashable
    checksum: tuple[Any, ...]
    anchors: tuple[object, ...] = ()


def cache_key(
    model: object,
    batch: Batch,
    variant: Variant,
    *,
    loss_fn: object,
    backward: bool,
    modules: tuple[str, ...] | None,
    device: torch.device,
    temperature: float,
    clip_eps: float,
    offload: bool,
    routers: object = None,
) -> CacheKey | None:
    """The cache key of a reference run (see the module docstring for what it covers), or None when it
    cannot be memoized: a factory (its output cannot be checksummed before it runs), inputs without a
    fingerprint, or a model attribute without a safe fingerprint."""
    from torch import nn

    if not isinstance(model, nn.Module):
        return None
    try:
        inputs = _input_fingerprint((batch.args, batch.kwargs))
        structure, anchors = model_fingerprint(model)
    except (TypeError, Unfingerprintable):
        return None
    checksum = state_checksum(model)
    spec = (json.dumps(variant.to_dict(), sort_keys=True), id(variant.prepare))
    # A Routers by identity (its callables cannot be compared otherwise), kept alive by the anchors.
    routing = routers if routers is None or routers is False else id(routers)
    settings = (modules, id(loss_fn), backward, str(device), temperature, clip_eps, offload, routing)
    anchors += [variant.prepare, loss_fn] + ([routers] if routing not in (None, False) else [])
    key = (id(model), checksum, structure, inputs, spec, settings)
    return CacheKey(key, checksum, tuple(a for a in anchors if a is not None))


def anchored(anchors: tuple[object, ...]) -> list[Callable[[], object]]:
    """A weak reference to each anchor (or a strong one when it takes none)."""
    refs: list[Callable[[], object]] = []
    for anchor in anchors:
        try:
            refs.append(weakref.ref(anchor))
        except TypeError:
            refs.append(_Strong(anchor))
    return refs


class _Strong:
    """A strong reference called like a weak one, for an anchor that takes no weak reference."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __call__(self) -> object:
        return self.value
