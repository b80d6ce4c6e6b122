"""Run the reference and each variant, streaming every captured variant tensor into its metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import distributed, isolated
from .arrangements import Arrangement, Assembler, run_calls, token_grid
from .backend_flags import flags_to_dict, pinned_backend
from .batch import Batch, to_batch
from .capture import NonfiniteTrace, capture, floating_tensors, select_modules, trace_nonfinite
from .errors import ConfigurationError, ModelRunError, PrecisionError
from .fingerprint import cache_key, state_checksum
from .isolation import ambient_modes_off, default_device, preserved_rng, seed_run
from .logprobs import (
    DEFAULT_CLIP_EPS,
    LOG_RATIO_MAXIMA,
    chosen_logprobs,
    distribution_from_sums,
    distribution_sums,
    log_ratio_from_sums,
    log_ratio_sums,
)
from .metrics import (
    TensorError,
    combine_range_sums,
    error_sums,
    exact_error,
    exact_sums,
    fast_error,
    fast_pass_applies,
    range_from_sums,
    range_sums,
    reference_sums,
    to_host,
)
from .model_build import FactoryProducts, ModelFactory, build_run_model, parameter_dtypes
from .positions import Positions, batch_positions, select_positions
from .progress import Phase, ProgressCallback, RunProgress, checked_callback
from .references import OFFLOAD_THRESHOLD_BYTES, Reference, ReferenceCache, qualified_name
from .report import PrecisionReport, Record, RunInfo
from .sharding import (
    Part,
    ShardedModel,
    add_vectors,
    combine_exact_sums,
    combined_shape,
    counted,
    is_dtensor,
    local_part,
    mesh_of,
    plain,
)
from .variants import Variant, resolve_reference, resolve_variants, torch_dtype

if TYPE_CHECKING:
    import torch
    from torch import nn

LossFn = Callable[[Any, Any], "torch.Tensor"]
Sink = Callable[[str, str, "torch.Tensor"], None]
TensorKey = tuple[str, str]


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


def parameter_categories(model: nn.Module) -> tuple[dict[str, str], bool | None]:
    """Parameter name -> category for the gradient summary, and whether the head is tied to the embedding."""
    from torch import nn

    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    head = get_output() if callable(get_output) else None
    tied = None
    if embedding is not None and head is not None:
        tied = getattr(head, "weight", None) is getattr(embedding, "weight", object())
    names = dict(model.named_parameters())
    categories: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for parameter_name, parameter in module.named_parameters(recurse=False):
            full = f"{module_name}.{parameter_name}" if module_name else parameter_name
            if full not in names:
                continue  # a tied parameter, reported under its first name
            if module is head:
                category = "lm_head"
            elif module is embedding or isinstance(module, nn.Embedding):
                category = "embedding"
            elif parameter_name == "bias":
                category = "bias"
            elif "norm" in type(module).__name__.lower():
                category = "norm"
            elif parameter.dim() >= 2:
                category = "linear"
            else:
                category = "other"
            categories[full] = category
    return categories, tied


def rank_average(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (a sharded parameter's gradient, already reduced by FSDP2 or tensor parallelism) as is; a plain
    tensor averaged over the ranks, as DDP does with gradients: each rank holds the gradient of its own rows."""
    import torch.distributed as dist

    if is_dtensor(tensor):
        return tensor
    averaged = tensor.detach().clone()
    dist.all_reduce(averaged, op=dist.ReduceOp.SUM)
    return averaged.div_(dist.get_world_size())


def _is_causal_lm(model: nn.Module) -> bool:
    """Whether next-token log-probabilities mean something: a transformers model that can generate (not a
    masked LM or a classifier); any other model returning `.logits` is taken at its word."""
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else True


def _logits_of(output: Any) -> torch.Tensor | None:
    """The (batch, positions, vocabulary) logits of a model output; a DTensor's gathered whole."""
    import torch

    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return plain(logits) if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None


def fp16_loss_scale(max_gradient: float) -> float:
    """The largest power of two keeping fp16 gradients in range with 4x headroom for unlogged partial sums."""
    if max_gradient <= 0 or not math.isfinite(max_gradient):
        return 1.0
    return float(2 ** max(0, math.floor(math.log2(FP16_MAX / max_gradient / 4))))


FP16_MAX = 65504.0
#: A TypeError about the call's arguments (wrong keyword, missing or extra positional argument).
_ARGUMENT_ERROR = re.compile(r"argument|positional|keyword")
GRADIENT_KINDS = ("bw", "grad")
#: compare(weight_cast=True): each parameter as the variant holds it, against the reference's.
WEIGHT_KIND = "weight_cast"
#: Kinds without range statistics: scalars and per-token log-probabilities, not tensors a dtype holds.
NO_RANGE_KINDS = ("logprob", "loss")
#: Internal kind: the reference's logits, kept to compare whole next-token distributions.
LOGITS_KIND = "logits"


class _Runner:
    """Everything shared by the runs of one comparison."""

    def __init__(
        self,
        source: nn.Module | ModelFactory | ShardedModel,
        batch: Batch,
        device: torch.device,
        loss_fn: LossFn | None,
        backward: bool,
        modules: Sequence[str] | None,
        *,
        temperature: float,
        clip_eps: float,
        logprob_dtype: torch.dtype,
        repeats: int = 1,
        products: FactoryProducts | None = None,
        positions: Positions | None = None,
    ) -> None:
        self.source = source
        self.products = FactoryProducts() if products is None else products
        self.repeats = repeats
        self.batch = batch
        self.device = device
        self.loss_fn = loss_fn
        self.backward = backward
        self.modules = modules
        self.module_names: list[str] | None = None
        self.positions = batch_positions(batch, device) if positions is None else positions
        self.temperature = temperature
        self.clip_eps = clip_eps
        self.logprob_dtype = logprob_dtype
        #: Under torch.distributed: each rank's part of every tensor (see sharding), the mesh, and rank 0's
        #: input shapes and counted tokens (what every rank's RunInfo says, so that the reports agree).
        self.distributed = distributed.active()
        self.parts: dict[TensorKey, Part] = {}
        self.mesh: dict[str, Any] = {}
        self.inputs_described = (self.batch.shapes(), self.positions.token_count)
        #: Whether every rank got the same inputs (tensor parallelism) rather than its own rows (data parallel).
        self.same_inputs = True
        #: Set by measure: stream every floating parameter as a "weight_cast" row after building a run's model (not in
        #: isolated or recording runs), and give records range statistics (see metrics.RangeStats).
        self.weight_cast = False
        self.range_stats = False
        #: The events of the run being made (see progress.py); None: none are sent.
        self.progress: RunProgress | None = None
        if self.distributed:
            everyone = distributed.exchange((self.inputs_described, self.batch.digest()))
            self.inputs_described = everyone[0][0]
            self.same_inputs = all(digest == everyone[0][1] for _, digest in everyone)

    @property
    def targets(self) -> torch.Tensor | None:
        return self.positions.targets

    @property
    def valid(self) -> torch.Tensor | None:
        return self.positions.valid

    def phase(self, phase: Phase) -> None:
        """Tell the progress callback, if any, that the current run starts `phase`."""
        if self.progress is not None:
            self.progress.phase(phase)

    def run(
        self,
        variant: Variant,
        sink: Sink,
        loss_scale: float = 1.0,
        *,
        origin: dict[str, str] | None = None,
        isolation: isolated.Recorded | None = None,
        recording: isolated.Recorded | None = None,
    ) -> RunInfo:
        """One run of `variant`, streaming its tensors to `sink`; the loss is multiplied by `loss_scale`.

        With `origin`, every module is watched for the first NaN/Inf and `origin[variant.name]` is set to
        where it appeared (see capture.trace_nonfinite), when it did. With `isolation` (what a reference run
        recorded), the run is isolated (see isolated.py): only fw, bw and grad rows of the selected modules
        reach `sink`, as kinds "fw_isolated", ... With `recording`, the isolation boundaries' inputs and output
        gradients are recorded into it.
        """
        import torch

        with ambient_modes_off(self.device), pinned_backend(variant, self.device.type) as flags:
            self.phase("build")
            model = build_run_model(self.source, variant, self.device, self.products)
            if self.module_names is None:
                self.module_names = select_modules(model, self.modules)
            float_dtype = torch_dtype(variant.weight_dtype)
            args, kwargs = self.batch.on(self.device, float_dtype)
            call_inputs: Any = kwargs if not args else (args[0] if len(args) == 1 else args)
            seed_run(self.device)
            autocast = self._autocast(variant)
            watch: contextlib.AbstractContextManager[NonfiniteTrace | None] = contextlib.nullcontext()
            if origin is not None:
                watch = trace_nonfinite(model, backward=self.backward)
            if self.distributed:
                sink = self._localized(sink)
                self.mesh = mesh_of(model)
            if self.weight_cast and isolation is None and recording is None:
                for parameter_name, parameter in model.named_parameters():  # tied ones once
                    if parameter.is_floating_point():
                        sink(parameter_name, WEIGHT_KIND, parameter.detach())
            self.phase("forward")
            if isolation is not None:
                return self._run_isolated(model, variant, sink, loss_scale, isolation, (args, kwargs), flags)
            if variant.arrangement is not None:
                return self._run_arranged(model, variant, sink, call_inputs, flags, origin)
            if recording is not None:
                recorder: contextlib.AbstractContextManager[Any] = isolated.record(
                    model, isolated.boundaries(self.module_names), backward=self.backward, into=recording
                )
            else:
                recorder = contextlib.nullcontext()
            # Sharded parameters get their gradients after the reduce-scatter, outside autograd's accumulation:
            # under torch.distributed they are read once backward returned.
            hooked_grads = not self.distributed
            with (
                watch as trace,
                recorder,
                capture(model, self.module_names, sink, backward=self.backward, parameter_grads=hooked_grads),
            ):
                with torch.set_grad_enabled(self.backward), autocast:
                    try:
                        output = model(*args, **kwargs)
                    except PrecisionError:
                        raise
                    except Exception as error:
                        raise ModelRunError(self._failure(model, variant, error, "forward")) from error
                self._log_probabilities(model, output, sink)
                loss = _loss_of(output, call_inputs, self.loss_fn, variant.name)
                if loss is not None:
                    sink("loss", "loss", plain(loss).detach())  # under torch.distributed: each rank's loss
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
                    self.phase("backward")
                    try:
                        (loss * loss_scale if loss_scale != 1 else loss).backward()  # type: ignore[no-untyped-call]
                    except PrecisionError:
                        raise
                    except Exception as error:
                        raise ModelRunError(self._failure(model, variant, error, "backward")) from error
                    if not hooked_grads:
                        # Every rank got this far (else its error ends the wait here), before the collectives.
                        distributed.exchange(None)
                        for parameter_name, parameter in model.named_parameters():
                            if parameter.requires_grad and parameter.grad is not None:
                                sink(parameter_name, "grad", rank_average(parameter.grad))
            if trace is not None and (where := trace.origin()) is not None:
                assert origin is not None
                origin[variant.name] = where
            info = self._info(model, variant, flags)
            del model, output, loss
        return info

    def _autocast(self, variant: Variant) -> torch.autocast:
        """The variant's torch.autocast on the run's device (disabled unless variant.autocast)."""
        import torch

        return torch.autocast(device_type=self.device.type, dtype=torch_dtype(variant.dtype), enabled=variant.autocast)

    def _info(self, model: nn.Module, variant: Variant, flags: Any) -> RunInfo:
        categories, tied = parameter_categories(model)
        return RunInfo(
            variant=variant.to_dict(),
            parameter_dtypes=_dtype_counts(model.parameters()),
            buffer_dtypes=_dtype_counts(b for b in model.buffers() if b.is_floating_point()),
            input_shapes=self.inputs_described[0],
            token_count=self.inputs_described[1],
            backend=flags_to_dict(flags),
            parameter_categories=categories,
            tied_head=tied,
            repeats=self.repeats,
        )

    def _run_arranged(
        self,
        model: nn.Module,
        variant: Variant,
        sink: Sink,
        inputs: Any,
        flags: Any,
        origin: dict[str, str] | None = None,
    ) -> RunInfo:
        """The forward of `variant` as its arrangement computes it (see arrangements.py), each call's tensors
        reassembled into the reference's layout and streamed to `sink`: fw rows, the logits and log-probs (with
        `origin`, where NaN/Inf first appeared, as in run)."""

        arrangement = variant.arrangement
        assert isinstance(arrangement, Arrangement) and self.module_names is not None
        if self.distributed:
            raise ConfigurationError(
                f"variant {variant.name!r}: arrangements run in one process, not under torch.distributed"
            )
        assembler = Assembler(arrangement.name, *token_grid(self.batch, variant.name, arrangement.name))
        autocast = self._autocast(variant)
        watch: contextlib.AbstractContextManager[NonfiniteTrace | None] = contextlib.nullcontext()
        if origin is not None:
            watch = trace_nonfinite(model, backward=False)
        with watch as trace, capture(model, self.module_names, assembler, backward=False) as counts, autocast:
            run_calls(model, arrangement, inputs, assembler, counts, variant=variant.name, logits_of=_logits_of)
        if trace is not None and (where := trace.origin()) is not None:
            assert origin is not None
            origin[variant.name] = where
        positions = self.positions
        counted = positions.index
        tensors = assembler.tensors(counted, positions.logits_index)
        logits = tensors.pop(("logits", LOGITS_KIND), None)
        for (name, kind), tensor in tensors.items():
            sink(name, kind, tensor)
        if logits is not None:
            self._log_probabilities(model, {"logits": logits}, sink)
        return self._info(model, variant, flags)

    def _run_isolated(
        self,
        model: nn.Module,
        variant: Variant,
        sink: Sink,
        loss_scale: float,
        recorded: isolated.Recorded,
        call: tuple[tuple[Any, ...], dict[str, Any]],
        flags: Any,
    ) -> RunInfo:
        """The isolated run of `variant` (see isolated.py), its rows streamed to `sink` as isolated kinds."""
        import torch

        assert self.module_names is not None
        boundary_names = isolated.boundaries(self.module_names)
        owned = isolated.owned_parameters(model, boundary_names)

        def isolated_sink(name: str, kind: str, tensor: torch.Tensor) -> None:
            if kind in ("fw", "bw") or (kind == "grad" and name in owned):
                sink(name, isolated.isolated_kind(kind), tensor)

        args, kwargs = call
        autocast = self._autocast(variant)
        with (
            isolated.isolate(model, boundary_names, recorded, scale=loss_scale, variant=variant.name) as run,
            capture(model, self.module_names, isolated_sink, backward=self.backward),
        ):
            with torch.set_grad_enabled(self.backward), autocast:
                try:
                    model(*args, **kwargs)
                except PrecisionError:
                    raise
                except Exception as error:
                    raise ModelRunError(self._failure(model, variant, error, "isolated forward")) from error
            if self.backward:
                try:
                    run.backward()
                except Exception as error:
                    raise ModelRunError(self._failure(model, variant, error, "isolated backward")) from error
        info = self._info(model, variant, flags)
        del model
        return info

    def _localized(self, sink: Sink) -> Sink:
        """`sink` fed this rank's plain part of each tensor, noting how the part counts (sharding.Part)."""

        def localized(name: str, kind: str, tensor: torch.Tensor) -> None:
            local, part = local_part(tensor)
            self.parts[(name, kind)] = part
            sink(name, kind, local)

        return localized

    def global_sums(
        self, raw: list[_HostSums], distribution: list[float] | None, rows: int
    ) -> tuple[list[_HostSums], list[float] | None, int]:
        """The exact sums of the whole tensors from every rank's parts (one exchange), identical on every rank."""
        keys = [(item.name, item.kind) for item, *_ in raw]
        local = {
            "keys": keys,
            "sums": [values for _, _, values, _ in raw],
            "parts": [self.parts.get(key, Part(None, item.shape)) for key, (item, *_) in zip(keys, raw, strict=True)],
            "log_ratio": [log_ratio for *_, log_ratio in raw],
            "range": [item.range_host for item, *_ in raw],
            "distribution": None if distribution is None else (distribution, rows),
        }
        everyone = distributed.exchange(local)
        for index, other in enumerate(everyone):
            if other["keys"] != everyone[0]["keys"]:
                only = sorted(set(map(tuple, other["keys"])) ^ set(map(tuple, everyone[0]["keys"])))
                raise ModelRunError(
                    f"rank {index} captured other tensors than rank 0 ({', '.join(f'{n} ({k})' for n, k in only[:6])}"
                    "): every rank must run the same model on inputs of the same structure"
                )
        combined: list[_HostSums] = []
        for index, (item, _, _, log_ratio) in enumerate(raw):
            parts = [(other["sums"][index], other["parts"][index]) for other in everyone]
            chosen = counted(parts)
            vector = combine_exact_sums([parts[r][0] for r in chosen])
            shape = combined_shape([parts[r][1] for r in chosen], rows_split=not self.same_inputs)
            ratio = None
            if log_ratio is not None:
                ratio = add_vectors([everyone[r]["log_ratio"][index] for r in chosen], maximum=LOG_RATIO_MAXIMA)
            ranges = None
            if item.range_host is not None:
                ranges = combine_range_sums([everyone[r]["range"][index] for r in chosen])
            combined.append((dataclasses.replace(item, shape=shape, range_host=ranges), None, vector, ratio))
        seen: set[str] = set()
        kept: list[tuple[list[float], int]] = []
        for sent in everyone:
            if sent["distribution"] is not None and repr(sent["distribution"]) not in seen:
                seen.add(repr(sent["distribution"]))
                kept.append(sent["distribution"])
        if not kept:
            return combined, None, 0
        return combined, add_vectors([values for values, _ in kept], maximum=(1,)), sum(count for _, count in kept)

    def _failure(self, model: nn.Module, variant: Variant, error: Exception, phase: str) -> str:
        """What went wrong in a run: the inputs' keys are blamed only for a TypeError about arguments."""
        name = type(model).__name__
        if phase == "forward" and isinstance(error, TypeError) and _ARGUMENT_ERROR.search(str(error)):
            return (
                f"run {variant.name!r}: {name} rejected the inputs {self.batch.shapes()}: {type(error).__name__}: "
                f"{error} (check that the inputs' keys match forward()'s arguments, and their shapes, dtypes and "
                "token ids what it expects)"
            )
        hint = ""
        if phase == "forward" and isinstance(error, IndexError):
            hint = "; an index out of range: are the token ids below the model's vocabulary size?"
        return (
            f"{name} raised {type(error).__name__}: {error} in {phase} of run {variant.name!r} "
            f"(inputs {self.batch.shapes()}){hint}"
        )

    def _log_probabilities(self, model: nn.Module, output: Any, sink: Sink) -> None:
        """For a causal LM: the gradient at the logits (bw), the logits, and the chosen-token log-probs."""
        logits = _logits_of(output)
        if (
            logits is None
            or self.targets is None
            or not self.targets.numel()  # sequences of length 1: no position predicts a next token
            or not _is_causal_lm(model)
            or tuple(logits.shape[:2]) != (self.targets.shape[0], self.targets.shape[1] + 1)
            or self.positions.targets_max >= logits.shape[-1]  # logits over tags or classes, not the vocabulary
        ):
            return
        if self.backward and logits.requires_grad:
            logits.register_hook(lambda grad: sink("logits", "bw", grad))  # type: ignore[no-untyped-call]
        sink("logits", LOGITS_KIND, logits.detach())
        logprobs = chosen_logprobs(
            logits.detach(), self.targets, temperature=self.temperature, dtype=self.logprob_dtype
        )
        sink("logprob", "logprob", logprobs)

    def masked(self, name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """The positions of `tensor` that count for its metrics (an index_select: no host sync)."""
        positions = self.positions
        if kind == "logprob":
            return select_positions(tensor, _shape(positions.valid), positions.valid_index)
        if kind == "bw" and name == "logits" and positions.valid is not None:
            # The loss's gradient at logits[t] is non-zero exactly where target t (token t + 1) counts.
            rows, length = positions.valid.shape
            return select_positions(tensor, (rows, length + 1), positions.logits_index)
        return select_positions(tensor, positions.shape, positions.index) if kind in ("fw", "bw") else tensor


def compute_dtype(variant: Variant) -> torch.dtype:
    """The dtype `variant` computes in, which its range statistics count in: its FSDP2 param_dtype when set, else
    its dtype (for an autocast variant, the autocast dtype; fp32_modules are not told apart)."""
    return torch_dtype(variant.param_dtype or variant.dtype)


class _WithWeights(Mapping[TensorKey, "torch.Tensor"]):
    """The reference's captured tensors and its parameters' weight rows, each looked up where it is kept (an
    offloaded reference's tensors move to the device one at a time, when looked up)."""

    def __init__(self, tensors: Mapping[TensorKey, torch.Tensor], weights: Mapping[TensorKey, torch.Tensor]) -> None:
        self.tensors = tensors
        self.weights = weights

    def __getitem__(self, key: TensorKey) -> torch.Tensor:
        return self.weights[key] if key in self.weights else self.tensors[key]

    def __iter__(self) -> Iterator[TensorKey]:
        yield from self.tensors
        yield from (key for key in self.weights if key not in self.tensors)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def reference_weights(ref: Reference) -> dict[TensorKey, torch.Tensor]:
    """The reference's floating parameters by (name, "weight_cast"), on its device, as the reference run held them:
    a model's own parameters cast to the reference dtype (no copy when they already are), or, for a factory or
    a reference with `prepare`, those of a reference model built as its run built it (no forward)."""
    from torch import nn

    source = ref.source
    if isinstance(source, nn.Module) and ref.variant.prepare is None:
        wanted = parameter_dtypes(source, ref.variant.weight_dtype)
        return {
            (name, WEIGHT_KIND): parameter.detach().to(device=ref.device, dtype=wanted[name])
            for name, parameter in source.named_parameters()
            if name in wanted
        }
    assert source is not None and not isinstance(source, ShardedModel)
    model = build_run_model(source, ref.variant, ref.device, ref.products)
    return {
        (name, WEIGHT_KIND): parameter.detach()
        for name, parameter in model.named_parameters()
        if parameter.is_floating_point()
    }


def _check_flag(value: object, argument: str) -> bool:
    """A True/False option, or a ConfigurationError naming it."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{argument} must be True or False, got {value!r}")
    return value


def _shape(tensor: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(tensor.shape)


class LargestGradient:
    """A sink keeping the largest finite |gradient| over the bw and grad tensors it sees, on their device
    (read once, at the end: no host sync per tensor)."""

    def __init__(self) -> None:
        self.largest: torch.Tensor | None = None

    def __call__(self, name: str, kind: str, tensor: torch.Tensor) -> None:
        import torch

        if kind not in GRADIENT_KINDS or not tensor.numel():
            return
        magnitude = tensor.detach().abs().nan_to_num(nan=0.0, posinf=0.0).amax().to(torch.float64)
        self.largest = magnitude if self.largest is None else torch.maximum(self.largest, magnitude)

    def value(self) -> float:
        """The largest |gradient| seen (over every rank under torch.distributed)."""
        largest = 0.0 if self.largest is None else float(self.largest)
        return max(distributed.exchange(largest)) if distributed.active() else largest


def _calibrate_loss_scale(runner: _Runner, variant: Variant) -> float:
    """Run `variant` unscaled and size the loss scale from its largest finite gradient (loss_scale="calibrate")."""
    probe = LargestGradient()
    runner.run(variant, probe)
    return fp16_loss_scale(probe.value())


def reference_max_gradient(ref: Reference) -> float:
    """The reference's largest finite |gradient| over its bw and grad tensors: the default fp16 loss scale's
    measure (the fp16 variant computes the same gradients, rounded), computed once per Reference."""
    if ref.max_gradient is None:
        probe = LargestGradient()
        for (name, kind), tensor in ref.tensors().items():
            probe(name, kind, tensor)
        ref.max_gradient = probe.value()
    return ref.max_gradient


@dataclasses.dataclass
class _Pending:
    """One measured tensor whose statistics are still on the device."""

    name: str
    kind: str
    shape: tuple[int, ...]
    count: int
    reference: torch.Tensor | None  # reference_sums (fast pass), None for the exact pass
    values: torch.Tensor  # error_sums or exact_sums
    log_ratio: torch.Tensor | None = None
    range_values: torch.Tensor | None = None  # range_sums (compare(range_stats=True))
    range_host: list[float] | None = None  # their host copy, once resolved


#: A _Pending's statistics on the host: (item, reference_sums or None, error_sums or exact_sums, log_ratio_sums).
_HostSums = tuple[_Pending, list[float] | None, list[float], list[float] | None]


def resolve_pending(values: Sequence[torch.Tensor]) -> list[list[float]]:
    """The device-side statistics of a whole pass on the host: its one device-to-host transfer."""
    return to_host(values)


class _VariantPass:
    """One pass of a variant: each tensor is compared to the reference when produced, then dropped; its
    statistics stay on the device until `resolve`, after the run, copies all of them to the host at once.

    The fast pass (float32 sums, see metrics.py) assumes finite values; when a tensor turns out to hold NaN/Inf
    (`needs_exact`), the caller runs the variant again with `exact=True`.
    """

    def __init__(
        self,
        runner: _Runner,
        variant: Variant,
        stored: Mapping[TensorKey, torch.Tensor],
        sums: dict[TensorKey, torch.Tensor],
        scale: float,
        *,
        exact: bool = False,
    ) -> None:
        self.runner = runner
        self.variant = variant
        self.stored = stored
        self.sums = sums
        self.scale = scale
        self.exact = exact
        self.pending: list[_Pending] = []
        self.distribution: torch.Tensor | None = None
        self.records: list[Record] = []
        self.overflowed = False
        self.needs_exact = False
        #: The variant's chosen-token log-probabilities (batch, seq - 1), float64, when the model has them.
        self.logprobs: torch.Tensor | None = None
        #: The dtype range statistics are counted in (None: compare(range_stats=False)).
        self.range_dtype = compute_dtype(variant) if runner.range_stats else None

    def measure(self, name: str, kind: str, tensor: torch.Tensor) -> None:
        import torch

        runner, variant = self.runner, self.variant
        record_kind, kind = kind, isolated.base_kind(kind)  # an isolated row is measured against its propagated one
        expected = self.stored.get((name, kind))
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
        obtained = tensor.detach()
        positions = runner.positions
        if kind == LOGITS_KIND:
            assert positions.logits_index is not None
            self.distribution = distribution_sums(
                expected, obtained, positions.logits_index, temperature=runner.temperature
            )
            return
        reference = runner.masked(name, kind, expected)
        variant_values = runner.masked(name, kind, obtained)
        scale = self.scale if kind in GRADIENT_KINDS else 1.0
        reference_values = None
        if self.exact or runner.distributed or not fast_pass_applies(reference, variant_values):
            values = exact_sums(reference, variant_values, variant_scale=scale)
        else:
            reference_values = self.sums.get((name, kind))
            if reference_values is None:  # a loaded Reference: computed on first need, then shared
                reference_values = self.sums[(name, kind)] = reference_sums(reference)
            values = error_sums(reference, variant_values, reference_values, variant_scale=scale)
        log_ratio = None
        if kind == "logprob":
            assert positions.valid is not None
            self.logprobs = obtained.to(torch.float64)
            delta = self.logprobs - expected.to(torch.float64)
            log_ratio = log_ratio_sums(delta, positions.valid, clip_eps=runner.clip_eps)
        range_values = None
        if self.range_dtype is not None and kind not in NO_RANGE_KINDS:
            # The values the variant holds: a loss-scaled gradient `scale` times the reference's.
            range_values = range_sums(reference, self.range_dtype, scale=scale)
        self.pending.append(
            _Pending(
                name,
                record_kind,
                tuple(tensor.shape),
                reference.numel(),
                reference_values,
                values,
                log_ratio,
                range_values,
            )
        )

    def resolve(self) -> None:
        """Copy every statistic of the pass to the host at once and build the records."""
        device_values: list[torch.Tensor] = []
        for item in self.pending:
            device_values += [
                v for v in (item.reference, item.values, item.log_ratio, item.range_values) if v is not None
            ]
        if self.distribution is not None:
            device_values.append(self.distribution)
        host = iter(resolve_pending(device_values))
        raw: list[_HostSums] = []
        for item in self.pending:
            reference = next(host) if item.reference is not None else None
            values = next(host)
            raw.append((item, reference, values, next(host) if item.log_ratio is not None else None))
            if item.range_values is not None:
                item.range_host = next(host)
                item.range_values = None
        distribution = next(host) if self.distribution is not None else None
        rows = self.runner.positions.logits_index
        row_count = 0 if rows is None else int(rows.numel())
        self.pending.clear()
        if self.runner.distributed:
            raw, distribution, row_count = self.runner.global_sums(raw, distribution, row_count)
        results: list[tuple[_Pending, TensorError | None, list[float] | None]] = []
        for item, reference, values, log_ratio in raw:
            error = exact_error(values) if reference is None else fast_error(item.count, reference, values)
            results.append((item, error, log_ratio))
        self.needs_exact = any(error is None for _, error, _ in results)
        self.overflowed = any(
            error is None or error.nonfinite for item, error, _ in results if item.kind in GRADIENT_KINDS
        )
        if self.needs_exact:
            return
        for item, error, log_ratio in results:
            assert error is not None
            extra: dict[str, Any] = {}
            if item.range_host is not None:
                extra = dataclasses.asdict(range_from_sums(item.range_host))
            if log_ratio is not None:
                extra |= dataclasses.asdict(log_ratio_from_sums(log_ratio))
                if distribution is not None:
                    extra |= dataclasses.asdict(distribution_from_sums(distribution, row_count))
            self.records.append(Record.from_error(item.name, item.kind, item.shape, error, **extra))


def _exact_if_needed(
    runner: _Runner, measured: _VariantPass, isolation: isolated.Recorded | None = None
) -> tuple[RunInfo | None, _VariantPass]:
    """`measured` when its fast pass could be trusted, else the exact pass of the same run (the run again,
    isolated with `isolation`)."""
    if not measured.needs_exact:
        return None, measured
    exact = _VariantPass(runner, measured.variant, measured.stored, measured.sums, measured.scale, exact=True)
    info = runner.run(measured.variant, exact.measure, measured.scale, isolation=isolation)
    runner.phase("measure")
    exact.resolve()
    return info, exact


def _rms_rels(records: Sequence[Record]) -> dict[TensorKey, float]:
    """Each record's rms_rel, where defined and finite: all a repeat keeps of its pass."""
    return {(r.name, r.kind): r.rms_rel for r in records if r.rms_rel is not None and math.isfinite(r.rms_rel)}


def _with_spread(
    records: Sequence[Record], passes: Sequence[Mapping[TensorKey, float]], noise: Mapping[TensorKey, float]
) -> list[Record]:
    """`records` with `spread`: max - min of rms_rel over the variant's passes plus the reference's noise
    (None where no pass defines rms_rel)."""
    spread_records = []
    for record in records:
        key = (record.name, record.kind)
        seen = [values[key] for values in passes if key in values]
        spread = None if not seen else (max(seen) - min(seen)) + noise.get(key, 0.0)
        spread_records.append(dataclasses.replace(record, spread=spread))
    return spread_records


#: Kinds whose NaN/Inf trigger a diagnostic run to find where they started.
NONFINITE_KINDS = ("fw", "bw", "grad", "logprob", "loss")


def _measure_variant(
    runner: _Runner,
    variant: Variant,
    stored: Mapping[TensorKey, torch.Tensor],
    sums: dict[TensorKey, torch.Tensor],
    loss_scale: float | str | None,
    *,
    reference_gradient: Callable[[], float],
    repeats: int = 1,
    noise: Mapping[TensorKey, float] | None = None,
    origin: dict[str, str] | None = None,
    isolation: isolated.Recorded | None = None,
    logprobs: dict[str, torch.Tensor] | None = None,
) -> tuple[RunInfo, list[Record]]:
    """Run `variant` against the stored reference tensors.

    A variant computing in fp16 gets its loss scaled (fp16 gradients underflow without it): by `loss_scale`
    when it is a number; by a calibration pass of the variant itself when it is "calibrate"; else sized from
    `reference_gradient()`, the reference's largest |gradient|. The gradients are unscaled in float64 before
    comparison, and a scaled pass whose gradients overflow is retried at half the scale.

    With `repeats` > 1 the variant runs that many times at the first pass's loss scale; each record (the
    first pass's) gets its `spread` (see compare). With `origin`, a pass producing NaN/Inf is followed by a
    diagnostic run locating where they started, stored in `origin[variant.name]`. With `isolation` (what the
    reference recorded), an isolated pass at the same loss scale adds the "*_isolated" rows. With `logprobs`,
    the variant's chosen-token log-probabilities are kept in `logprobs[variant.name]`.
    """
    scaled = runner.backward and variant.dtype == "float16" and variant.arrangement is None
    scale = 1.0
    if scaled:
        if loss_scale == CALIBRATE:
            scale = _calibrate_loss_scale(runner, variant)
        elif loss_scale is None:
            scale = fp16_loss_scale(reference_gradient())
        else:
            scale = float(loss_scale)
    while True:
        measured = _VariantPass(runner, variant, stored, sums, scale)
        info = runner.run(variant, measured.measure, scale)
        runner.phase("measure")
        measured.resolve()
        if not (scaled and measured.overflowed and scale > 1):
            break
        scale /= 2
    exact_info, measured = _exact_if_needed(runner, measured)
    info = exact_info or info
    records = measured.records
    if logprobs is not None and measured.logprobs is not None and not runner.distributed:
        logprobs[variant.name] = measured.logprobs
    if origin is not None and any(r.nonfinite for r in records if r.kind in NONFINITE_KINDS):
        # A repeat of a run that succeeded: a failure here comes from the watching hooks (full backward
        # hooks refuse some in-place ops), and only costs the diagnosis, not the comparison.
        with contextlib.suppress(Exception):
            runner.run(variant, lambda name, kind, tensor: None, scale, origin=origin)
    if repeats > 1:
        passes = [_rms_rels(records)]
        for _ in range(repeats - 1):
            again = _VariantPass(runner, variant, stored, sums, scale)
            runner.run(variant, again.measure, scale)
            runner.phase("measure")
            again.resolve()
            _, again = _exact_if_needed(runner, again)
            passes.append(_rms_rels(again.records))
        records = _with_spread(records, passes, noise or {})
    if isolation is not None:  # once, after the repeats: isolated rows have no spread
        records = records + _isolated_records(runner, variant, stored, sums, scale, isolation)
    return (dataclasses.replace(info, loss_scale=scale) if scaled else info), records


def _isolated_records(
    runner: _Runner,
    variant: Variant,
    stored: Mapping[TensorKey, torch.Tensor],
    sums: dict[TensorKey, torch.Tensor],
    scale: float,
    recorded: isolated.Recorded,
) -> list[Record]:
    """The isolated pass of `variant` (see isolated.py): its fw/bw/grad rows as "*_isolated" kinds. A
    boundary's bw row is measured against the reference's gradient through that module alone (its input may
    have other uses, a residual around it, whose gradient the propagated bw row includes)."""
    own = {(label, "bw"): gradient for label, gradient in recorded.input_grads.items()}
    stored = {**stored, **own}
    sums = {key: value for key, value in sums.items() if key not in own}  # the others' are shared, unchanged
    measured = _VariantPass(runner, variant, stored, sums, scale)
    runner.run(variant, measured.measure, scale, isolation=recorded)
    runner.phase("measure")
    measured.resolve()
    _, measured = _exact_if_needed(runner, measured, recorded)
    return measured.records


def isolation_inputs(runner: _Runner, ref: Reference) -> isolated.Recorded:
    """What isolated runs feed each boundary module: recorded by one more run of the reference, kept on `ref`."""
    if ref.isolation is None:
        assert runner.module_names is not None
        isolated.check_isolatable(
            runner.module_names, distributed=runner.distributed, sharded=isinstance(ref.source, ShardedModel)
        )
        recorded = isolated.Recorded()
        runner.run(ref.variant, lambda name, kind, tensor: None, recording=recorded)
        ref.isolation = recorded
    return ref.isolation


#: loss_scale="calibrate": size each fp16 variant's scale by an unscaled pass of the variant itself.
CALIBRATE = "calibrate"
LossScale = float | str | Mapping[str, float | str] | None


def _loss_scale_for(loss_scale: LossScale, variant: str) -> float | str | None:
    """`variant`'s entry of `loss_scale`: a positive number, "calibrate", or None (from the reference)."""
    value = loss_scale.get(variant) if isinstance(loss_scale, Mapping) else loss_scale
    if value is None or value == CALIBRATE:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ConfigurationError(
            f"loss_scale for {variant!r} must be a positive number or {CALIBRATE!r}, got {value!r}"
        )
    return number


def _check_model(model: object) -> None:
    from torch import nn

    if not isinstance(model, (nn.Module, ShardedModel)) and not callable(model):
        raise ConfigurationError(
            f"model: expected a torch.nn.Module or a factory (dtype, device) -> nn.Module, got {type(model).__name__}"
        )


def _check_repeats(repeats: object) -> int:
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


def _runner(ref: Reference, repeats: int = 1) -> _Runner:
    """A runner with the reference's settings (and module selection, once it ran)."""
    import torch

    assert ref.source is not None
    runner = _Runner(
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
) -> Reference:
    """Run the reference and keep its tensors (see pytest_precision.reference); from `cache` when it holds
    this model, with the same parameter values, inputs and settings. Under torch.distributed, a failure on any
    rank fails every rank alike (see distributed.failures_shared). `progress`: see progress.py; the reference
    is run 1 of `progress_total` (a cache hit sends no event)."""
    import torch
    from torch import nn

    _check_model(model)
    progress = checked_callback(progress)
    selection = module_selection(modules)
    if temperature <= 0:
        raise ConfigurationError(f"temperature must be positive, got {temperature}")
    clip_eps = DEFAULT_CLIP_EPS if clip_eps is None else clip_eps
    if not 0 < clip_eps < 1:
        raise ConfigurationError(f"clip_eps must be in (0, 1), got {clip_eps}")
    reference_variant = resolve_reference(reference)
    batch = to_batch(inputs)
    unsharded = model.model if isinstance(model, ShardedModel) else model
    run_device = torch.device(device) if device is not None else default_device(unsharded)
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
    )
    with preserved_rng(run_device), ambient_modes_off(run_device):
        runner = _runner(ref)  # its targets and mask made outside the caller's inference mode too
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
        runner: _Runner,
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
        if kept.is_floating_point() and kept.numel() and kind != LOGITS_KIND:  # the logits: the head's fw row
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
    runner: _Runner,
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


def _nonfinite_reference(runner: _Runner, variant: Variant, kinds: Sequence[str]) -> str:
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


def _reference_noise(runner: _Runner, ref: Reference, repeats: int) -> dict[TensorKey, float]:
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
            measured = _VariantPass(runner, ref.variant, ref.tensors(), ref.sums, 1.0)
            runner.run(ref.variant, measured.measure)
            measured.resolve()
            _, measured = _exact_if_needed(runner, measured)
            for key, value in _rms_rels(measured.records).items():
                noise[key] = max(noise.get(key, 0.0), value)
        ref.noise[repeats] = noise
    return ref.noise[repeats]


@distributed.failures_shared()
def measure(
    ref: Reference,
    variants: Sequence[Variant],
    *,
    loss_scale: LossScale = None,
    repeats: int = 1,
    verify: bool = True,
    range_stats: bool = False,
    weight_cast: bool = False,
    progress: ProgressCallback | None = None,
    progress_offset: int = 0,
) -> PrecisionReport:
    """Measure each variant against the reference's stored tensors (the reference does not run again, but
    for repeats > 1, to measure its noise once per Reference). Under torch.distributed, a failure on any rank
    fails every rank alike. `range_stats`, `weight_cast`: see compare. `progress`: see progress.py; variant i
    is run `progress_offset + i` (1-based) of `progress_offset + len(variants)`."""
    progress = checked_callback(progress)
    _check_flag(range_stats, "range_stats")
    _check_flag(weight_cast, "weight_cast")
    if ref.source is None:
        where = f" from {ref.path}" if ref.path else ""
        raise ConfigurationError(
            f"this Reference was loaded{where} without its model: the variants are built from it; pass "
            "Reference.load(path, model=...) (the model or a factory (dtype, device) -> nn.Module), or "
            "ref.with_model(model)"
        )
    _check_model(ref.source)
    if ref.loss_fn is None and ref.loss_fn_name is not None:
        raise ConfigurationError(
            f"this Reference ran with loss_fn={ref.loss_fn_name}; pass it again: Reference.load(path, "
            "model=..., loss_fn=...)"
        )
    unchanged = not verify or ref.path is not None or ref.checksum is None or not _is_module(ref.source)
    if not unchanged and state_checksum(ref.source) != ref.checksum:  # type: ignore[arg-type]
        raise ConfigurationError(
            "the model's parameters or buffers changed since its Reference was computed; build a new "
            "one with reference(model, inputs, ...)"
        )
    stored = ref.tensors()
    with preserved_rng(ref.device), ambient_modes_off(ref.device):
        runner = _runner(ref, repeats)
        if weight_cast and (runner.distributed or isinstance(ref.source, ShardedModel)):
            raise ConfigurationError(
                "weight_cast=True: weight rows are measured in one process, not under torch.distributed or for a "
                "sharded model; leave weight_cast off there (compare the unsharded model in one process instead)"
            )
        noise = _reference_noise(runner, ref, repeats)
        # Set after the reference's noise passes, which measure its captured tensors only.
        runner.range_stats = range_stats
        if weight_cast:
            runner.weight_cast = True
            stored = _WithWeights(stored, reference_weights(ref))
        report = PrecisionReport(reference=dataclasses.replace(ref.info, repeats=repeats), device=str(ref.device))
        isolation = isolation_inputs(runner, ref) if any(v.isolate for v in variants) else None
        total = progress_offset + len(variants)
        for number, variant in enumerate(variants, start=progress_offset + 1):
            runner.progress = RunProgress(progress, variant.name, "variant", number, total)
            info, records = _measure_variant(
                runner,
                variant,
                stored,
                ref.sums,
                _loss_scale_for(loss_scale, variant.name),
                reference_gradient=lambda: reference_max_gradient(ref),
                repeats=repeats,
                noise=noise,
                origin=report.nonfinite_origin,
                isolation=isolation if variant.isolate else None,
                logprobs=report.token_logprobs,
            )
            runner.progress.done()
            seen = {(r.name, r.kind) for r in records}
            absent = (LOGITS_KIND,) if variant.arrangement is None else (LOGITS_KIND, "loss", *GRADIENT_KINDS)
            missing = [key for key in stored if key not in seen and key[1] not in absent]
            report.add(variant.name, info, records, missing)
        # The weights' reference_sums served this call's variants only (harmless if an error leaves them).
        for key in [key for key in ref.sums if key[1] == WEIGHT_KIND]:
            del ref.sums[key]
        kept_reference = stored.get(("logprob", "logprob"))
        if report.token_logprobs and kept_reference is not None and runner.valid is not None:
            report.reference_logprobs = kept_reference
            report.logprob_mask = runner.valid
        if runner.distributed:
            report.distributed = dict(runner.mesh)
            # Where NaN/Inf started may differ per rank: every rank reports the lowest rank's finding.
            for origins in reversed(distributed.exchange(report.nonfinite_origin)):
                report.nonfinite_origin.update(origins)
    return report


def compare(
    model: nn.Module | ModelFactory | Reference,
    inputs: Any = None,
    variants: Sequence[str | Variant | Mapping[str, Any]] | str | Variant | None = None,
    *,
    reference: str | Variant | None = None,
    loss_fn: LossFn | None = None,
    backward: bool | None = None,
    modules: Sequence[str] | str | None = None,
    device: str | torch.device | None = None,
    temperature: float | None = None,
    clip_eps: float | None = None,
    loss_scale: LossScale = None,
    repeats: int = 1,
    offload: bool | None = None,
    cache: ReferenceCache | None = None,
    isolate: bool | None = None,
    range_stats: bool = False,
    weight_cast: bool = False,
    progress: ProgressCallback | None = None,
) -> PrecisionReport:
    """Measure each variant's per-tensor error against an fp32 (or fp64) reference run of `model`.

    model: an nn.Module (never modified: each run uses a copy; weights not in fp32/fp64 get a
        LowPrecisionReferenceWarning) or a factory `(dtype, device) -> nn.Module` returning a new model each
        call (one returned twice is refused);
        or a Reference (see pytest_precision.reference): its captured tensors are reused, the reference
        does not run again; then `inputs` and the reference's options (reference, loss_fn, backward,
        modules, temperature, clip_eps, offload, cache) are the Reference's and must not be passed.
    inputs: a dict of keyword arguments, a tensor, or a tuple of positional arguments (a namedtuple is one
        argument). Each run gets its own copy of every tensor in them, at any depth: a forward writing its
        inputs in place changes neither the caller's tensors nor another run.
    reference: "fp32" (default) or "fp64".
    loss_fn: `loss_fn(output, inputs) -> scalar`; default `output.loss`.
    backward: compare gradients too (default True).
    modules: full-match regexes of module names to capture (one string is one regex); default: embedding,
        blocks, final norm, head.
    temperature, clip_eps: for causal LMs' chosen-token log-probabilities and their clip fraction
        (default 1.0 and 0.2).
    loss_scale: fp16 loss scale, one for every fp16 variant or {variant: scale}; default: sized from the
        reference's largest |gradient| (see fp16_loss_scale); "calibrate": from an unscaled pass of the
        variant itself (one more forward and backward per fp16 variant).
    repeats: runs of the reference and of each variant, to measure run-to-run noise (non-deterministic
        kernels). With repeats > 1 every record gets `spread`: the max - min of its rms_rel over the
        variant's runs (each against the reference's first run) plus the largest rms_rel of a reference
        repeat against the reference's first run. The records are the first run's.
    offload: keep the reference's tensors on the host (see pytest_precision.reference).
    isolate: True measures every variant's isolated error too (as Variant(isolate=True) does for one):
        each selected module runs on the reference's input for that module and its backward on the
        reference's gradient at its output (arrangement variants excepted); the rows fw_isolated,
        bw_isolated and grad_isolated then hold the error each module adds itself (see
        pytest_precision.isolated for the rules).
    cache: a ReferenceCache to reuse (and keep) the reference run of the same model object with the same
        parameter values, hooks, attributes, inputs and options (see pytest_precision.references for what
        the key covers; a model it cannot fingerprint runs its reference again).
    range_stats: True gives every record but logprob and loss rows the range statistics of its reference
        tensor in the variant's compute dtype (see metrics.RangeStats): underflow_frac, zero_frac,
        overflow_frac, ref_absmax, dynamic_range_log2; bw and grad rows of a loss-scaled fp16 variant are
        counted at its loss scale, as the variant holds them. Off: None, and left out of JSON.
    weight_cast: True adds a "weight_cast" row per floating parameter (tied ones once): the parameter as the
        variant's model holds it, built as for its run (cast, fp32-kept modules, autocast's fp32 weights),
        against the reference's, with the usual metrics: the error of the cast alone (no extra forward or
        backward). Also for arrangement variants (a weight does not depend on how the tokens are run); not
        in isolated passes, not under torch.distributed (a ConfigurationError).
    progress: a callable taking a pytest_precision.progress.ProgressEvent, called as each run (the reference,
        then each variant) starts a phase (build, forward, backward, measure) and when it is done, with its
        wall time; it adds no host synchronisation. Default: no events.

    The runs ignore the caller's torch.autocast, no_grad and inference_mode: a call inside them measures the
    same numbers as one outside. A reference run producing NaN/Inf is a ModelRunError naming the module
    where they started. A variant whose run produces NaN/Inf is run once more with every module watched;
    `report.nonfinite_origin[variant]` then names the module where they started, "name (fw)" or "name (bw)".
    """
    import torch

    if isinstance(model, Reference):
        given = {
            "inputs": inputs,
            "reference": reference,
            "loss_fn": loss_fn,
            "backward": backward,
            "modules": modules,
            "temperature": temperature,
            "clip_eps": clip_eps,
            "offload": offload,
            "cache": cache,
        }
        passed = [name for name, value in given.items() if value is not None]
        if device is not None and torch.device(device) != model.device:
            passed.append("device")
        if passed:
            raise ConfigurationError(
                f"compare(reference, ...): {', '.join(passed)} cannot be given with a Reference: the reference "
                "already ran with its own; pass variants=[...] (and loss_scale, repeats) only, or build "
                "another Reference"
            )
    else:
        _check_model(model)
    _check_repeats(repeats)
    _check_flag(range_stats, "range_stats")
    _check_flag(weight_cast, "weight_cast")
    if variants is None:
        raise ConfigurationError("variants: give a non-empty list, e.g. variants=['bf16', 'fp16']")
    variant_list = resolve_variants(variants)
    if isolate is not None:
        if not isinstance(isolate, bool):
            raise ConfigurationError(f"isolate must be True or False, got {isolate!r}")
        if isolate:
            # Arrangements compare another way of running the same tokens, forward only: not isolated.
            variant_list = [v if v.arrangement else dataclasses.replace(v, isolate=True) for v in variant_list]
    if isinstance(model, Reference):
        return measure(
            model,
            variant_list,
            loss_scale=loss_scale,
            repeats=repeats,
            range_stats=range_stats,
            weight_cast=weight_cast,
            progress=progress,
        )
    ref = build_reference(
        model,
        inputs,
        reference="fp32" if reference is None else reference,
        loss_fn=loss_fn,
        backward=True if backward is None else backward,
        modules=modules,
        device=device,
        temperature=1.0 if temperature is None else temperature,
        clip_eps=clip_eps,
        offload=offload,
        cache=cache,
        checksum=cache is not None,
        progress=progress,
        progress_total=1 + len(variant_list),
    )
    try:
        return measure(
            ref,
            variant_list,
            loss_scale=loss_scale,
            repeats=repeats,
            verify=False,
            range_stats=range_stats,
            weight_cast=weight_cast,
            progress=progress,
            progress_offset=1,
        )
    finally:
        if cache is None:
            ref.stored.clear()
