"""A reference run computed once: its captured tensors, and what comparing variants against them needs.

`reference(model, inputs, ...)` runs the reference (see compare) and returns a `Reference`; `compare(ref,
variants=[...])` measures variants against it without running the reference again. `ReferenceCache` memoizes
references (compare(cache=...), the plugin's `precision` fixture keeps one per session).

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

import dataclasses
import hashlib
import json
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .batch import Batch
from .errors import ConfigurationError
from .model_build import FactoryProducts
from .report import RunInfo
from .variants import Variant

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .comparison import LossFn
    from .model_build import ModelFactory

TensorKey = tuple[str, str]
#: safetensors metadata key holding the JSON description of a saved Reference.
METADATA_KEY = "pytest_precision.reference"
FORMAT_VERSION = 1
_INPUT_PREFIX = "__inputs__/"
#: offload=None offloads on CUDA above this many bytes of parameters.
OFFLOAD_THRESHOLD_BYTES = 1 << 30


class _OnDevice(Mapping[TensorKey, "torch.Tensor"]):
    """Host-held reference tensors, each moved to the run's device when looked up (one at a time)."""

    def __init__(self, stored: Mapping[TensorKey, torch.Tensor], device: torch.device) -> None:
        self._stored = stored
        self._device = device

    def __getitem__(self, key: TensorKey) -> torch.Tensor:
        return self._stored[key].to(self._device)

    def __iter__(self) -> Iterator[TensorKey]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


@dataclass(eq=False)
class Reference:
    """The reference run of one model on one batch: its captured tensors and the settings to compare with.

    Build one with `pytest_precision.reference(...)` (or `precision.reference(...)` in a test), compare
    variants with `compare(ref, variants=[...])` / `precision.run(ref, variants=[...])`. It holds the user's
    model (or factory) itself, not a copy: the variants are built from it. `save(path)` / `Reference.load`
    write and read the captured tensors as safetensors.
    """

    source: nn.Module | ModelFactory | None
    batch: Batch
    device: torch.device
    variant: Variant
    loss_fn: LossFn | None
    backward: bool
    modules: tuple[str, ...] | None
    module_names: list[str]
    temperature: float
    clip_eps: float
    info: RunInfo
    stored: dict[TensorKey, torch.Tensor]
    offload: bool
    #: state_checksum of the model when the reference ran (None for a factory).
    checksum: tuple[Any, ...] | None = None
    #: The qualified name of the custom loss_fn the reference ran with (None: the model's own loss).
    loss_fn_name: str | None = None
    #: Where it was loaded from (None when computed here).
    path: str | None = None
    #: Largest finite |gradient| over the bw and grad tensors, which sizes fp16 loss scales: measured while
    #: the reference runs; for a loaded Reference, computed from its tensors on first need (None until then).
    max_gradient: float | None = None
    #: repeats -> per-tensor noise of the reference's repeats (see compare), computed on first need.
    noise: dict[int, dict[TensorKey, float]] = field(default_factory=dict, repr=False)
    #: The models a factory source returned for this reference's runs (a model returned twice is refused).
    products: FactoryProducts = field(default_factory=FactoryProducts, repr=False)

    @property
    def model(self) -> nn.Module | ModelFactory | None:
        """The model (or factory) the variants are built from; None for a Reference loaded without one."""
        return self.source

    @property
    def nbytes(self) -> int:
        """Bytes held by the captured tensors (a storage two of them share, once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.stored.values()}
        return sum(storages.values())

    def tensors(self) -> Mapping[TensorKey, torch.Tensor]:
        """The captured tensors by (name, kind), each on the run's device when looked up."""
        if all(t.device == self.device for t in self.stored.values()):
            return self.stored
        return _OnDevice(self.stored, self.device)

    def with_model(self, model: nn.Module | ModelFactory | None) -> Reference:
        """The same captured tensors bound to `model` (shared, not copied)."""
        return dataclasses.replace(self, source=model)

    def __repr__(self) -> str:
        source = "None" if self.source is None else type(self.source).__name__
        return (
            f"Reference({self.variant.name}, model={source}, device={self.device}, tensors={len(self.stored)}, "
            f"backward={self.backward}, offload={self.offload})"
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the captured tensors (keys "{kind}/{name}"), the inputs and the settings as safetensors."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        order = []
        storages: set[int] = set()
        for (name, kind), tensor in self.stored.items():
            key = f"{kind}/{name}"
            order.append([name, kind])
            saved = tensor.detach().cpu().contiguous()
            # Kept tensors may share storage (the head's output is the logits); safetensors refuses that.
            if saved.untyped_storage().data_ptr() in storages:
                saved = saved.clone()
            storages.add(saved.untyped_storage().data_ptr())
            tensors[key] = saved
        inputs = {
            "args": [_save_input(tensors, f"args/{i}", v) for i, v in enumerate(self.batch.args)],
            "kwargs": {k: _save_input(tensors, f"kwargs/{k}", v) for k, v in self.batch.kwargs.items()},
        }
        metadata = {
            "format": FORMAT_VERSION,
            "reference": self.variant.to_dict(),
            "run": self.info.to_dict(),
            "modules": None if self.modules is None else list(self.modules),
            "module_names": list(self.module_names),
            "device": str(self.device),
            "backward": self.backward,
            "temperature": self.temperature,
            "clip_eps": self.clip_eps,
            "loss_fn": self.loss_fn_name,
            "checksum": None if self.checksum is None else list(self.checksum),
            "order": order,
            "inputs": inputs,
        }
        save_file(tensors, os.fspath(path), metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True)})

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        model: nn.Module | ModelFactory | None = None,
        *,
        loss_fn: LossFn | None = None,
        device: str | torch.device | None = None,
    ) -> Reference:
        """A Reference saved by `save`. Comparing variants against it needs `model` (the same model or a
        factory building it) and, when the reference ran with a custom loss_fn, that `loss_fn` again.
        The tensors stay on the host and move to `device` (default: the saved one) one at a time."""
        import torch
        from safetensors import safe_open

        try:
            with safe_open(os.fspath(path), framework="pt", device="cpu") as handle:
                raw = (handle.metadata() or {}).get(METADATA_KEY)
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        except (OSError, ValueError, RuntimeError) as error:
            raise ConfigurationError(f"Reference.load({os.fspath(path)!r}): cannot read it: {error}") from error
        if raw is None:
            raise ConfigurationError(
                f"Reference.load({os.fspath(path)!r}): no {METADATA_KEY} metadata; not written by Reference.save"
            )
        meta = json.loads(raw)
        if meta.get("format") != FORMAT_VERSION:
            raise ConfigurationError(f"Reference.load({os.fspath(path)!r}): unknown format {meta.get('format')!r}")
        stored = {(name, kind): tensors[f"{kind}/{name}"] for name, kind in meta["order"]}
        inputs = meta["inputs"]
        batch = Batch(
            tuple(_load_input(tensors, v) for v in inputs["args"]),
            {k: _load_input(tensors, v) for k, v in inputs["kwargs"].items()},
        )
        spec = {k: v for k, v in meta["reference"].items() if k != "prepare"}
        variant = Variant(**spec)
        _check_loaded_checksum(path, model, meta.get("checksum"))
        return cls(
            source=model,
            batch=batch,
            device=torch.device(device if device is not None else meta["device"]),
            variant=variant,
            loss_fn=loss_fn,
            backward=bool(meta["backward"]),
            modules=None if meta["modules"] is None else tuple(meta["modules"]),
            module_names=list(meta["module_names"]),
            temperature=float(meta["temperature"]),
            clip_eps=float(meta["clip_eps"]),
            info=RunInfo.from_dict(meta["run"]),
            stored=stored,
            offload=True,
            checksum=None if meta["checksum"] is None else tuple(meta["checksum"]),
            loss_fn_name=meta["loss_fn"],
            path=os.fspath(path),
        )


def _check_loaded_checksum(path: str | os.PathLike[str], model: object, stored: Any) -> None:
    """Refuse a model whose parameters or buffers differ from those a loaded Reference was computed with."""
    from torch import nn

    if not isinstance(model, nn.Module) or stored is None:
        return
    if not same_checksum(stored, state_checksum(model)):
        raise ConfigurationError(
            f"Reference.load({os.fspath(path)!r}): the model's weights differ from those the reference was "
            "computed with (parameters, buffers or their names, shapes and dtypes); pass the same model, or "
            "compute a new reference with reference(model, inputs, ...)"
        )


def same_checksum(stored: Any, current: tuple[Any, ...], rel_tol: float = 1e-9) -> bool:
    """Whether a saved checksum (JSON lists) matches `current`: same names, shapes and dtypes (devices may
    differ), and sums equal up to `rel_tol` (another device sums in another order)."""
    import math

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


def _save_input(tensors: dict[str, torch.Tensor], key: str, value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        tensors[_INPUT_PREFIX + key] = value.detach().cpu().contiguous()
        return {"tensor": _INPUT_PREFIX + key, "requires_grad": bool(value.requires_grad)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ConfigurationError(
        f"Reference.save: input {key.split('/', 1)[1]!r} is a {type(value).__name__}; only tensors and "
        "bool/int/float/str/None inputs can be saved"
    )


def _load_input(tensors: Mapping[str, torch.Tensor], entry: Mapping[str, Any]) -> Any:
    if "tensor" in entry:
        return tensors[entry["tensor"]].requires_grad_(bool(entry["requires_grad"]))
    return entry["value"]


def qualified_name(function: object) -> str:
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}.{name}" if module else name


#: Per device: the fixed pseudo-random weights of one checksum chunk, made once (sin in float64 is not cheap).
_CHUNK_WEIGHTS: dict[torch.device, torch.Tensor] = {}
#: Chunk k's weighted sum counts (1 + k * this): a value moved to the same offset of another chunk still shows.
_CHUNK_FACTOR = 0.6180339887498949


def _chunk_weights(device: torch.device) -> torch.Tensor:
    """Fixed pseudo-random weights in [0.5, 1.5) for the positions of one chunk (float64, on `device`)."""
    import torch

    from .metrics import chunk_elements

    weights = _CHUNK_WEIGHTS.get(device)
    if weights is None:
        positions = torch.arange(chunk_elements(device), dtype=torch.float64, device=device)
        weights = torch.frac(torch.sin(positions * 12.9898 + 78.233).abs() * 43758.5453) + 0.5
        _CHUNK_WEIGHTS[device] = weights
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
            raise Unfingerprintable(f"a module outside the model ({type(value).__name__})")
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
    settings = (modules, id(loss_fn), backward, str(device), temperature, clip_eps, offload)
    anchors += [variant.prepare, loss_fn]
    key = (id(model), checksum, structure, inputs, spec, settings)
    return CacheKey(key, checksum, tuple(a for a in anchors if a is not None))


def _anchored(anchors: tuple[object, ...]) -> list[Callable[[], object]]:
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


class ReferenceCache:
    """Least-recently-used References, at most `max_entries` of them and (when given) `max_bytes` of
    captured tensors in all. An entry holds its model weakly: it goes when the model does.

    A hit needs the same key (see the module docstring for what it covers) and every object the key names
    by identity still alive; anything else runs the reference again. `hits` and `misses` count lookups;
    `skipped` counts calls for which the model could not be fingerprinted (the cache was not used).
    """

    def __init__(self, max_entries: int = 2, max_bytes: int | None = None) -> None:
        if max_entries < 1:
            raise ConfigurationError(f"ReferenceCache: max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.skipped = 0
        self._entries: OrderedDict[Hashable, tuple[weakref.ref[Any], Reference, list[Callable[[], object]]]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        return list(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(ref.nbytes for _, ref, _ in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def get(self, keyed: CacheKey, model: object) -> Reference | None:
        key = keyed.key
        entry = self._entries.get(key)
        if entry is not None and any(anchor() is None for anchor in entry[2]):
            del self._entries[key]  # an object the key names by id is gone: its id may now be another's
            entry = None
        if entry is None or entry[0]() is not model:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1].with_model(model)  # type: ignore[arg-type]

    def put(self, keyed: CacheKey, model: object, reference: Reference) -> None:
        key = keyed.key
        if self.max_bytes is not None and reference.nbytes > self.max_bytes:
            return
        entries = self._entries

        def drop(_: object) -> None:
            entries.pop(key, None)

        entries[key] = (weakref.ref(model, drop), reference.with_model(None), _anchored(keyed.anchors))
        entries.move_to_end(key)
        while len(entries) > self.max_entries or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            entries.popitem(last=False)


def reference(
    model: nn.Module | ModelFactory,
    inputs: Any,
    *,
    reference: str | Variant = "fp32",
    loss_fn: LossFn | None = None,
    backward: bool = True,
    modules: Sequence[str] | str | None = None,
    device: str | torch.device | None = None,
    temperature: float = 1.0,
    clip_eps: float | None = None,
    offload: bool | None = None,
    cache: ReferenceCache | None = None,
) -> Reference:
    """Run the reference of `model` on `inputs` once; compare variants with `compare(ref, variants=[...])`.

    The arguments are compare's. offload: keep the captured tensors on the host, each moved to the device
    when compared (default: on CUDA when the model holds more than 1 GiB of parameters).
    """
    from .comparison import build_reference

    return build_reference(
        model,
        inputs,
        reference=reference,
        loss_fn=loss_fn,
        backward=backward,
        modules=modules,
        device=device,
        temperature=temperature,
        clip_eps=clip_eps,
        offload=offload,
        cache=cache,
    )


__all__ = ["Reference", "ReferenceCache", "reference", "state_checksum"]
