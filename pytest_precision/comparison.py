"""Run the reference and each variant, streaming every captured variant tensor into its metrics."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .backend_flags import flags_to_dict, pinned_backend
from .batch import Batch, apply_mask, to_batch
from .capture import capture, select_modules
from .errors import ConfigurationError, ModelRunError, PrecisionError
from .metrics import tensor_error
from .model_build import ModelFactory, build_run_model
from .report import PrecisionReport, Record, RunInfo
from .variants import Variant, resolve_reference, resolve_variants, torch_dtype

if TYPE_CHECKING:
    import torch
    from torch import nn

LossFn = Callable[[Any, Any], "torch.Tensor"]
TensorKey = tuple[str, str]

#: Seed set before every run, on every device, so randomness cannot masquerade as precision error.
RUN_SEED = 0


def default_device(model: object) -> torch.device:
    """The device of the model's first parameter, or the CPU for a factory."""
    import torch
    from torch import nn

    if isinstance(model, nn.Module):
        for parameter in model.parameters():
            return parameter.device
    return torch.device("cpu")


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore torch's (CPU and the run's device), Python's and NumPy's global RNG state on exit."""
    import numpy as np
    import torch

    python_state = random.getstate()
    numpy_state = np.random.get_state()
    devices = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def seed_run(device: torch.device) -> None:
    """Seed the CPU generator and the run's own device only: torch.manual_seed would also reseed every
    CUDA device (or queue that until CUDA starts), which preserved_rng does not restore."""
    import torch

    torch.default_generator.manual_seed(RUN_SEED)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(RUN_SEED)


def _loss_of(output: Any, inputs: Any, loss_fn: LossFn | None, variant: str) -> torch.Tensor | None:
    import torch

    loss: Any
    if loss_fn is not None:
        loss = loss_fn(output, inputs)
    else:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        return None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigurationError(
            f"run {variant!r}: the loss must be a scalar tensor, got {shape}; reduce it in loss_fn (e.g. .mean())"
        )
    return loss.reshape(())


def _dtype_counts(tensors: Iterator[torch.Tensor]) -> dict[str, int]:
    counts = Counter(str(t.dtype).removeprefix("torch.") for t in tensors)
    return dict(sorted(counts.items()))


class _Runner:
    """Everything shared by the runs of one comparison."""

    def __init__(
        self,
        source: nn.Module | ModelFactory,
        batch: Batch,
        device: torch.device,
        loss_fn: LossFn | None,
        backward: bool,
        modules: Sequence[str] | None,
    ) -> None:
        self.source = source
        self.batch = batch
        self.device = device
        self.loss_fn = loss_fn
        self.backward = backward
        self.modules = modules
        self.module_names: list[str] | None = None
        self.mask = batch.mask(device)

    def run(self, variant: Variant, sink: Callable[[str, str, torch.Tensor], None]) -> RunInfo:
        import torch

        with pinned_backend(variant, self.device.type) as flags:
            model = build_run_model(self.source, variant, self.device)
            if self.module_names is None:
                self.module_names = select_modules(model, self.modules)
            float_dtype = torch_dtype(variant.weight_dtype)
            args, kwargs = self.batch.on(self.device, float_dtype)
            call_inputs: Any = kwargs if not args else (args[0] if len(args) == 1 else args)
            seed_run(self.device)
            autocast = torch.autocast(
                device_type=self.device.type, dtype=torch_dtype(variant.dtype), enabled=variant.autocast
            )
            with capture(model, self.module_names, sink, backward=self.backward):
                with torch.set_grad_enabled(self.backward), autocast:
                    try:
                        output = model(*args, **kwargs)
                    except PrecisionError:
                        raise
                    except Exception as error:
                        raise ModelRunError(
                            f"run {variant.name!r}: {type(model).__name__} rejected the inputs "
                            f"{self.batch.shapes()}: {type(error).__name__}: {error}"
                        ) from error
                loss = _loss_of(output, call_inputs, self.loss_fn, variant.name)
                if loss is not None:
                    sink("loss", "loss", loss.detach())
                if self.backward:
                    if loss is None:
                        raise ConfigurationError(
                            f"run {variant.name!r}: backward=True needs a loss: the model's output has no "
                            "`.loss`; pass loss_fn=lambda output, inputs: ... or backward=False"
                        )
                    if not loss.requires_grad:
                        raise ConfigurationError(
                            f"run {variant.name!r}: the loss does not require grad (no parameter requires "
                            "grad?); pass backward=False to compare forward tensors only"
                        )
                    loss.backward()  # type: ignore[no-untyped-call]
            info = RunInfo(
                variant=variant.to_dict(),
                parameter_dtypes=_dtype_counts(model.parameters()),
                buffer_dtypes=_dtype_counts(b for b in model.buffers() if b.is_floating_point()),
                input_shapes=self.batch.shapes(),
                token_count=self.batch.token_count(),
                backend=flags_to_dict(flags),
            )
            del model, output, loss
        return info

    def masked(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        return apply_mask(tensor, self.mask) if kind in ("fw", "bw") else tensor


def _measure_variant(
    runner: _Runner, variant: Variant, stored: Mapping[TensorKey, torch.Tensor]
) -> tuple[RunInfo, list[Record]]:
    """Run `variant`, comparing each tensor to the reference as soon as it is produced (none is kept)."""
    records: list[Record] = []

    def measure(name: str, kind: str, tensor: torch.Tensor) -> None:
        expected = stored.get((name, kind))
        if expected is None:
            raise ModelRunError(
                f"run {variant.name!r} produced {kind} tensor {name!r} that the reference run did "
                "not: the variant changed the model's structure"
            )
        if tuple(tensor.shape) != tuple(expected.shape):
            raise ModelRunError(
                f"run {variant.name!r}: {kind} tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the reference's is {tuple(expected.shape)}"
            )
        error = tensor_error(runner.masked(kind, expected), runner.masked(kind, tensor.detach()))
        records.append(Record.from_error(name, kind, tuple(tensor.shape), error))

    return runner.run(variant, measure), records


def compare(
    model: nn.Module | ModelFactory,
    inputs: Any,
    variants: Sequence[str | Variant | Mapping[str, Any]] | str | Variant,
    *,
    reference: str | Variant = "fp32",
    loss_fn: LossFn | None = None,
    backward: bool = True,
    modules: Sequence[str] | None = None,
    device: str | torch.device | None = None,
) -> PrecisionReport:
    """Measure each variant's per-tensor error against an fp32 (or fp64) reference run of `model`.

    model: an nn.Module (never modified: each run uses a copy) or a factory `(dtype, device) -> nn.Module`.
    inputs: a dict of keyword arguments, a tensor, or a tuple of positional arguments.
    loss_fn: `loss_fn(output, inputs) -> scalar`; default `output.loss`.
    modules: full-match regexes of module names to capture; default: embedding, blocks, final norm, head.
    """
    import torch
    from torch import nn

    if not isinstance(model, nn.Module) and not callable(model):
        raise ConfigurationError(
            f"model: expected a torch.nn.Module or a factory (dtype, device) -> nn.Module, got {type(model).__name__}"
        )
    reference_variant = resolve_reference(reference)
    variant_list = resolve_variants(variants)
    run_device = torch.device(device) if device is not None else default_device(model)
    runner = _Runner(model, to_batch(inputs), run_device, loss_fn, backward, modules)

    with preserved_rng(run_device):
        stored: dict[TensorKey, torch.Tensor] = {}

        def keep(name: str, kind: str, tensor: torch.Tensor) -> None:
            # Cloned: a later in-place op in the model must not change what was captured.
            stored[(name, kind)] = tensor.detach().clone()

        report = PrecisionReport(reference=runner.run(reference_variant, keep), device=str(run_device))
        for variant in variant_list:
            info, records = _measure_variant(runner, variant, stored)
            seen = {(r.name, r.kind) for r in records}
            report.add(variant.name, info, records, [key for key in stored if key not in seen])
        stored.clear()
    return report
