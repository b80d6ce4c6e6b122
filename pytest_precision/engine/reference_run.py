"""The reference run: the fp32 model run once, its tensors kept (on the host past a size) for every variant,
its own noise measured, and the public `reference()`."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pytest_precision.base.dtypes import ModelFactory
from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.base.records import RunInfo
from pytest_precision.distributed import ranks as distributed
from pytest_precision.distributed.sharding import ShardedModel
from pytest_precision.engine.batch import to_batch
from pytest_precision.engine.capture import GRADIENT_KINDS, LOGITS_KIND, TensorKey, floating_tensors
from pytest_precision.engine.fingerprint import cache_key, state_checksum
from pytest_precision.engine.isolation import ambient_modes_off, comparison_device, preserved_rng
from pytest_precision.engine.losses import LossFn
from pytest_precision.engine.progress import ProgressCallback, RunProgress, checked_callback
from pytest_precision.engine.references import OFFLOAD_THRESHOLD_BYTES, Reference, ReferenceCache, qualified_name
from pytest_precision.engine.routers import ROUTING_KIND, Routers, checked_routers
from pytest_precision.engine.runner import Runner
from pytest_precision.engine.variant_pass import VariantPass, exact_if_needed, rms_rel_by_tensor
from pytest_precision.engine.variants import Variant, resolve_reference
from pytest_precision.numbers.logprobs import DEFAULT_CLIP_EPS
from pytest_precision.numbers.metrics import reference_sums, to_host

if TYPE_CHECKING:
    import torch
    from torch import nn


def check_model(model: object) -> None:
    from torch import nn

    if not isinstance(model, (nn.Module, ShardedModel)) and not callable(model):
        raise ConfigurationError(
            f"model: expected a torch.nn.Module or a factory (dtype, device) -> nn.Module, got {type(model).__name__}"
        )


def check_repeats(repeats: object) -> int:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigurationError(f"repeats must be an integer >= 1, got {repeats!r}")
    return repeats


def _default_offload(model: object, device: torch.device) -> bool:
    """Offload on CUDA when the model's parameters pass OFFLOAD_THRESHOLD_BYTES (a factory: never; a sharded
    model: by the size of the model it shards)."""
    from torch import nn

    if isinstance(model, ShardedModel):
        model = model.model
    if device.type != "cuda" or not isinstance(model, nn.Module):
        return False
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return size > OFFLOAD_THRESHOLD_BYTES


def new_runner(ref: Reference, repeats: int = 1) -> Runner:
    """A runner with the reference's settings (and module selection, once it ran)."""
    import torch

    assert ref.source is not None
    runner = Runner(
        ref.source,
        ref.batch,
        ref.device,
        ref.loss_fn,
        ref.backward,
        ref.modules,
        temperature=ref.temperature,
        clip_eps=ref.clip_eps,
        logprob_dtype=torch.float64 if ref.variant.dtype == "float64" else torch.float32,
        repeats=repeats,
        products=ref.products,
        positions=ref.positions,
        routers=ref.routers,
    )
    ref.positions = runner.positions  # worked out once per Reference
    if ref.module_names:
        runner.module_names = list(ref.module_names)
    return runner


@distributed.failures_shared()
def build_reference(
    model: nn.Module | ModelFactory | ShardedModel,
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
    checksum: bool = True,
    progress: ProgressCallback | None = None,
    progress_total: int = 1,
    routers: Routers | bool | None = None,
) -> Reference:
    """Run the reference and keep its tensors (see pytest_precision.reference); from `cache` when it holds
    this model, with the same parameter values, inputs and settings. Under torch.distributed, a failure on any
    rank fails every rank alike (see distributed.failures_shared). `progress`: see progress.py; the reference
    is run 1 of `progress_total` (a cache hit sends no event)."""
    from torch import nn

    check_model(model)
    progress = checked_callback(progress)
    selection = module_selection(modules)
    if temperature <= 0:
        raise ConfigurationError(f"temperature must be positive, got {temperature}")
    clip_eps = DEFAULT_CLIP_EPS if clip_eps is None else clip_eps
    if not 0 < clip_eps < 1:
        raise ConfigurationError(f"clip_eps must be in (0, 1), got {clip_eps}")
    reference_variant = resolve_reference(reference)
    routers = checked_routers(routers)
    batch = to_batch(inputs)
    unsharded = model.model if isinstance(model, ShardedModel) else model
    run_device = comparison_device(model, device)
    offload = _default_offload(model, run_device) if offload is None else bool(offload)
    if isinstance(unsharded, nn.Module):
        _warn_low_precision_weights(unsharded, reference_variant)
    if distributed.active():
        cache = None  # a hit on one rank and a miss on another would part the ranks' collectives
    keyed = None
    if cache is not None:
        keyed = cache_key(
            model,
            batch,
            reference_variant,
            loss_fn=loss_fn,
            backward=backward,
            modules=selection,
            device=run_device,
            temperature=temperature,
            clip_eps=clip_eps,
            offload=offload,
            routers=routers,
        )
        if keyed is None:
            cache.skipped += 1
        elif (hit := cache.get(keyed, model)) is not None:
            return hit
    ref = Reference(
        source=model,
        batch=batch,
        device=run_device,
        variant=reference_variant,
        loss_fn=loss_fn,
        backward=backward,
        modules=selection,
        module_names=[],
        temperature=temperature,
        clip_eps=clip_eps,
        info=None,  # type: ignore[arg-type]  # set below, once the reference ran
        stored={},
        offload=offload,
        # The checksum lets a kept Reference detect an in-place edit later; a throwaway one (compare() without a
        # cache) is used at once, so it skips that pass over every parameter.
        checksum=keyed.checksum
        if keyed is not None
        else (state_checksum(model) if checksum and isinstance(model, nn.Module) else None),
        loss_fn_name=None if loss_fn is None else qualified_name(loss_fn),
        routers=routers,
    )
    with preserved_rng(run_device), ambient_modes_off(run_device):
        runner = new_runner(ref)  # its targets and mask made outside the caller's inference mode too
        runner.progress = RunProgress(progress, reference_variant.name, "reference", 1, progress_total)
        ref.info, ref.max_gradient = _run_reference(runner, reference_variant, ref.stored, ref.sums, offload)
        runner.progress.done()
    if not backward:
        ref.max_gradient = None
    ref.module_names = list(runner.module_names or [])
    if cache is not None and keyed is not None:
        cache.put(keyed, model, ref)
    return ref


def module_selection(modules: Sequence[str] | str | None) -> tuple[str, ...] | None:
    """`modules` as a tuple of regexes: one string is one regex; an empty selection is refused."""
    if modules is None:
        return None
    selection = (modules,) if isinstance(modules, str) else tuple(modules)
    if not selection:
        raise ConfigurationError("modules: give at least one regex, or None for the default selection")
    wrong = [m for m in selection if not isinstance(m, str)]
    if wrong:
        raise ConfigurationError(
            f"modules: each item must be a regex string, got {type(wrong[0]).__name__} ({wrong[0]!r})"
        )
    return selection


class LowPrecisionReferenceWarning(UserWarning):
    """The reference model's weights are not fp32/fp64: its fp32 reference is only an upcast of them."""


def _warn_low_precision_weights(model: nn.Module, reference: Variant) -> None:
    import torch

    low = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for p in model.parameters()
            if p.is_floating_point() and p.dtype not in (torch.float32, torch.float64)
        }
    )
    if low:
        warnings.warn(
            f"{type(model).__name__} holds {'/'.join(low)} parameters: the {reference.name} reference is only an "
            f"upcast of {'/'.join(low)} weights, and the errors measure rounding from those weights, not from "
            "full-precision ones; pass the model in fp32 (or a factory loading it in each run's dtype)",
            LowPrecisionReferenceWarning,
            stacklevel=4,
        )


class _ReferenceKeeper:
    """The reference run's sink: keeps each tensor (see _run_reference) with its reference_sums, and each
    tensor's extremes, to check the run was finite and size fp16 loss scales, read once after the run."""

    def __init__(
        self,
        runner: Runner,
        stored: dict[TensorKey, torch.Tensor],
        sums: dict[TensorKey, torch.Tensor],
        *,
        offload: bool,
        clone_all: bool,
    ) -> None:
        self.runner = runner
        self.stored = stored
        self.sums = sums
        self.offload = offload
        self.clone_all = clone_all
        self.versions: dict[TensorKey, int] = {}
        #: The last tensor copied and its copy (held, so that its memory cannot be another tensor's meanwhile).
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None
        #: Whether this rank's own part of the reference held NaN/Inf (see check).
        self.local_nonfinite = False
        #: Per floating tensor, [min, max] over the whole tensor, on the device.
        self.extremes: list[tuple[str, torch.Tensor]] = []
        # A module returning its input as is (dropout in eval) hands over the run's own copy of the caller's
        # tensor (Batch.on), never the caller's storage: keeping it without a copy is safe.
        stored.clear()
        sums.clear()

    def __call__(self, name: str, kind: str, tensor: torch.Tensor) -> None:
        import torch

        kept = tensor.detach()
        # The logits are the head's fw row; a routing tensor's statistics are its own (numbers.routing).
        if kept.is_floating_point() and kept.numel() and kind not in (LOGITS_KIND, ROUTING_KIND):
            counted = self.runner.masked(name, kind, kept)
            values = self.sums[(name, kind)] = reference_sums(counted)  # on the device, before any offload
            whole = values[5:] if counted is kept else torch.stack(torch.aminmax(kept)).to(torch.float64)
            self.extremes.append((kind, whole))
        version = None if self.clone_all or self.offload else _version_of(kept)
        if version is None:
            # The head's output and the logits come one after the other and are one tensor: copied once.
            if self.last is not None and _same_view(self.last[0], kept):
                kept = self.last[1]
            else:
                self.last = (kept, _host_copy(kept) if self.offload else kept.clone())
                kept = self.last[1]
        else:
            self.versions[(name, kind)] = version
        self.stored[(name, kind)] = kept

    def check(self) -> tuple[list[str], float]:
        """The kinds holding NaN/Inf and the largest |gradient| over the bw and grad tensors, from one host
        transfer (which also waits for the offload copies)."""
        nonfinite: list[str] = []
        largest = 0.0
        for (kind, _), (low, high) in zip(self.extremes, to_host([v for _, v in self.extremes]), strict=True):
            if not (math.isfinite(low) and math.isfinite(high)):
                if kind not in nonfinite:
                    nonfinite.append(kind)
            elif kind in GRADIENT_KINDS:
                largest = max(largest, -low, high)
        # Parameter gradients are reduced over the ranks, so one rank's NaN reaches every rank's: the others say
        # whose own data went non-finite.
        self.local_nonfinite = any(kind != "grad" for kind in nonfinite)
        if self.runner.distributed:  # every rank must reach the same verdict on the reference
            everyone = distributed.exchange((nonfinite, largest))
            nonfinite = list(dict.fromkeys(kind for kinds, _ in everyone for kind in kinds))
            largest = max(value for _, value in everyone)
        return nonfinite, largest

    def untouched(self) -> bool:
        """Whether no tensor kept without a copy was written in place since it was kept."""
        return all(_version_of(self.stored[key]) == version for key, version in self.versions.items())


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same view of the same memory."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`; from an accelerator, a non-blocking copy into pinned memory (no sync here: the
    run's one transfer after it waits for every such copy)."""
    import torch

    if tensor.device.type == "cpu":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _run_reference(
    runner: Runner,
    variant: Variant,
    stored: dict[TensorKey, torch.Tensor],
    sums: dict[TensorKey, torch.Tensor],
    offload: bool,
) -> tuple[RunInfo, float]:
    """Run the reference, keeping its tensors in `stored` and their reference_sums in `sums`; returns its
    RunInfo and largest |gradient|.

    A later in-place op in the model must not change what was captured. Rather than cloning every tensor, each
    is kept as produced with its version counter; should any have been written in place by the end of the run
    (rare: in-place residual adds, gradient buffers reused by autograd), the run is repeated cloning every
    tensor. Views and tensors without a version counter (inference mode) are cloned at once; a module returning
    its input returns the run's own copy of it (Batch.on), never the caller's tensor. A reference producing
    NaN/Inf is a ModelRunError saying where they started.
    """
    keeper = _ReferenceKeeper(runner, stored, sums, offload=offload, clone_all=False)
    info = runner.run(variant, keeper)
    runner.phase("measure")
    nonfinite, largest = keeper.check()  # the run's one host sync
    if nonfinite:
        stored.clear()
        sums.clear()
        message = _nonfinite_reference(runner, variant, nonfinite)  # every rank reruns it: the same collectives
        if runner.distributed:  # one message on every rank: the diagnosis of the ranks whose part was not finite
            everyone = distributed.exchange(message if keeper.local_nonfinite else None)
            ranks = [index for index, said in enumerate(everyone) if said is not None]
            if ranks:
                message = f"on rank(s) {', '.join(map(str, ranks))}: {everyone[ranks[0]]}"
        raise ModelRunError(message)
    if not keeper.untouched():
        keeper = _ReferenceKeeper(runner, stored, sums, offload=offload, clone_all=True)
        info = runner.run(variant, keeper)
        runner.phase("measure")
        _, largest = keeper.check()
    return info, largest


def _nonfinite_reference(runner: Runner, variant: Variant, kinds: Sequence[str]) -> str:
    """Why the reference cannot be one: where its NaN/Inf started (a diagnostic rerun watching every module)."""
    import torch

    origin: dict[str, str] = {}
    # A failure of the watching hooks (full backward hooks refuse some in-place ops) only costs the diagnosis.
    with contextlib.suppress(Exception):
        runner.run(variant, lambda name, kind, tensor: None, origin=origin)
    where = origin.get(variant.name)
    if where is not None:
        started = f"NaN/Inf first appear in {where}"
    elif not all(bool(torch.isfinite(t).all()) for t in floating_tensors((runner.batch.args, runner.batch.kwargs))):
        started = "an input tensor is already NaN/Inf"
    else:
        started = "no module turned finite inputs into them (they started outside the modules)"
    if "loss" in kinds and "fw" not in kinds:
        started += (
            " (every module's output is finite but the loss is not: is every label -100 or masked out? a mean "
            "over no position is NaN)"
        )
    return (
        f"the {variant.name} reference is not finite: {started}; non-finite kinds: {', '.join(kinds)}; a "
        "reference must be finite to measure variants against it: fix the model or the inputs"
    )


def _version_of(tensor: torch.Tensor) -> int | None:
    """The version counter of a tensor that owns its whole storage, else None (keep a copy instead)."""
    if tensor._base is not None or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return None
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor tracks no version
        return None


def _is_module(model: object) -> bool:
    from torch import nn

    return isinstance(model, nn.Module)


def reference_noise(runner: Runner, ref: Reference, repeats: int) -> dict[TensorKey, float]:
    """Per tensor, the largest rms_rel of `repeats - 1` reference repeats against its first run (kept)."""
    if repeats <= 1:
        return {}
    if repeats not in ref.noise:
        if ref.path is not None and ref.info.variant.get("prepare"):
            raise ConfigurationError(
                f"repeats={repeats}: the Reference loaded from {ref.path} ran with prepare="
                f"{ref.info.variant['prepare']}, which cannot be restored; use repeats=1"
            )
        noise: dict[TensorKey, float] = {}
        for _ in range(repeats - 1):
            measured = VariantPass(runner, ref.variant, ref.tensors(), ref.sums, 1.0)
            runner.run(ref.variant, measured.measure)
            measured.resolve()
            _, measured = exact_if_needed(runner, measured)
            for key, value in rms_rel_by_tensor(measured.records).items():
                noise[key] = max(noise.get(key, 0.0), value)
        ref.noise[repeats] = noise
    return ref.noise[repeats]


def reference(
    model: nn.Module | ModelFactory | ShardedModel,
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
    progress: ProgressCallback | None = None,
    routers: Routers | bool | None = None,
) -> Reference:
    """Run the reference of `model` on `inputs` once; compare variants with `compare(ref, variants=[...])`.

    The arguments are compare's. offload: keep the captured tensors on the host, each moved to the device
    when compared (default: on CUDA when the model holds more than 1 GiB of parameters). progress: called with
    the reference run's ProgressEvents (see pytest_precision.engine.progress).
    """
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
        progress=progress,
        routers=routers,
    )
