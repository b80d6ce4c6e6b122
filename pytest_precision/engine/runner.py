"""One run of the model: build it as the variant says, run forward and backward under the pinned flags,
and stream every captured tensor into a sink."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_precision.base.dtypes import ModelFactory, torch_dtype
from pytest_precision.base.errors import ConfigurationError, ModelRunError, PrecisionError
from pytest_precision.base.records import RunInfo
from pytest_precision.distributed import ranks as distributed
from pytest_precision.distributed.sharding import (
    Part,
    ShardedModel,
    add_vectors,
    combine_exact_sums,
    combined_shape,
    counted,
    local_part,
    mesh_of,
    plain,
)
from pytest_precision.engine import isolated
from pytest_precision.engine.arrangements import Arrangement, Assembler, run_calls, token_grid
from pytest_precision.engine.backend_flags import flags_to_dict, pinned_backend
from pytest_precision.engine.batch import Batch
from pytest_precision.engine.capture import (
    LOGITS_KIND,
    WEIGHT_KIND,
    NonfiniteTrace,
    Sink,
    TensorKey,
    capture,
    select_modules,
    trace_nonfinite,
)
from pytest_precision.engine.compile_build import CompileWatch, add_costs, compile_regions, compiler_state_kept
from pytest_precision.engine.host_sums import HostSums
from pytest_precision.engine.isolation import ambient_modes_off, seed_run
from pytest_precision.engine.losses import LossFn, loss_of
from pytest_precision.engine.lowbit_build import APPLIED_FORMATS, dequantized
from pytest_precision.engine.model_build import FactoryProducts, build_run_model
from pytest_precision.engine.model_facts import (
    dtype_counts,
    is_causal_lm,
    logits_of,
    parameter_categories,
    rank_average,
)
from pytest_precision.engine.port_build import PortModel, build_port_run_model
from pytest_precision.engine.positions import Positions, batch_positions, select_positions
from pytest_precision.engine.progress import Phase, RunProgress
from pytest_precision.engine.routers import ROUTING_KIND, Router, Routers, checked_routers, find_routers
from pytest_precision.engine.variants import Variant
from pytest_precision.numbers.logprobs import LOG_RATIO_MAXIMA, chosen_logprobs
from pytest_precision.numbers.range_stats import combine_range_sums

if TYPE_CHECKING:
    import torch
    from torch import nn


#: A TypeError about the call's arguments (wrong keyword, missing or extra positional argument).
_ARGUMENT_ERROR = re.compile(r"argument|positional|keyword")


class Runner:
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
        routers: Routers | bool | None = None,
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
        #: isolated or recording runs), and give records range statistics (see range_stats.RangeStats).
        self.weight_cast = False
        self.range_stats = False
        #: Set by measure: token statistics over the second half of each row only (compare(token_stats_second_half)).
        self.token_stats_second_half = False
        #: The events of the run being made (see progress.py); None: none are sent.
        self.progress: RunProgress | None = None
        #: Which routers make routing rows (see routers.find_routers), their expert counts by name, and each
        #: variant's routing tensors by router label (kept for replay into a later variant and for
        #: PrecisionReport.routing_mismatch), with the reference's margins of its flipped tokens.
        self.routers = checked_routers(routers)
        self.router_experts: dict[str, int | None] = {}
        self.recorded_routing: dict[str, dict[str, torch.Tensor]] = {}
        self.flip_margins: dict[str, dict[str, list[float]]] = {}
        #: The reference's routing tensors by router label (set by measure; replay_routing=True replays them).
        self.reference_routing: dict[str, torch.Tensor] = {}
        #: What each compiled variant's runs cost to compile, summed over its runs (compile_build.add_costs).
        self.compile_costs: dict[str, dict[str, Any]] = {}
        self._watch: CompileWatch | None = None
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
        spec = variant.compiled
        if spec is None:
            return self._run(variant, sink, loss_scale, origin=origin, isolation=isolation, recording=recording)
        if self.distributed or isinstance(self.source, ShardedModel):
            raise ConfigurationError(
                f"variant {variant.name!r}: compiled variants are measured on an unsharded model in one process (a "
                "sharded model's compilation is not built here yet); compare the unsharded model, compiled, in one "
                "process"
            )
        self._watch = None
        start = time.perf_counter()
        with compiler_state_kept(len(self.module_names or ()) + 1, lambda: self._watch):
            info = self._run(variant, sink, loss_scale, origin=origin, isolation=isolation, recording=recording)
        watch = self._watch
        assert watch is not None
        watch.check(variant.name)
        self.compile_costs[variant.name] = add_costs(
            self.compile_costs.get(variant.name), watch.cost(), time.perf_counter() - start
        )
        return dataclasses.replace(info, compiled=watch.facts())

    def _run(
        self,
        variant: Variant,
        sink: Sink,
        loss_scale: float = 1.0,
        *,
        origin: dict[str, str] | None = None,
        isolation: isolated.Recorded | None = None,
        recording: isolated.Recorded | None = None,
    ) -> RunInfo:
        import torch

        with ambient_modes_off(self.device), pinned_backend(variant, self.device.type) as flags:
            self.phase("build")
            port: PortModel | None = None
            unported_sink = sink
            if variant.port is not None:
                if self.distributed or isinstance(self.source, ShardedModel):
                    raise ConfigurationError(
                        f"variant {variant.name!r}: another implementation is compared on an unsharded model in one "
                        "process; compare the unsharded models"
                    )
                model, port = build_port_run_model(self.source, variant, self.device, self.module_names)
                sink = port.sink(sink)
            else:
                model = build_run_model(self.source, variant, self.device, self.products)
            if self.module_names is None:
                self.module_names = select_modules(model, self.modules)
            captured = self.module_names if port is None else port.captured
            spec = variant.compiled
            if spec is not None:
                # The last build step: hooks stay at the regions' boundaries, outside compiled code; a whole-graph
                # compilation has none inside it, and no router rows (their hooks would sit in compiled code).
                self._watch = compile_regions(model, spec, captured, self.device.type)
                captured = [] if spec.scope == "whole" else captured
            routers = {} if spec is not None or port is not None else self._routers(model, variant)
            replay = self._replay(variant, routers)
            float_dtype = torch_dtype(variant.weight_dtype)
            args, kwargs = self.batch.on(self.device, float_dtype)
            call_inputs = _call_inputs(args, kwargs)
            seed_run(self.device)
            backward = self.backward and not variant.forward_only  # quantized inference: forward only
            autocast = self._autocast(variant)
            watch: contextlib.AbstractContextManager[NonfiniteTrace | None] = contextlib.nullcontext()
            if origin is not None:
                regions = self._watch.regions if spec is not None and self._watch is not None else ()
                watch = trace_nonfinite(model, backward=backward, compiled_regions=regions)
            if self.distributed:
                sink = self._localized(sink)
                self.mesh = mesh_of(model)
            if self.weight_cast and isolation is None and recording is None and port is not None:
                port.weights(sink, WEIGHT_KIND)
            elif self.weight_cast and isolation is None and recording is None:
                for parameter_name, parameter in model.named_parameters():  # tied ones once
                    if parameter.is_floating_point():
                        sink(parameter_name, WEIGHT_KIND, dequantized(parameter))
            self.phase("forward")
            if isolation is not None:
                return self._run_isolated(
                    model, variant, unported_sink, loss_scale, isolation, (args, kwargs), flags, routers, replay, port
                )
            if variant.arrangement is not None:
                return self._run_arranged(model, variant, sink, call_inputs, flags, origin, routers)
            if recording is not None:
                recorder: contextlib.AbstractContextManager[Any] = isolated.record(
                    model, isolated.boundaries(self.module_names), backward=backward, into=recording
                )
            else:
                recorder = contextlib.nullcontext()
            # Sharded parameters get their gradients after the reduce-scatter, outside autograd's accumulation:
            # under torch.distributed they are read once backward returned.
            hooked_grads = not self.distributed and port is None
            with (
                watch as trace,
                recorder,
                capture(
                    model,
                    captured,
                    sink,
                    backward=backward,
                    parameter_grads=hooked_grads,
                    routers=routers,
                    replay=replay,
                ),
            ):
                with torch.set_grad_enabled(backward), autocast:
                    try:
                        output = _forward(model, port, args, kwargs)
                    except PrecisionError:
                        raise
                    except Exception as error:
                        raise ModelRunError(self._failure(model, variant, error, "forward")) from error
                self._log_probabilities(model, output, sink)
                loss = loss_of(output, call_inputs, self.loss_fn, variant.name)
                if loss is not None:
                    sink("loss", "loss", plain(loss).detach())  # under torch.distributed: each rank's loss
                if backward:
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
                    if port is not None:
                        port.gradients(sink)
                    elif not hooked_grads:
                        # Every rank got this far (else its error ends the wait here), before the collectives.
                        distributed.exchange(None)
                        for parameter_name, parameter in model.named_parameters():
                            if parameter.requires_grad and parameter.grad is not None:
                                sink(parameter_name, "grad", rank_average(parameter.grad))
            if trace is not None and (where := trace.origin()) is not None:
                assert origin is not None
                origin[variant.name] = where if port is None else port.origin(where)
            info = self._info(model, variant, flags)
            if port is not None:
                info = dataclasses.replace(info, port=port.facts())
            del model, output, loss
        return info

    def _routers(self, model: nn.Module, variant: Variant) -> dict[str, Router]:
        """The routers of this run's model whose choices make routing rows (none under torch.distributed, where
        asking for them, or for replay, is refused)."""
        if self.distributed:
            if isinstance(self.routers, Routers) or variant.replay_routing:
                raise ConfigurationError(
                    f"variant {variant.name!r}: routing rows and routing replay are measured in one process, not "
                    "under torch.distributed (expert-parallel or sharded MoE layers route each rank's tokens apart); "
                    "compare the MoE's routing unsharded in one process, or pass routers=False"
                )
            return {}
        routers = find_routers(model, self.routers)
        for name, router in routers.items():
            self.router_experts[name] = router.experts
        return routers

    def experts_of(self, label: str) -> int | None:
        """The expert count of the router a routing row `label` ("name" or "name#k") comes from (None: unknown)."""
        return self.router_experts.get(label.partition("#")[0])

    def _replay(self, variant: Variant, routers: Mapping[str, Router]) -> dict[str, torch.Tensor] | None:
        """The routing tensors `variant` replays (see Variant.replay_routing), None when it replays none."""
        source = variant.replay_routing
        if not source:
            return None
        if not routers:
            raise ConfigurationError(
                f"variant {variant.name!r}: replay_routing, but the model has no router the plugin knows (transformers "
                ">= 5 MoE routers are found by themselves); name yours with routers=pytest_precision.Routers(...)"
            )
        refusals = sorted({reason for router in routers.values() if (reason := router.replay_refusal) is not None})
        if refusals:
            raise ConfigurationError(f"variant {variant.name!r}: replay_routing: {'; '.join(refusals)}")
        if source is True:
            return self.reference_routing
        recorded = self.recorded_routing.get(str(source))
        if recorded is None:
            raise ConfigurationError(
                f"variant {variant.name!r}: replay_routing={source!r} names no variant whose routing this comparison "
                f"recorded before it (recorded: {', '.join(self.recorded_routing) or 'none'}); list {source!r} "
                "before it in variants"
            )
        return recorded

    def _autocast(self, variant: Variant) -> torch.autocast:
        """The variant's torch.autocast on the run's device (disabled unless variant.autocast)."""
        import torch

        return torch.autocast(device_type=self.device.type, dtype=torch_dtype(variant.dtype), enabled=variant.autocast)

    def _info(self, model: nn.Module, variant: Variant, flags: Any) -> RunInfo:
        categories, tied = parameter_categories(model)
        applied = APPLIED_FORMATS.get(model)
        return RunInfo(
            variant=variant.to_dict(),
            parameter_dtypes=dtype_counts(model.parameters()),
            buffer_dtypes=dtype_counts(b for b in model.buffers() if b.is_floating_point()),
            input_shapes=self.inputs_described[0],
            token_count=self.inputs_described[1],
            backend=flags_to_dict(flags),
            parameter_categories=categories,
            tied_head=tied,
            repeats=self.repeats,
            lowbit=None if applied is None else applied.to_dict(),
        )

    def _run_arranged(
        self,
        model: nn.Module,
        variant: Variant,
        sink: Sink,
        inputs: Any,
        flags: Any,
        origin: dict[str, str] | None = None,
        routers: Mapping[str, Router] | None = None,
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
        with (
            watch as trace,
            capture(model, self.module_names, assembler, backward=False, routers=routers) as counts,
            autocast,
        ):
            run_calls(model, arrangement, inputs, assembler, counts, variant=variant.name, logits_of=logits_of)
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
        routers: Mapping[str, Router] | None = None,
        replay: Mapping[str, torch.Tensor] | None = None,
        port: PortModel | None = None,
    ) -> RunInfo:
        """The isolated run of `variant` (see isolated.py), its rows streamed to `sink` as isolated kinds. With
        `port`, the other implementation's modules standing for the reference's boundaries are fed the reference's
        inputs in their own layouts, and its rows are the reference's (port_build.PortModel)."""
        import torch

        assert self.module_names is not None
        boundary_names = isolated.boundaries(self.module_names)
        counterparts = None if port is None else port.isolation_boundaries(boundary_names)
        if counterparts is not None:
            boundary_names = list(counterparts)
        owned = isolated.owned_parameters(model, boundary_names)

        def isolated_sink(name: str, kind: str, tensor: torch.Tensor) -> None:
            if kind in ("fw", "bw", ROUTING_KIND) or (kind == "grad" and port is None and name in owned):
                sink(name, isolated.isolated_kind(kind), tensor)

        args, kwargs = call
        autocast = self._autocast(variant)
        backward = self.backward and not variant.forward_only
        hooked = self.module_names if port is None else port.captured
        with (
            isolated.isolate(
                model, boundary_names, recorded, scale=loss_scale, variant=variant.name, counterparts=counterparts
            ) as run,
            capture(
                model,
                hooked,
                isolated_sink if port is None else port.sink(isolated_sink),
                backward=backward,
                parameter_grads=port is None,
                routers=routers,
                replay=replay,
            ),
        ):
            with torch.set_grad_enabled(backward), autocast:
                try:
                    _forward(model, port, args, kwargs)
                except PrecisionError:
                    raise
                except Exception as error:
                    raise ModelRunError(self._failure(model, variant, error, "isolated forward")) from error
            if backward:
                try:
                    run.backward()
                except Exception as error:
                    raise ModelRunError(self._failure(model, variant, error, "isolated backward")) from error
                if port is not None:
                    port.gradients(
                        lambda name, kind, tensor: sink(name, isolated.isolated_kind(kind), tensor), only=owned
                    )
        info = self._info(model, variant, flags)
        if port is not None:
            info = dataclasses.replace(info, port=port.facts())
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
        self,
        raw: list[HostSums],
        distribution: list[float] | None,
        rows: int,
        vectors: list[list[float]] | None = None,
    ) -> tuple[list[HostSums], list[float] | None, int, list[list[float]] | None]:
        """The exact sums of the whole tensors from every rank's parts (one exchange), identical on every rank;
        with the per-token vectors of every rank's counted positions, joined in rank order (ranks holding the
        same inputs count once, as for the distribution sums)."""
        keys = [(item.name, item.kind) for item, *_ in raw]
        local = {
            "keys": keys,
            "sums": [values for _, _, values, _ in raw],
            "parts": [self.parts.get(key, Part(None, item.shape)) for key, (item, *_) in zip(keys, raw, strict=True)],
            "log_ratio": [log_ratio for *_, log_ratio in raw],
            "range": [item.range_host for item, *_ in raw],
            "distribution": None if distribution is None else (distribution, rows),
            "vectors": vectors,
        }
        everyone = distributed.exchange(local)
        for index, other in enumerate(everyone):
            if other["keys"] != everyone[0]["keys"]:
                only = sorted(set(map(tuple, other["keys"])) ^ set(map(tuple, everyone[0]["keys"])))
                raise ModelRunError(
                    f"rank {index} captured other tensors than rank 0 ({', '.join(f'{n} ({k})' for n, k in only[:6])}"
                    "): every rank must run the same model on inputs of the same structure"
                )
        combined: list[HostSums] = []
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
        joined: list[list[float]] | None = None
        for sent in everyone:
            if sent["distribution"] is not None and repr(sent["distribution"]) not in seen:
                seen.add(repr(sent["distribution"]))
                kept.append(sent["distribution"])
                if sent["vectors"] is not None:
                    joined = [[*a, *b] for a, b in zip(joined or [[], [], [], []], sent["vectors"], strict=True)]
        if not kept:
            return combined, None, 0, None
        summed = add_vectors([values for values, _ in kept], maximum=(1,))
        return combined, summed, sum(count for _, count in kept), joined

    def _failure(self, model: nn.Module, variant: Variant, error: Exception, phase: str) -> str:
        """What went wrong in a run: the inputs' keys are blamed only for a TypeError about arguments."""
        name = type(model).__name__
        port = ""
        if phase == "forward" and variant.port is not None:
            port = (
                f"; the other implementation ({variant.port.label}) is called as the reference is unless its Port "
                "says forward=... (pytest_precision.ports.causal_lm_forward for a model returning logits)"
            )
        if phase == "forward" and isinstance(error, TypeError) and _ARGUMENT_ERROR.search(str(error)):
            return (
                f"run {variant.name!r}: {name} rejected the inputs {self.batch.shapes()}: {type(error).__name__}: "
                f"{error} (check that the inputs' keys match forward()'s arguments, and their shapes, dtypes and "
                f"token ids what it expects){port}"
            )
        hint = port
        if phase == "forward" and isinstance(error, IndexError):
            hint = "; an index out of range: are the token ids below the model's vocabulary size?"
        return (
            f"{name} raised {type(error).__name__}: {error} in {phase} of run {variant.name!r} "
            f"(inputs {self.batch.shapes()}){hint}"
        )

    def _log_probabilities(self, model: nn.Module, output: Any, sink: Sink) -> None:
        """For a causal LM: the gradient at the logits (bw), the logits, and the chosen-token log-probs."""
        logits = logits_of(output)
        if (
            logits is None
            or self.targets is None
            or not self.targets.numel()  # sequences of length 1: no position predicts a next token
            or not is_causal_lm(model)
            or tuple(logits.shape[:2]) != (self.targets.shape[0], self.targets.shape[1] + 1)
            or self.positions.targets_max >= logits.shape[-1]  # logits over tags or classes, not the vocabulary
        ):
            return
        if self.backward and logits.requires_grad:
            # A whole-graph compiled model computes its loss inside the graph: its returned logits get no gradient.
            logits.register_hook(lambda grad: None if grad is None else sink("logits", "bw", grad))  # type: ignore[no-untyped-call]
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
        if kind == ROUTING_KIND:  # (rows, positions, 2k + 1): counted positions; off the batch's grid: all tokens
            return select_positions(tensor, positions.shape, positions.index).reshape(-1, tensor.shape[-1])
        return select_positions(tensor, positions.shape, positions.index) if kind in ("fw", "bw") else tensor


def _call_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The inputs as the caller gave them: the dict of keyword arguments, the one tensor, or the tuple."""
    return kwargs if not args else (args[0] if len(args) == 1 else args)


def _forward(model: nn.Module, port: PortModel | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The run model's forward: as the reference is called, or through the port's own forward(model, inputs)."""
    if port is not None and port.port.forward is not None:
        return port.port.forward(model, _call_inputs(args, kwargs))
    return model(*args, **kwargs)


def compute_dtype(variant: Variant) -> torch.dtype:
    """The dtype `variant` computes in, which its range statistics count in: its FSDP2 param_dtype when set, else
    its dtype (for an autocast variant, the autocast dtype; fp32_modules are not told apart)."""
    return torch_dtype(variant.param_dtype or variant.dtype)


def checked_flag(value: object, argument: str) -> bool:
    """A True/False option, or a ConfigurationError naming it."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{argument} must be True or False, got {value!r}")
    return value


def _shape(tensor: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(tensor.shape)
