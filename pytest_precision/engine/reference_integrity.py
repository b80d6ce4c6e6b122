"""What a saved Reference records so that loading it refuses a changed file, another model or other weights,
never measures.

A SHA-256 of each tensor (its dtype, shape and bytes) and of the metadata: a tensor or a setting changed after
`Reference.save` wrote the file is named at load. The checksum of the weights the reference ran with (see
fingerprint.state_checksum): the user's model itself, or, for a factory, the model it built for the reference
run (`RecordingProducts` takes its sums on the device, read only when saved). A loaded Reference checks a model
at once and a factory (`CheckedFactory`) when the comparison first calls it, before anything runs.
What besides the weights' values defines the model (model_facts.model_description: the module tree, torch.nn
modules' settings, parameter and buffer shapes and dtypes, a transformers config): the same weights in a model
of another `rms_norm_eps` measure something else, so a difference is refused naming the fields
(`config.rms_norm_eps: 1e-06 in the reference, 1e-05 now`), before the weights are compared.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pytest_precision.base.dtypes import torch_dtype
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.fingerprint import _tensor_sums, same_checksum, state_checksum
from pytest_precision.engine.model_build import FactoryProducts
from pytest_precision.engine.model_facts import model_description

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pytest_precision.base.dtypes import ModelFactory

#: Metadata keys: tensor key -> SHA-256 of the tensor, and the SHA-256 of the rest of the metadata.
TENSOR_DIGESTS_KEY = "tensor_sha256"
METADATA_DIGEST_KEY = "metadata_sha256"
#: References of more bytes than this hash their tensors on several threads (hashlib lets go of the GIL).
PARALLEL_HASH_BYTES = 64 << 20
#: Characters of a weights checksum's digest shown in a message.
SHOWN_DIGEST = 16
#: Differences of a model's description named in a refusal (the rest counted).
SHOWN_DIFFERENCES = 3


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a host tensor's dtype, shape and bytes: an edited value, or a header giving its bytes another
    dtype or shape, changes it."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    digest = hashlib.sha256(f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}\n".encode())
    digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """tensor_digest of each tensor by key; on several threads for a big reference."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= PARALLEL_HASH_BYTES or len(tensors) < 2:
        return {key: tensor_digest(t) for key, t in tensors.items()}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(tensors, pool.map(tensor_digest, tensors.values()), strict=True))


def metadata_digest(meta: Mapping[str, Any]) -> str:
    """SHA-256 of the metadata without its own digest, as canonical JSON (keys sorted)."""
    body = {key: value for key, value in meta.items() if key != METADATA_DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed(meta: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> str:
    """The metadata as the JSON text of a file holding `tensors`, with the digests of both."""
    meta = {**meta, TENSOR_DIGESTS_KEY: tensor_digests(tensors)}
    meta = json.loads(json.dumps(meta))  # what a reader parses: lists for tuples, string keys
    return json.dumps({**meta, METADATA_DIGEST_KEY: metadata_digest(meta)}, sort_keys=True)


def recorded_digests(meta: Mapping[str, Any], keys: list[str]) -> dict[str, str]:
    """The tensor digests the metadata records, one for each of `keys` (the file's tensors); a malformed or
    incomplete record raises TypeError, ValueError or KeyError."""
    digests, own = meta[TENSOR_DIGESTS_KEY], meta[METADATA_DIGEST_KEY]
    if not isinstance(own, str):
        raise TypeError(f"its {METADATA_DIGEST_KEY!r} is not a string")
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise TypeError(f"its {TENSOR_DIGESTS_KEY!r} is not an object of strings")
    if set(digests) != set(keys):
        unlisted = sorted(set(keys) - set(digests)) or sorted(set(digests) - set(keys))
        raise ValueError(f"its {TENSOR_DIGESTS_KEY!r} and the file's tensors differ, e.g. at {unlisted[0]!r}")
    return digests


def changed_parts(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], digests: Mapping[str, str]) -> str:
    """What differs from the digests the file records ("" when nothing): the metadata, or the tensors by key."""
    if metadata_digest(meta) != meta[METADATA_DIGEST_KEY]:
        return "its metadata differs from the SHA-256 it records"
    now = tensor_digests(tensors)
    changed = [key for key in tensors if now[key] != digests[key]]
    if not changed:
        return ""
    shown = ", ".join(repr(key) for key in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    verb = "differs" if len(changed) == 1 else "differ"
    return f"{len(changed)} of its {len(tensors)} tensors {verb} from the SHA-256 digests it records: {shown}"


class WeightSums:
    """state_checksum of a model with its sums left on their devices: taking it makes no host sync; `checksum()`
    reads them (one host copy per device). With the model's description (model_facts.model_description)."""

    def __init__(self, model: nn.Module) -> None:
        import torch

        named = [*model.named_parameters(), *model.named_buffers()]
        self.training = model.training
        self.description = model_description(model)
        self.layout = tuple((name, tuple(t.shape), str(t.dtype), str(t.device)) for name, t in named)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, tensor in named:  # grouped by device in first-seen order, as fingerprint._checksum
            by_device.setdefault(tensor.device, []).append(_tensor_sums(tensor))
        self._parts = [torch.stack(parts).reshape(-1) for parts in by_device.values()]

    def checksum(self) -> tuple[Any, ...]:
        sums: list[float] = []
        for part in self._parts:
            sums += part.cpu().tolist()
        return (self.training, (self.layout, tuple(sums)))


class RecordingProducts(FactoryProducts):
    """A computed Reference's FactoryProducts: also takes the WeightSums of the first model its factory builds,
    the reference run's, whose checksum Reference.save records."""

    def __init__(self) -> None:
        super().__init__()
        self.first: WeightSums | None = None

    def check(self, model: nn.Module) -> None:
        super().check(model)
        if self.first is None:
            self.first = WeightSums(model)


def checksum_digest(checksum: Any) -> str:
    """A short hex digest of a weights checksum (names, shapes, dtypes and sums; not devices or the training
    flag, which same_checksum ignores too), to name it in a message."""
    try:
        _, (layout, sums) = checksum
        text = json.dumps([[[n, list(s), d] for n, s, d, *_ in layout], [float(x) for x in sums]])
    except (TypeError, ValueError):
        text = repr(checksum)
    return hashlib.sha256(text.encode()).hexdigest()[:SHOWN_DIGEST]


def checksum_difference(recorded: Any, now: tuple[Any, ...]) -> str:
    """What differs between a recorded weights checksum and `now`'s: the tensors, their shapes and dtypes, or the
    values of which tensors."""
    try:
        _, (layout, sums) = recorded
        _, (now_layout, now_sums) = now
        names, now_names = [entry[0] for entry in layout], [entry[0] for entry in now_layout]
        if names != now_names:
            absent = [n for n in names if n not in now_names]
            added = [n for n in now_names if n not in names]
            if not absent and not added:
                return "the same parameters and buffers in another order"
            missing = f"{len(absent)} of the file's model's missing here, e.g. {absent[0]!r}" if absent else ""
            extra = f"{len(added)} here not in the file's model, e.g. {added[0]!r}" if added else ""
            return "parameters or buffers: " + "; ".join(part for part in (missing, extra) if part)
        for (name, shape, dtype, *_), (_, now_shape, now_dtype, *_) in zip(layout, now_layout, strict=True):
            if list(shape) != list(now_shape) or dtype != now_dtype:
                return f"{name!r} is {now_dtype} {list(now_shape)} here, {dtype} {list(shape)} in the file"
        one_device = len({entry[3] for entry in layout}) == 1 and len({entry[3] for entry in now_layout}) == 1
        if not one_device or len(sums) != 2 * len(names) or len(now_sums) != len(sums):
            return "the same names, shapes and dtypes; other values"
        changed = [
            name
            for index, name in enumerate(names)
            if not all(
                math.isclose(float(a), b, rel_tol=1e-9, abs_tol=1e-9)
                for a, b in zip(sums[2 * index : 2 * index + 2], now_sums[2 * index : 2 * index + 2], strict=True)
            )
        ]
        return f"the values of {len(changed)} of {len(names)} parameters and buffers differ, e.g. {changed[0]!r}"
    except (TypeError, ValueError, IndexError, KeyError):
        return "a checksum the file records in another form"


def weights_refusal(
    call: str, headline: str, where: str, recorded: Any, now: tuple[Any, ...], advice: str
) -> ConfigurationError:
    """The error for weights other than the recorded: `call` names the load, `headline` says whose weights
    differ, `where` which weights `now` is the checksum of."""
    return ConfigurationError(
        f"{call}: {headline}: weights checksum {checksum_digest(now)} {where}, {checksum_digest(recorded)} in the "
        f"file ({checksum_difference(recorded, now)}); {advice}"
    )


#: Stands for a field, module or tensor one side's description lacks.
_ABSENT = object()
#: Characters of one described value shown in a message.
SHOWN_VALUE = 80


def _shown(value: Any) -> str:
    """A described value as a message shows it: a string quoted, a number as Python writes it (1e-06), a long
    one cut, an object by its count of fields."""
    if value is _ABSENT:
        return "absent"
    if isinstance(value, dict):
        return f"an object of {len(value)} fields"  # a whole config: its fields are not the news
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE else text[: SHOWN_VALUE - 3] + "..."


def _canonical(value: Any) -> str:
    """JSON text to compare two described values by (NaN equal to itself, 1 unequal to 1.0 and True)."""
    return json.dumps(value, sort_keys=True)


def _config_differences(recorded: Any, now: Any, prefix: str = "config.") -> list[str]:
    """`field: X in the reference, Y now` for each field of two config descriptions that differs; a nested dict
    field by field (`config.rope_parameters.rope_theta`)."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        lines = []
        for key in [*recorded, *(k for k in now if k not in recorded)]:
            old, new = recorded.get(key, _ABSENT), now.get(key, _ABSENT)
            if isinstance(old, dict) and isinstance(new, dict):
                lines += _config_differences(old, new, f"{prefix}{key}.")
            elif old is _ABSENT or new is _ABSENT or _canonical(old) != _canonical(new):
                lines.append(f"{prefix}{key}: {_shown(old)} in the reference, {_shown(new)} now")
        return lines
    if _canonical(recorded) == _canonical(now):
        return []
    recorded = _ABSENT if recorded is None else recorded
    now = _ABSENT if now is None else now
    return [f"{prefix.rstrip('.')}: {_shown(recorded)} in the reference, {_shown(now)} now"]


def _inside(name: str, modules: set[str]) -> bool:
    """Whether `name` lies inside one of `modules` (qualified names; "" is the model itself)."""
    return any(name == module or name.startswith(f"{module}.") for module in modules if module)


def _keyed_differences(what: str, recorded: list[Any], now: list[Any], show: Any, named: set[str]) -> list[str]:
    """`what name: X in the reference, Y now` for each entry [name, *rest] of two lists that differs, in the
    reference's order, then those only `now` has; `show(rest)` says what an entry is. An entry inside a module
    in `named` (modules found on one side only or of another class, to which each module named is added) goes
    unnamed: its module is."""
    old = {entry[0]: entry[1:] for entry in recorded}
    new = {entry[0]: entry[1:] for entry in now}
    lines = []
    for name in [*old, *(n for n in new if n not in old)]:
        a, b = old.get(name, _ABSENT), new.get(name, _ABSENT)
        if _inside(name, named) or (a is not _ABSENT and b is not _ABSENT and _canonical(a) == _canonical(b)):
            continue
        if what == "module":
            named.add(name)
        shown_a = "absent" if a is _ABSENT else show(a)
        shown_b = "absent" if b is _ABSENT else show(b)
        lines.append(f"{what} {name or '(the model)'}: {shown_a} in the reference, {shown_b} now")
    if not lines and [n for n in old if n in new] != [n for n in new if n in old]:
        lines.append(f"{what}: the same names, in another order")
    return lines


def description_differences(recorded: Any, now: dict[str, Any]) -> list[str]:
    """What differs between a recorded model description and `now`'s (see model_facts.model_description), one
    line each: the config's fields, then the modules, their settings, the parameters and buffers (none inside a
    module that one side lacks or that is of another class: that module is named). A malformed record raises
    TypeError, ValueError, KeyError or IndexError."""
    if not isinstance(recorded, dict):
        raise TypeError(f"a model description is a JSON {type(recorded).__name__}, not an object")
    now = json.loads(json.dumps(now))  # as the file holds it: lists for tuples, string keys
    named: set[str] = set()
    lines = _config_differences(recorded["config"], now["config"])
    lines += _keyed_differences("module", recorded["modules"], now["modules"], lambda rest: rest[0], named)
    old_settings, new_settings = recorded["settings"], now["settings"]
    for module in [*old_settings, *(m for m in new_settings if m not in old_settings)]:
        if not _inside(module, named):
            lines += _config_differences(old_settings.get(module, {}), new_settings.get(module, {}), f"{module}.")
    lines += _keyed_differences(
        "parameter or buffer",
        recorded["tensors"],
        now["tensors"],
        lambda rest: f"{rest[1]} {list(rest[0])}",
        named,
    )
    return lines


def check_description(call: str, recorded: Any, model: nn.Module, advice: str, whose: str = "the model") -> None:
    """Refuse a model that is not the one described by `recorded` (None: nothing recorded, nothing to check),
    naming the first SHOWN_DIFFERENCES differences; `call` names the load, `whose` the model checked."""
    if recorded is None:
        return
    try:
        lines = description_differences(recorded, model_description(model))
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
        raise ConfigurationError(
            f"{call}: the model description it records is malformed ({type(error).__name__}: {error}); "
            "re-create it with Reference.save"
        ) from None
    if not lines:
        return
    more = len(lines) - SHOWN_DIFFERENCES
    shown = "; ".join(lines[:SHOWN_DIFFERENCES]) + (f"; and {more} more" if more > 0 else "")
    raise ConfigurationError(
        f"{call}: {whose} differs from the one the reference was computed with, whatever its weights ({shown}); "
        f"{advice}"
    )


def check_module(path: str, model: nn.Module, recorded: Any, description: Any = None) -> None:
    """Refuse a model other than the one the reference was computed with: another description (module tree,
    settings, config), then other parameters or buffers."""
    advice = "pass the same model, or compute a new reference with reference(model, inputs, ...)"
    check_description(f"Reference.load({path!r})", description, model, advice)
    if recorded is None:
        return
    now = state_checksum(model)
    if not same_checksum(recorded, now):
        raise weights_refusal(
            f"Reference.load({path!r})",
            "the model's weights differ from those the reference was computed with",
            "here",
            recorded,
            now,
            advice,
        )


class CheckedFactory:
    """The factory of a loaded Reference. Before the first model it builds is used, the model it builds in the
    reference's dtype is checked against the description and weights checksum the file records: that model's
    when the first run asks for that dtype, else those of one built for the check alone (and dropped before the
    run's is built)."""

    def __init__(self, factory: ModelFactory, recorded: Any, path: str, dtype: str, description: Any = None) -> None:
        self.factory = factory
        self.recorded = recorded
        self.description = description
        self.path = path
        self.dtype = dtype
        self.checked = False

    def __call__(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if self.checked:
            return self.factory(dtype, device)
        wanted = torch_dtype(self.dtype)
        built = self.factory(wanted, device)
        self._check(built)
        if dtype == wanted:
            return built
        del built
        return self.factory(dtype, device)

    def _check(self, model: object) -> None:
        from torch import nn

        if not isinstance(model, nn.Module):
            return  # not a model: build_run_model refuses it
        call = f"Reference.load({self.path!r}, model=factory)"
        advice = (
            "pass the factory (or model) the reference was computed with, or compute a new reference with "
            "reference(factory, inputs, ...)"
        )
        check_description(call, self.description, model, advice, f"the {self.dtype} model it builds")
        now = None if self.recorded is None else state_checksum(model)
        if now is not None and not same_checksum(self.recorded, now):
            raise weights_refusal(
                call,
                "the factory builds other weights than those the reference was computed with",
                f"of the {self.dtype} model it builds",
                self.recorded,
                now,
                advice,
            )
        self.checked = True
