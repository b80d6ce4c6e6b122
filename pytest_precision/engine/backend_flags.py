"""Pin the torch backend flags a run depends on, and restore the user's afterwards.

Everything is read and set through public `torch.backends` attributes, only those that
backend_flag_names lists (a variant's `backend` names no other). Two generations of torch differ:

- torch >= 2.9 has per-backend `fp32_precision` settings (`torch.backends.cuda.matmul.fp32_precision`, ...).
  They are pinned per op; the legacy getters are never read, since after the new API has been used they
  may raise.
- torch 2.6 to 2.8 has one `torch.set_float32_matmul_precision()` for matmuls (TF32 on CUDA from "high",
  bf16 on oneDNN at "medium") and `torch.backends.cudnn.allow_tf32` for cuDNN convolutions and RNNs.

The same `matmul_precision` means the same on both: "highest" is IEEE fp32 everywhere, "high" TF32 on CUDA.
The cuBLAS reduced-precision-reduction flags default to True; every run pins them False unless its variant
sets them, so `bf16_reduced_reduction` differs from plain `bf16` on GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.torch_version import torch_version, version_text
from pytest_precision.engine.backend_flag_names import checked_flag_name, checked_flag_value
from pytest_precision.engine.variants import Variant

#: The torch release that brought the per-backend `fp32_precision` settings.
FP32_PRECISION_SINCE = (2, 9)

# The fp32_precision leaves a run pins (torch >= 2.9): report key (backend.op, as torch names them inside) ->
# torch.backends path. Their parents ("all" per backend, and the generic one) are never set, so they need no
# restoring.
_FP32_PRECISION_PATHS: dict[str, str] = {
    "cuda.matmul.fp32_precision": "cuda.matmul.fp32_precision",
    "cuda.conv.fp32_precision": "cudnn.conv.fp32_precision",
    "cuda.rnn.fp32_precision": "cudnn.rnn.fp32_precision",
    "mkldnn.matmul.fp32_precision": "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision": "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision": "mkldnn.rnn.fp32_precision",
}

# What each matmul precision means per backend: cuda has no bf16 mode for fp32 matmuls.
_PRECISION_BY_BACKEND: dict[str, dict[str, str]] = {
    "highest": {"cuda": "ieee", "mkldnn": "ieee"},
    "high": {"cuda": "tf32", "mkldnn": "tf32"},
    "medium": {"cuda": "tf32", "mkldnn": "bf16"},
}

# torch < 2.9: the process-wide matmul precision (a report key, not a torch.backends path) and cuDNN's TF32.
_LEGACY_MATMUL_KEY = "float32_matmul_precision"
_LEGACY_CUDNN_TF32 = "cudnn.allow_tf32"

#: Boolean flags every run pins, with the value a run gets unless its variant's `backend` says otherwise.
PINNED_FLAGS: dict[str, bool] = {
    "cuda.matmul.allow_bf16_reduced_precision_reduction": False,
    "cuda.matmul.allow_fp16_reduced_precision_reduction": False,
}


@dataclass(frozen=True)
class FlagSetting:
    """A backend setting during a run, and whether it can affect the run's device."""

    path: str
    value: Any
    effective: bool


def has_fp32_precision_settings() -> bool:
    """Whether this torch has the per-backend `fp32_precision` settings (torch >= 2.9)."""
    return torch_version() >= FP32_PRECISION_SINCE


def resolve_flag(path: str) -> tuple[object, str]:
    """(owner, attribute) of a backend flag path, one of backend_flag_names.BACKEND_FLAGS.

    Only a listed path is walked, so no dotted path reaches a module (`torch.backends.sys`), a class attribute or
    a dunder; a listed setting this torch lacks is refused naming the torch version.
    """
    import torch

    checked_flag_name(path)
    *parents, attribute = path.split(".")
    owner: object = torch.backends
    try:
        for part in parents:
            owner = getattr(owner, part)
        getattr(owner, attribute)
    except (AttributeError, RuntimeError, AssertionError):
        if attribute == "fp32_precision" and not has_fp32_precision_settings():
            since = version_text(FP32_PRECISION_SINCE)
            raise ConfigurationError(
                f"backend flag {path!r} needs torch >= {since} (this is torch {torch.__version__}); on this "
                "torch use the variant's matmul_precision ('high' is TF32) or 'cudnn.allow_tf32'"
            ) from None
        raise ConfigurationError(
            f"backend flag {path!r} is not in this torch ({torch.__version__}); leave it out or use another torch"
        ) from None
    return owner, attribute


def _flag_is_effective(path: str, device_type: str) -> bool:
    backend = path.split(".", 1)[0]
    if backend in ("cuda", "cudnn"):
        return device_type == "cuda"
    if backend == "mkldnn":
        return device_type == "cpu"
    return True


def _precision_snapshot() -> dict[str, Any]:
    """The current matmul/conv precision settings this torch has, by report key."""
    import torch

    if has_fp32_precision_settings():
        state: dict[str, Any] = {}
        for key, path in _FP32_PRECISION_PATHS.items():
            owner, attribute = resolve_flag(path)
            state[key] = getattr(owner, attribute)
        return state
    return {
        _LEGACY_MATMUL_KEY: torch.get_float32_matmul_precision(),
        _LEGACY_CUDNN_TF32: bool(torch.backends.cudnn.allow_tf32),
    }


def _precision_apply(state: Mapping[str, Any]) -> None:
    import torch

    for key, value in state.items():
        if key == _LEGACY_MATMUL_KEY:
            torch.set_float32_matmul_precision(value)
        else:
            owner, attribute = resolve_flag(_FP32_PRECISION_PATHS.get(key, key))
            setattr(owner, attribute, value)


@contextlib.contextmanager
def precision_kept() -> Iterator[None]:
    """Restore the matmul/conv precision settings on exit, whatever the body set (a library that calls
    torch.set_float32_matmul_precision, as torchao < 0.13's quantize_ does)."""
    import torch

    legacy, saved = torch.get_float32_matmul_precision(), _precision_snapshot()
    try:
        yield
    finally:
        # torch >= 2.9 keeps the legacy setting apart from the per-backend leaves it writes: restore both.
        torch.set_float32_matmul_precision(legacy)
        _precision_apply(saved)


def _pinned_precision(matmul_precision: str, device_type: str) -> list[FlagSetting]:
    """The precision settings that give `matmul_precision` on this torch, each with its effect on the device."""
    if has_fp32_precision_settings():
        by_backend = _PRECISION_BY_BACKEND[matmul_precision]
        return [
            FlagSetting(key, by_backend[key.split(".", 1)[0]], _flag_is_effective(key, device_type))
            for key in _FP32_PRECISION_PATHS
        ]
    return [
        FlagSetting(_LEGACY_MATMUL_KEY, matmul_precision, True),
        FlagSetting(_LEGACY_CUDNN_TF32, matmul_precision != "highest", _flag_is_effective("cudnn", device_type)),
    ]


@contextlib.contextmanager
def pinned_backend(variant: Variant, device_type: str) -> Iterator[list[FlagSetting]]:
    """Set the matmul precision and backend flags of `variant`; restore every touched setting on exit.

    Yields what was set, each marked with whether it can have an effect on `device_type`.
    """
    flag_values: dict[str, Any] = dict(PINNED_FLAGS)
    # Every name and value is checked before anything is set: a refused one leaves every setting as it was.
    flag_values.update({path: checked_flag_value(checked_flag_name(path), v) for path, v in variant.backend.items()})
    owners = {path: resolve_flag(path) for path in flag_values}
    saved_precision = _precision_snapshot()
    saved_flags: dict[str, Any] = {}
    try:
        for path, (owner, attribute) in owners.items():
            saved_flags[path] = getattr(owner, attribute)
        settings = _pinned_precision(variant.matmul_precision, device_type)
        _precision_apply({s.path: s.value for s in settings})
        for path, value in flag_values.items():
            owner, attribute = owners[path]
            setattr(owner, attribute, value)
            settings.append(FlagSetting(path, value, _flag_is_effective(path, device_type)))
        yield settings
    finally:
        for path, value in saved_flags.items():
            owner, attribute = owners[path]
            setattr(owner, attribute, value)
        _precision_apply(saved_precision)


def flags_to_dict(settings: list[FlagSetting]) -> dict[str, Any]:
    """{"settings": {path: value}, "no_effect": [paths that cannot affect this device]}, sorted by path.

    A path set twice (a variant's `backend` overriding a pinned precision) keeps its last value.
    """
    last = {s.path: s for s in settings}
    ordered = sorted(last.values(), key=lambda s: s.path)
    return {
        "settings": {s.path: s.value for s in ordered},
        "no_effect": [s.path for s in ordered if not s.effective],
    }


def snapshot_backend_state(extra_paths: Mapping[str, Any] = PINNED_FLAGS) -> dict[str, Any]:
    """The user's current values of every setting a run may touch (for isolation tests)."""
    state: dict[str, Any] = {f"precision:{key}": value for key, value in _precision_snapshot().items()}
    for path in extra_paths:
        owner, attribute = resolve_flag(path)
        state[path] = getattr(owner, attribute)
    return state
