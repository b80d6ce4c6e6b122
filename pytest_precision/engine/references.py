"""A reference run computed once: its captured tensors, and what comparing variants against them needs.

`reference(model, inputs, ...)` runs the reference (see compare) and returns a `Reference`; `compare(ref,
variants=[...])` measures variants against it without running the reference again. `ReferenceCache` memoizes
references (compare(cache=...), the plugin's `precision` fixture keeps one per session).

What the cache key covers: see pytest_precision.engine.fingerprint. What a saved Reference records so that loading it
refuses a changed file or other weights: see pytest_precision.engine.reference_integrity.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_precision.base import strict_json
from pytest_precision.base.atomic_files import write_atomically
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import RunInfo
from pytest_precision.engine import reference_integrity as integrity
from pytest_precision.engine.batch import Batch
from pytest_precision.engine.capture import TensorKey
from pytest_precision.engine.fingerprint import _CHUNK_WEIGHTS, CacheKey, anchored, state_checksum  # noqa: F401
from pytest_precision.engine.model_build import FactoryProducts
from pytest_precision.engine.model_facts import model_description
from pytest_precision.engine.positions import Positions
from pytest_precision.engine.reference_file import aligned, loaded_fields, save_input, unshared
from pytest_precision.engine.variants import Variant

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pytest_precision.base.dtypes import ModelFactory
    from pytest_precision.distributed.sharding import ShardedModel
    from pytest_precision.engine.isolated import Recorded
    from pytest_precision.engine.losses import LossFn

#: safetensors metadata key holding the JSON description of a saved Reference.
METADATA_KEY = "pytest_precision.reference"
#: 2: the metadata records a SHA-256 of each tensor and of itself (see reference_integrity). Format 1 files
#: (pytest-precision 0.1) record none, so a change to them cannot be seen: they are refused.
#: 3: it records the model's description too (model_facts.model_description: module tree, settings, parameter
#: shapes, config). Format 2 files record the weights alone, so another model holding them cannot be told
#: apart: they are refused too.
FORMAT_VERSION = 3
#: offload=None offloads on CUDA above this many bytes of parameters.
OFFLOAD_THRESHOLD_BYTES = 1 << 30


class _OnDevice(Mapping[TensorKey, "torch.Tensor"]):
    """Host-held reference tensors, each moved to the run's device when looked up (one at a time)."""

    def __init__(self, stored: Mapping[TensorKey, torch.Tensor], device: torch.device) -> None:
        self._stored = stored
        self._device = device

    def __getitem__(self, key: TensorKey) -> torch.Tensor:
        return self._stored[key].to(self._device, non_blocking=True)

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

    source: nn.Module | ModelFactory | ShardedModel | None
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
    #: state_checksum of the model when the reference ran (None for a factory: save() records that of the model
    #: it built for the reference run); for a loaded Reference, the checksum its file records.
    checksum: tuple[Any, ...] | None = None
    #: model_facts.model_description of the model when the reference was computed (None for a factory: save()
    #: records that of the model it built for the reference run); for a loaded Reference, its file's.
    description: dict[str, Any] | None = None
    #: The qualified name of the custom loss_fn the reference ran with (None: the model's own loss).
    loss_fn_name: str | None = None
    #: Where it was loaded from (None when computed here).
    path: str | None = None
    #: What the reference was computed from, for a caller to check before reusing it (JSON-ready; saved with
    #: it): `pytest-precision run` records its checkpoint's weights digest and the inputs' digest here.
    origin: dict[str, Any] | None = None
    #: Largest finite |gradient| over the bw and grad tensors, which sizes fp16 loss scales: measured while
    #: the reference runs; for a loaded Reference, computed from its tensors on first need (None until then).
    max_gradient: float | None = None
    #: repeats -> per-tensor noise of the reference's repeats (see compare), computed on first need.
    noise: dict[int, dict[TensorKey, float]] = field(default_factory=dict, repr=False)
    #: The models a factory source returned for this reference's runs (a model returned twice is refused); for a
    #: computed Reference, with the weight sums of the reference run's model (see reference_integrity).
    products: FactoryProducts = field(default_factory=integrity.RecordingProducts, repr=False)
    #: Per captured tensor, its metrics.reference_sums on the run's device: computed while the reference runs
    #: (for a loaded Reference, on first need) and shared by every variant measured against it.
    sums: dict[TensorKey, torch.Tensor] = field(default_factory=dict, repr=False)
    #: The batch's counted positions on the run's device (see positions.py), worked out on first need.
    positions: Positions | None = field(default=None, repr=False)
    #: Which routers make routing rows: None, transformers' (found automatically); False, none; or a Routers (see
    #: pytest_precision.engine.routers). Not saved: a loaded Reference finds transformers' routers by itself.
    routers: Any = field(default=None, repr=False)
    #: What isolated runs feed each selected module (isolated.Recorded), recorded on first need.
    isolation: Recorded | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from torch import nn

        if self.description is None and self.path is None and isinstance(self.source, nn.Module):
            self.description = model_description(self.source)  # the model as the reference runs it

    @property
    def model(self) -> nn.Module | ModelFactory | ShardedModel | None:
        """The model (or factory) the variants are built from; None for a Reference loaded without one."""
        source = self.source
        return source.factory if isinstance(source, integrity.CheckedFactory) else source

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
        """The same captured tensors bound to `model` (shared, not copied). For a loaded Reference, `model`'s
        weights are checked against those its file records as Reference.load checks them."""
        if isinstance(model, integrity.CheckedFactory):
            model = model.factory
        if self.path is not None:
            model = _checked(self.path, model, self.checksum, self.variant.weight_dtype, self.description)
        return dataclasses.replace(self, source=model)

    def weights_checksum(self) -> tuple[Any, ...] | None:
        """The checksum of the weights the reference ran with, as save() records it: the model's, or that of the
        model a factory built for the reference run (None when not taken)."""
        if self.checksum is not None:
            return self.checksum
        first = getattr(self.products, "first", None)
        return first.checksum() if isinstance(first, integrity.WeightSums) else None

    def model_description(self) -> dict[str, Any] | None:
        """What besides its weights' values defines the model the reference ran (see
        model_facts.model_description), as save() records it (None when not taken)."""
        if self.description is not None:
            return self.description
        first = getattr(self.products, "first", None)
        return first.description if isinstance(first, integrity.WeightSums) else None

    def __repr__(self) -> str:
        source = "None" if self.model is None else type(self.model).__name__
        return (
            f"Reference({self.variant.name}, model={source}, device={self.device}, tensors={len(self.stored)}, "
            f"backward={self.backward}, offload={self.offload})"
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the captured tensors (keys "{kind}/{name}"), the inputs and the settings as safetensors, with a
        SHA-256 of each tensor and of the metadata, the checksum of the weights the reference ran with and the
        model's description (module tree, settings, parameter shapes and dtypes, config), which Reference.load
        checks. Written atomically (see atomic_files), in the umask's ordinary mode; the folder
        must exist.

        An input tensor given twice (the README's {"input_ids": ids, "labels": ids}) is written once and named
        twice; any other tensors sharing storage are written as copies (safetensors refuses shared storage).
        """
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        order = []
        for (name, kind), tensor in self.stored.items():
            order.append([name, kind])
            tensors[f"{kind}/{name}"] = tensor.detach().cpu().contiguous()
        written: dict[Hashable, str] = {}
        inputs = {
            "args": [save_input(tensors, f"args/{i}", v, written) for i, v in enumerate(self.batch.args)],
            "kwargs": {k: save_input(tensors, f"kwargs/{k}", v, written) for k, v in self.batch.kwargs.items()},
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
            "checksum": None if (checksum := self.weights_checksum()) is None else list(checksum),
            "model": self.model_description(),
            "order": order,
            "inputs": inputs,
            **({} if self.origin is None else {"origin": self.origin}),
        }
        written_tensors = unshared(tensors)
        text = integrity.sealed(metadata, written_tensors)
        write_atomically(
            Path(path),
            lambda temporary: save_file(written_tensors, os.fspath(temporary), metadata={METADATA_KEY: text}),
            make_parents=False,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        model: nn.Module | ModelFactory | None = None,
        *,
        loss_fn: LossFn | None = None,
        device: str | torch.device | None = None,
        check_weights: bool = True,
    ) -> Reference:
        """A Reference saved by `save`. Comparing variants against it needs `model` (the same model or a
        factory building it) and, when the reference ran with a custom loss_fn, that `loss_fn` again.
        The tensors stay on the host and move to `device` (default: the saved one) one at a time.

        A file that is not a whole Reference file (truncated, of another writer), or whose tensors or metadata
        differ from the SHA-256 digests it records (tampered), is a ConfigurationError naming it, never a raw
        safetensors or JSON error. A model other than the one the file records (its description: module tree,
        settings, parameter shapes, config) or of other weights is refused here; a factory, when the comparison
        first calls it (see reference_integrity.CheckedFactory), before any run. A file of format 1 (no digests) or
        2 (no description) is refused: save it again. `check_weights=False` skips the model
        check, for a caller that checked the model otherwise (`pytest-precision run` compares the SHA-256 of
        its checkpoint's config.json and weights)."""
        import torch
        from safetensors import safe_open

        shown = os.fspath(path)
        incomplete = f"Reference.load({shown!r}): not a complete Reference file written by Reference.save"
        fix = "re-create it with Reference.save"
        try:
            with safe_open(shown, framework="pt", device="cpu") as handle:
                raw = (handle.metadata() or {}).get(METADATA_KEY)
                tensors = {key: aligned(handle.get_tensor(key)) for key in handle.keys()}  # noqa: SIM118
        except FileNotFoundError as error:
            raise ConfigurationError(f"Reference.load({shown!r}): cannot read it: {error}") from error
        except Exception as error:  # safetensors' SafetensorError is none of OSError, ValueError, RuntimeError
            raise ConfigurationError(f"{incomplete} ({type(error).__name__}: {error}); {fix}") from error
        if raw is None:
            raise ConfigurationError(f"{incomplete} (no {METADATA_KEY} metadata); {fix}")
        try:
            meta = strict_json.loads(raw)  # a key twice or 1e400 is a StrictJsonError (a ValueError): refused
            if not isinstance(meta, dict):
                raise TypeError(f"its metadata is a JSON {type(meta).__name__}, not an object")
            version = meta.get("format")
            fields = loaded_fields(meta, tensors) if version == FORMAT_VERSION else None
            digests = integrity.recorded_digests(meta, list(tensors)) if fields is not None else {}
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, IndexError, RecursionError) as error:
            # ConfigurationError (a bad variant spec) is a ValueError too.
            problem = f"missing {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
            raise ConfigurationError(f"{incomplete} ({problem}); {fix}") from None
        if version == 1:
            raise ConfigurationError(
                f"Reference.load({shown!r}): format 1, written by pytest-precision 0.1, records no digest of its "
                f"tensors, so a change to them cannot be seen; {fix}"
            )
        if version == 2:
            raise ConfigurationError(
                f"Reference.load({shown!r}): format 2 records the model's weights but not the model (its modules, "
                f"settings and config), so another model holding the same weights cannot be told apart; {fix}"
            )
        if fields is None:
            raise ConfigurationError(
                f"Reference.load({shown!r}): unknown format {version!r} (this pytest-precision reads format "
                f"{FORMAT_VERSION}); {fix}"
            )
        changed = integrity.changed_parts(meta, tensors, digests)
        if changed:
            raise ConfigurationError(
                f"Reference.load({shown!r}): {changed}, so the file was changed after Reference.save wrote it; {fix}"
            )
        if device is not None:
            fields["device"] = torch.device(device)
        if check_weights:
            model = _checked(shown, model, fields["checksum"], fields["variant"].weight_dtype, fields["description"])
        return cls(source=model, loss_fn=loss_fn, offload=True, path=shown, products=FactoryProducts(), **fields)


def _checked(path: str, model: Any, recorded: Any, dtype: str, description: Any) -> Any:
    """`model` for a Reference loaded from `path` whose file records the weights checksum `recorded` and the
    model description `description` (None: none, nothing to check): a model checked now, a factory wrapped to
    check what it builds in `dtype`."""
    from torch import nn

    from pytest_precision.distributed.sharding import ShardedModel

    if isinstance(model, integrity.CheckedFactory):
        model = model.factory
    if (recorded is None and description is None) or model is None or isinstance(model, ShardedModel):
        return model
    if isinstance(model, nn.Module):
        integrity.check_module(path, model, recorded, description)
        return model
    if callable(model):
        return integrity.CheckedFactory(model, recorded, path, dtype, description)
    return model


def qualified_name(function: object) -> str:
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}.{name}" if module else name


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

        entries[key] = (weakref.ref(model, drop), reference.with_model(None), anchored(keyed.anchors))
        entries.move_to_end(key)
        while len(entries) > self.max_entries or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            entries.popitem(last=False)


__all__ = ["Reference", "ReferenceCache", "state_checksum"]
