"""Chosen-token log-probabilities produced elsewhere (a trainer against an inference engine), as a report.

`compare_logprobs(a, b)` treats `a` as the variant and `b` as the reference: delta = a - b is the log of the
importance ratio pi_a / pi_b (for a trainer `a` against an engine `b` that sampled, the ratio RL
post-training applies). The result is a PrecisionReport with one "logprob" row, gated by
`assert_precision_within` like any other.

With each side's own high-precision reference (`ref_a`, `ref_b`: the same tokens scored by each stack in
float64/float32, say), the mismatch splits exactly into

    delta = floor + e_a - e_b,   e_a = a - ref_a,   e_b = b - ref_b,   floor = ref_a - ref_b,

the floor being what the two stacks disagree on even at high precision (different kernels, fused ops,
sampling parameters), and e_a, e_b each stack's own low-precision error. Their correlation `rho` says
whether the errors cancel (rho near 1: both stacks round alike) or add (rho near 0: independent).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import Record
from pytest_precision.numbers.logprobs import DEFAULT_CLIP_EPS, log_ratio_stats
from pytest_precision.numbers.metrics import tensor_error

if TYPE_CHECKING:
    import numpy as np
    import torch

    #: A log-probability vector: a tensor, a NumPy array, or a .pt / .safetensors / .npy file.
    LogprobSource: TypeAlias = torch.Tensor | np.ndarray[Any, Any] | str | os.PathLike[str]

#: The key a file holding several tensors must store the log-probabilities under.
LOGPROBS_KEY = "logprobs"
SUFFIXES = (".pt", ".pth", ".safetensors", ".npy")
RECORD_NAME = "logprob"
RECORD_KIND = "logprob"


@dataclass(frozen=True)
class Decomposition:
    """delta = floor + e_a - e_b over the positions where all four vectors are finite and counted.

    rho: Pearson correlation of e_a and e_b (None when either is constant or nothing is counted).
    rms_e_a, rms_e_b: sqrt(mean(e^2)) of each side's own error; rms_e_diff: that of e_a - e_b;
    rms_floor: that of floor = ref_a - ref_b.
    """

    rho: float | None
    rms_e_a: float | None
    rms_e_b: float | None
    rms_e_diff: float | None
    rms_floor: float | None


def error_terms(
    a: torch.Tensor, b: torch.Tensor, ref_a: torch.Tensor, ref_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(floor, e_a, e_b) in float64: floor = ref_a - ref_b, e_a = a - ref_a, e_b = b - ref_b."""
    import torch

    a, b, ref_a, ref_b = (t.to(torch.float64) for t in (a, b, ref_a, ref_b))
    return ref_a - ref_b, a - ref_a, b - ref_b


def decomposition(
    a: torch.Tensor, b: torch.Tensor, ref_a: torch.Tensor, ref_b: torch.Tensor, valid: torch.Tensor
) -> Decomposition:
    """The decomposition statistics over the positions of `valid` where a, b, ref_a and ref_b are finite."""
    import torch

    floor, e_a, e_b = error_terms(a, b, ref_a, ref_b)
    keep = valid & torch.isfinite(floor) & torch.isfinite(e_a) & torch.isfinite(e_b)
    floor, e_a, e_b = floor[keep], e_a[keep], e_b[keep]
    n = floor.numel()
    if n == 0:
        return Decomposition(None, None, None, None, None)

    def rms(values: torch.Tensor) -> float:
        return math.sqrt(float(values.square().sum()) / n)

    rho: float | None = None
    # Exactly constant (min == max) rather than a variance near zero, which a constant like 0.1 does not give.
    if float(e_a.min()) != float(e_a.max()) and float(e_b.min()) != float(e_b.max()):
        centred_a = e_a - e_a.mean()
        centred_b = e_b - e_b.mean()
        denominator = math.sqrt(float(centred_a.square().sum()) * float(centred_b.square().sum()))
        if denominator > 0:
            rho = min(max(float((centred_a * centred_b).sum()) / denominator, -1.0), 1.0)
    return Decomposition(rho=rho, rms_e_a=rms(e_a), rms_e_b=rms(e_b), rms_e_diff=rms(e_a - e_b), rms_floor=rms(floor))


def _describe(value: object) -> str:
    """How an argument's value shows in a message: its file, or its type."""
    if isinstance(value, (str, os.PathLike)):
        return f"file {os.fspath(value)}"
    module = type(value).__module__.split(".")[0]
    if module == "torch":
        return "a tensor"
    if module == "numpy":
        return "a NumPy array"
    return f"a {type(value).__name__}"


def _from_mapping(loaded: dict[Any, Any], argument: str, path: Path) -> Any:
    """The tensor a dict holds: its "logprobs" entry, or its only entry."""
    if LOGPROBS_KEY in loaded:
        return loaded[LOGPROBS_KEY]
    if len(loaded) == 1:
        return next(iter(loaded.values()))
    keys = ", ".join(repr(k) for k in list(loaded)[:8]) + (", ..." if len(loaded) > 8 else "")
    what = "nothing" if not loaded else f"{len(loaded)} entries ({keys})"
    raise ConfigurationError(
        f"{argument}: file {path} holds {what} and none is named {LOGPROBS_KEY!r}; save a single tensor, or "
        f"store the log-probabilities under the key {LOGPROBS_KEY!r}"
    )


def _read_file(path: Path, argument: str) -> Any:
    """The raw content of a .pt / .safetensors / .npy file (a tensor or an array, not yet checked)."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigurationError(
            f"{argument}: file {path} has the unknown suffix {path.suffix or '(none)'!r}; save the "
            f"log-probabilities as {', '.join(SUFFIXES)} (torch.save, safetensors.torch.save_file or numpy.save), "
            "or pass a tensor or NumPy array"
        )
    if not path.is_file():
        raise ConfigurationError(
            f"{argument}: file {path} does not exist (or is not a file; working directory {Path.cwd()}); "
            "check the path, or pass a tensor or NumPy array"
        )
    try:
        if suffix == ".npy":
            import numpy as np

            return np.load(path, allow_pickle=False)
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            return _from_mapping(dict(load_file(os.fspath(path), device="cpu")), argument, path)
        import torch

        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except ConfigurationError:
        raise
    except Exception as error:
        raise ConfigurationError(
            f"{argument}: cannot read file {path} as {suffix}: {type(error).__name__}: {error}; write it with "
            "torch.save (.pt), safetensors.torch.save_file (.safetensors) or numpy.save (.npy)"
        ) from error
    return _from_mapping(loaded, argument, path) if isinstance(loaded, dict) else loaded


def _as_tensor(value: object, argument: str) -> torch.Tensor:
    """A CPU tensor of the argument's values, of its own dtype (files read, arrays wrapped)."""
    import numpy as np
    import torch

    shown = _describe(value)
    content = _read_file(Path(value), argument) if isinstance(value, (str, os.PathLike)) else value
    if isinstance(content, np.ndarray):
        if content.dtype.kind not in "biuf":
            raise ConfigurationError(
                f"{argument} ({shown}) is a NumPy array of dtype {content.dtype}; pass real numbers"
            )
        if not content.dtype.isnative:
            # A big-endian file (numpy.save of a '>f4' array, written on or for another machine): torch reads
            # only native byte order, so convert the values rather than refuse them.
            content = content.astype(content.dtype.newbyteorder("="))
        return torch.from_numpy(np.ascontiguousarray(content))
    if isinstance(content, torch.Tensor):
        if content.is_complex():
            raise ConfigurationError(f"{argument} ({shown}) is a complex tensor; pass real numbers")
        return content.detach().cpu()
    raise ConfigurationError(
        f"{argument} ({shown}) holds a {type(content).__name__}, not a tensor; pass a torch tensor, a NumPy "
        f"array, or the path of a {', '.join(SUFFIXES)} file holding one"
    )


def _load(value: object, argument: str) -> tuple[torch.Tensor, str]:
    """(float64 tensor of shape (tokens,) or (batch, tokens), how the argument shows in a message)."""
    import torch

    tensor = _as_tensor(value, argument)
    shown = _describe(value)
    if not tensor.is_floating_point():
        raise ConfigurationError(
            f"{argument} ({shown}) holds {str(tensor.dtype).removeprefix('torch.')} values, not log-probabilities; "
            "pass floating-point log-probabilities (float32 or float64)"
        )
    if tensor.dim() not in (1, 2):
        raise ConfigurationError(
            f"{argument} ({shown}) has shape {tuple(tensor.shape)}; pass per-token log-probabilities of shape "
            "(tokens,) or (batch, tokens)"
        )
    return tensor.to(torch.float64), shown


def _load_mask(value: object, shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    mask = _as_tensor(value, "mask")
    shown = _describe(value)
    if tuple(mask.shape) != shape:
        raise ConfigurationError(
            f"mask ({shown}) has shape {tuple(mask.shape)}, the log-probabilities {shape}; pass one entry per token"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ConfigurationError(f"mask ({shown}) holds values other than 0 and 1; pass a bool or 0/1 array")
        mask = mask != 0
    return mask


def _check_names(names: tuple[str, str]) -> tuple[str, str]:
    if (
        not isinstance(names, (tuple, list))
        or len(names) != 2
        or not all(isinstance(n, str) and n for n in names)
        or names[0] == names[1]
    ):
        raise ConfigurationError(
            f"names={names!r}: pass two different, non-empty names: (that of a, the variant; that of b, the reference)"
        )
    return names[0], names[1]


def logprob_record(
    a: LogprobSource,
    b: LogprobSource,
    *,
    ref_a: LogprobSource | None = None,
    ref_b: LogprobSource | None = None,
    mask: LogprobSource | None = None,
    clip_eps: float = DEFAULT_CLIP_EPS,
    names: tuple[str, str] = ("a", "b"),
) -> tuple[Record, int]:
    """The "logprob" record of compare_logprobs (see pytest_precision.reports.report.compare_logprobs, whose
    arguments these are) and the number of tokens it counted."""

    import torch

    _check_names(names)
    if isinstance(clip_eps, bool) or not isinstance(clip_eps, (int, float)) or not 0 < clip_eps < 1:
        raise ConfigurationError(f"clip_eps={clip_eps!r}: pass a number in (0, 1), e.g. PPO's 0.2")
    if (ref_a is None) != (ref_b is None):
        given, absent = ("ref_a", "ref_b") if ref_a is not None else ("ref_b", "ref_a")
        raise ConfigurationError(
            f"{given} is given without {absent}: the decomposition delta = (ref_a - ref_b) + e_a - e_b needs "
            "both references; pass both, or neither"
        )

    values: dict[str, torch.Tensor] = {}
    shown: dict[str, str] = {}
    for argument, value in (("a", a), ("b", b), ("ref_a", ref_a), ("ref_b", ref_b)):
        if value is not None:
            values[argument], shown[argument] = _load(value, argument)
    shape = tuple(values["b"].shape)
    for argument, tensor in values.items():
        if tuple(tensor.shape) != shape:
            raise ConfigurationError(
                f"{argument} ({shown[argument]}) has shape {tuple(tensor.shape)} but b ({shown['b']}) has {shape}; "
                "pass log-probabilities of the same tokens, in the same layout, for every argument"
            )
    counted = torch.ones(shape, dtype=torch.bool) if mask is None else _load_mask(mask, shape)
    counted = counted & torch.isfinite(values["b"])
    token_count = int(counted.sum())
    if token_count == 0:
        raise ConfigurationError(
            f"no token to compare: the mask and the non-finite values of b ({shown['b']}) leave out all "
            f"{values['b'].numel()} positions; pass a mask with some True positions and a finite b"
        )

    a_values, b_values = values["a"], values["b"]
    error = tensor_error(b_values[counted], a_values[counted])
    compared = counted & torch.isfinite(a_values)
    # (batch, positions) as log_ratio_stats takes them: a 1-D vector is one sequence.
    rows = (1, -1) if len(shape) == 1 else shape
    delta = (a_values - b_values).reshape(rows)
    stats = log_ratio_stats(delta, compared.reshape(rows), clip_eps=float(clip_eps))
    extra: dict[str, Any] = dataclasses.asdict(stats)
    if "ref_a" in values:
        extra.update(dataclasses.asdict(decomposition(a_values, b_values, values["ref_a"], values["ref_b"], compared)))
    record = Record.from_error(RECORD_NAME, RECORD_KIND, shape, error, **extra)
    return record, token_count


__all__ = ["Decomposition", "decomposition", "error_terms", "logprob_record"]
