"""How a Reference's fields map to a safetensors file: its inputs and tensors written, and the fields read back
from a file's metadata (see references.Reference.save / load), refusing anything inconsistent."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import RunInfo
from pytest_precision.engine.batch import Batch
from pytest_precision.engine.variants import Variant

if TYPE_CHECKING:
    import torch

#: Where a saved Reference's input tensors are kept, by their place in the batch ("args/0", "kwargs/labels").
INPUT_PREFIX = "__inputs__/"


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in memory aligned as a freshly allocated one (a copy when the file's layout left it unaligned):
    vectorised float32 sums round differently at another alignment, and a loaded Reference must measure
    exactly what the one it was saved from did."""
    return tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors, each one sharing storage with an earlier one copied (safetensors refuses shared storage;
    kept tensors may share, the head's output being the logits)."""
    storages: set[int] = set()
    unshared = {}
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage()
        if storage.data_ptr() in storages:
            tensor = tensor.clone()
        elif storage.data_ptr() != 0 and storage.nbytes() != 0:  # empty tensors share no memory
            storages.add(storage.data_ptr())
        unshared[key] = tensor
    return unshared


def save_input(tensors: dict[str, torch.Tensor], key: str, value: Any, written: dict[Hashable, str]) -> Any:
    """The metadata entry of one input; a tensor goes into `tensors`, once however often it is given
    (`written`: the same view of the same memory -> the key it was written under)."""
    import torch

    if isinstance(value, torch.Tensor):
        view = (
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
            value.device,
        )
        stored_key = written.get(view)
        if stored_key is None:
            stored_key = written[view] = INPUT_PREFIX + key
            tensors[stored_key] = value.detach().cpu().contiguous()
        return {"tensor": stored_key, "requires_grad": bool(value.requires_grad)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ConfigurationError(
        f"Reference.save: input {key.split('/', 1)[1]!r} is a {type(value).__name__}; only tensors and "
        "bool/int/float/str/None inputs can be saved"
    )


def load_input(tensors: Mapping[str, torch.Tensor], entry: Any, handed: dict[str, torch.Tensor]) -> Any:
    """One input from its metadata entry; a tensor written once for two inputs comes back as one object
    (`handed`: key -> the tensor already given out), as the batch that was saved held it."""
    if not isinstance(entry, dict):
        raise TypeError(f"an input entry is a JSON {type(entry).__name__}, not an object")
    if "tensor" in entry:
        key, requires_grad = entry["tensor"], entry["requires_grad"]
        if not isinstance(requires_grad, bool):
            raise TypeError(f"input {key!r}: requires_grad is {requires_grad!r}, not true or false")
        if key not in tensors:
            raise ValueError(f"the input tensor {key!r} its metadata lists is not in the file")
        tensor = handed.get(key)
        if tensor is None:
            tensor = handed[key] = tensors[key].requires_grad_(requires_grad)
        elif tensor.requires_grad != requires_grad:
            tensor = tensors[key].detach().requires_grad_(requires_grad)
        return tensor
    value = entry["value"]
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise TypeError(f"an input value is a JSON {type(value).__name__}, not a number, string, bool or null")
    return value


def loaded_fields(meta: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The Reference fields a saved file's metadata and tensors describe (all but model, loss_fn and path);
    any inconsistency raises ValueError, KeyError or TypeError."""
    import torch

    order = meta["order"]
    if not isinstance(order, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair) for pair in order
    ):
        raise TypeError("its 'order' is not a list of [name, kind] pairs")
    missing = [f"{kind}/{name}" for name, kind in order if f"{kind}/{name}" not in tensors]
    if missing:
        raise ValueError(f"{len(missing)} tensor(s) its metadata lists are not in the file, e.g. {missing[0]!r}")
    inputs = meta["inputs"]
    if not isinstance(inputs["args"], list) or not isinstance(inputs["kwargs"], dict):
        raise TypeError("its 'inputs' are not a list of args and an object of kwargs")
    handed: dict[str, torch.Tensor] = {}
    batch = Batch(
        tuple(load_input(tensors, v, handed) for v in inputs["args"]),
        {k: load_input(tensors, v, handed) for k, v in inputs["kwargs"].items()},
    )
    modules, module_names, checksum = meta["modules"], meta["module_names"], meta["checksum"]
    if modules is not None and not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
        raise TypeError("its 'modules' is not a list of names or null")
    if not isinstance(module_names, list) or not all(isinstance(m, str) for m in module_names):
        raise TypeError("its 'module_names' is not a list of names")
    if checksum is not None and not isinstance(checksum, list):
        raise TypeError("its 'checksum' is not a list or null")
    description = meta["model"]
    if description is not None:
        check_description_record(description)
    if not isinstance(meta["backward"], bool):
        raise TypeError(f"its 'backward' is {meta['backward']!r}, not true or false")
    if meta["loss_fn"] is not None and not isinstance(meta["loss_fn"], str):
        raise TypeError("its 'loss_fn' is not a name or null")
    origin = meta.get("origin")
    if origin is not None and not isinstance(origin, dict):
        raise TypeError("its 'origin' is not an object")
    spec = {k: v for k, v in meta["reference"].items() if k != "prepare"}
    return {
        "batch": batch,
        "device": torch.device(meta["device"]),
        "variant": Variant(**spec),
        "backward": meta["backward"],
        "modules": None if modules is None else tuple(modules),
        "module_names": list(module_names),
        "temperature": float(meta["temperature"]),
        "clip_eps": float(meta["clip_eps"]),
        "info": RunInfo.from_dict(meta["run"]),
        "stored": {(name, kind): tensors[f"{kind}/{name}"] for name, kind in order},
        "checksum": None if checksum is None else tuple(checksum),
        "description": description,
        "loss_fn_name": meta["loss_fn"],
        "origin": origin,
    }


def check_description_record(description: Any) -> None:
    """Raise TypeError unless `description` has the form of a model_facts.model_description (as a file holds it)."""

    def names_and(rest: Any) -> bool:
        return isinstance(rest, list) and all(
            isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[0], str) for entry in rest
        )

    if not isinstance(description, dict) or set(description) != {"modules", "settings", "tensors", "config"}:
        raise TypeError("its 'model' is not an object of modules, settings, tensors and config")
    modules, settings, tensors, config = (description[k] for k in ("modules", "settings", "tensors", "config"))
    if not names_and(modules) or not all(len(m) == 2 and isinstance(m[1], str) for m in modules):
        raise TypeError("its 'model' modules are not a list of [name, class] pairs")
    if not isinstance(settings, dict) or not all(isinstance(v, dict) for v in settings.values()):
        raise TypeError("its 'model' settings are not an object of objects")
    if not names_and(tensors) or not all(
        len(t) == 3 and isinstance(t[1], list) and all(type(n) is int for n in t[1]) and isinstance(t[2], str)
        for t in tensors
    ):
        raise TypeError("its 'model' tensors are not a list of [name, shape, dtype] triples")
    if config is not None and not isinstance(config, dict):
        raise TypeError("its 'model' config is not an object or null")
