"""Pin the torch backend flags a run depends on, and restore the user's afterwards.

fp32 matmul precision is pinned through the per-backend `fp32_precision` settings (torch >= 2.9). The
legacy getters (`torch.get_float32_matmul_precision()`, `allow_tf32`) are never read: once the new API has
been used they may raise. The cuBLAS reduced-precision-reduction flags default to True; every run pins them
False unless its variant sets them, so `bf16_reduced_reduction` differs from plain `bf16` on GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.variants import Variant

# (backend, op) pairs of torch's fp32_precision settings, parents before children so that restoring in
# this order reproduces each effective value.
_FP32_PRECISION_KEYS: tuple[tuple[str, str], ...] = (
    ("generic", "all"),
    ("cuda", "all"),
    ("mkldnn", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)

# What each matmul precision means per backend: cuda has no bf16 mode for fp32 matmuls.
_PRECISION_BY_BACKEND: dict[str, dict[str, str]] = {
    "highest": {"cuda": "ieee", "mkldnn": "ieee"},
    "high": {"cuda": "tf32", "mkldnn": "tf32"},
    "medium": {"cuda": "tf32", "mkldnn": "bf16"},
}

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


def _resolve_flag(path: str) -> tuple[object, str]:
    import torch

    *parents, attribute = path.split(".")
    owner: object = torch.backends
    try:
        for part in parents:
            owner = getattr(owner, part)
        getattr(owner, attribute)
    except (AttributeError, RuntimeError, AssertionError):
        raise ConfigurationError(
            f"backend flag {path!r} is not an attribute of torch.backends; use a dotted path such as "
            "'cuda.matmul.allow_bf16_reduced_precision_reduction'"
        ) from None
    return owner, attribute


def _flag_is_effective(path: str, device_type: str) -> bool:
    backend = path.split(".", 1)[0]
    if backend in ("cuda", "cudnn"):
        return device_type == "cuda"
    if backend == "mkldnn":
        return device_type == "cpu"
    return True


def _fp32_snapshot() -> list[tuple[str, str, str]]:
    import torch

    return [(b, op, torch._C._get_fp32_precision_getter(b, op)) for b, op in _FP32_PRECISION_KEYS]


def _fp32_restore(snapshot: list[tuple[str, str, str]]) -> None:
    import torch

    for backend, op, value in snapshot:
        torch._C._set_fp32_precision_setter(backend, op, value)


def fp32_precision_settings() -> dict[str, str]:
    """The current fp32_precision per (backend.op), for the report's environment block."""
    return {f"{b}.{op}": value for b, op, value in _fp32_snapshot()}


@contextlib.contextmanager
def pinned_backend(variant: Variant, device_type: str) -> Iterator[list[FlagSetting]]:
    """Set the matmul precision and backend flags of `variant`; restore every touched setting on exit.

    Yields what was set, each marked with whether it can have an effect on `device_type`.
    """
    import torch

    flag_values: dict[str, Any] = dict(PINNED_FLAGS)
    flag_values.update(variant.backend)
    owners = {path: _resolve_flag(path) for path in flag_values}
    saved_fp32 = _fp32_snapshot()
    saved_flags: dict[str, Any] = {}
    try:
        for path, (owner, attribute) in owners.items():
            saved_flags[path] = getattr(owner, attribute)
        precision = _PRECISION_BY_BACKEND[variant.matmul_precision]
        settings: list[FlagSetting] = []
        for backend in ("cuda", "mkldnn"):
            for op in ("matmul", "conv", "rnn"):
                torch._C._set_fp32_precision_setter(backend, op, precision[backend])
                settings.append(
                    FlagSetting(
                        f"{backend}.{op}.fp32_precision",
                        precision[backend],
                        _flag_is_effective(backend, device_type),
                    )
                )
        for path, value in flag_values.items():
            owner, attribute = owners[path]
            setattr(owner, attribute, value)
            settings.append(FlagSetting(path, value, _flag_is_effective(path, device_type)))
        yield settings
    finally:
        for path, value in saved_flags.items():
            owner, attribute = owners[path]
            setattr(owner, attribute, value)
        _fp32_restore(saved_fp32)


def flags_to_dict(settings: list[FlagSetting]) -> dict[str, Any]:
    """{"settings": {path: value}, "no_effect": [paths that cannot affect this device]}, sorted by path."""
    ordered = sorted(settings, key=lambda s: s.path)
    return {
        "settings": {s.path: s.value for s in ordered},
        "no_effect": [s.path for s in ordered if not s.effective],
    }


def snapshot_backend_state(extra_paths: Mapping[str, Any] = PINNED_FLAGS) -> dict[str, Any]:
    """The user's current values of every setting a run may touch (for isolation tests)."""
    state: dict[str, Any] = {f"fp32:{b}.{op}": v for b, op, v in _fp32_snapshot()}
    for path in extra_paths:
        owner, attribute = _resolve_flag(path)
        state[path] = getattr(owner, attribute)
    return state
