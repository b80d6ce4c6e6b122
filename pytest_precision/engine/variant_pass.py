"""One variant measured against the reference: its captured tensors streamed into error sums on the device,
resolved with one host transfer per run, the isolated pass, and the loss scale."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ModelRunError
from pytest_precision.base.records import Record, RunInfo, TensorError
from pytest_precision.distributed.sharding import ShardedModel
from pytest_precision.engine import isolated
from pytest_precision.engine.capture import GRADIENT_KINDS, LOGITS_KIND, NO_RANGE_KINDS, WEIGHT_KIND, TensorKey
from pytest_precision.engine.host_sums import HostSums, PendingSums, resolve_pending
from pytest_precision.engine.losses import CALIBRATE, LargestGradient, fp16_loss_scale
from pytest_precision.engine.model_build import build_run_model, parameter_dtypes
from pytest_precision.engine.references import Reference
from pytest_precision.engine.routers import ROUTING_KIND
from pytest_precision.engine.runner import Runner, compute_dtype
from pytest_precision.engine.variants import Variant
from pytest_precision.numbers.logprobs import (
    distribution_from_sums,
    distribution_rows,
    log_ratio_from_sums,
    log_ratio_sums,
)
from pytest_precision.numbers.metrics import (
    error_sums,
    exact_error,
    exact_sums,
    fast_error,
    fast_pass_applies,
    reference_sums,
)
from pytest_precision.numbers.range_stats import range_from_sums, range_sums
from pytest_precision.numbers.routing import routing_from_sums, routing_sums, top_k
from pytest_precision.numbers.token_stats import second_half, token_stats

if TYPE_CHECKING:
    import torch

    from pytest_precision.engine.positions import Positions


class WithWeights(Mapping[TensorKey, "torch.Tensor"]):
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


def _calibrate_loss_scale(runner: Runner, variant: Variant) -> float:
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


class VariantPass:
    """One pass of a variant: each tensor is compared to the reference when produced, then dropped; its
    statistics stay on the device until `resolve`, after the run, copies all of them to the host at once.

    The fast pass (float32 sums, see metrics.py) assumes finite values; when a tensor turns out to hold NaN/Inf
    (`needs_exact`), the caller runs the variant again with `exact=True`.
    """

    def __init__(
        self,
        runner: Runner,
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
        self.pending: list[PendingSums] = []
        #: Per counted position: KL(p_ref || p_var) and argmax agreement, (2, N) float64 (see distribution_rows).
        self.distribution: torch.Tensor | None = None
        #: Per counted position: the chosen token's log-probability under the reference and the variant, (2, N).
        self.token_logprobs: torch.Tensor | None = None
        self.records: list[Record] = []
        self.overflowed = False
        self.needs_exact = False
        #: The variant's chosen-token log-probabilities (batch, seq - 1), float64, when the model has them.
        self.logprobs: torch.Tensor | None = None
        #: The dtype range statistics are counted in (None: compare(range_stats=False)).
        self.range_dtype = compute_dtype(variant) if runner.range_stats else None
        #: Per routing row: (name, kind, (tokens, k), routing_sums' three device tensors), see numbers.routing.
        self.routing: list[tuple[str, str, tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

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
        if kind == ROUTING_KIND:
            if record_kind == ROUTING_KIND:  # kept for replay into a later variant and for routing_mismatch
                runner.recorded_routing.setdefault(variant.name, {})[name] = obtained
            reference = runner.masked(name, kind, expected)
            sums = routing_sums(reference, runner.masked(name, kind, obtained), runner.experts_of(name))
            self.routing.append((name, record_kind, (reference.shape[0], top_k(reference)), sums))
            return
        if kind == LOGITS_KIND:
            assert positions.logits_index is not None
            self.distribution = distribution_rows(
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
            assert positions.valid_index is not None
            index = positions.valid_index.to(self.logprobs.device)  # flat, precomputed: no host sync here
            self.token_logprobs = torch.stack(
                [
                    expected.to(torch.float64).reshape(-1).index_select(0, index),
                    self.logprobs.reshape(-1).index_select(0, index),
                ]
            )
        range_values = None
        if self.range_dtype is not None and kind not in NO_RANGE_KINDS:
            # The values the variant holds: a loss-scaled gradient `scale` times the reference's.
            range_values = range_sums(reference, self.range_dtype, scale=scale)
        self.pending.append(
            PendingSums(
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
        if self.token_logprobs is not None:
            device_values.append(self.token_logprobs)
        for *_, sums in self.routing:
            device_values += list(sums)
        host = iter(resolve_pending(device_values))
        raw: list[HostSums] = []
        for item in self.pending:
            reference = next(host) if item.reference is not None else None
            values = next(host)
            raw.append((item, reference, values, next(host) if item.log_ratio is not None else None))
            if item.range_values is not None:
                item.range_host = next(host)
                item.range_values = None
        per_row = next(host) if self.distribution is not None else None
        logprob_rows = next(host) if self.token_logprobs is not None else None
        routing_rows = [
            (name, kind, shape, next(host), next(host), next(host)) for name, kind, shape, _ in self.routing
        ]
        self.routing.clear()
        vectors = token_vectors(per_row, logprob_rows)
        rows = self.runner.positions.logits_index
        row_count = 0 if rows is None else int(rows.numel())
        if vectors is not None and self.runner.token_stats_second_half:
            vectors = second_half_vectors(vectors, self.runner.positions)
            row_count = len(vectors[0])
        distribution = None
        if vectors is not None:
            kl = vectors[0]
            # A NaN KL (a non-finite variant) makes the maximum NaN, as torch.max would; max() would skip it.
            kl_max = math.nan if any(math.isnan(v) for v in kl) else max(kl, default=0.0)
            distribution = [math.fsum(kl), kl_max, math.fsum(vectors[1])]
        self.pending.clear()
        if self.runner.distributed:
            raw, distribution, row_count, vectors = self.runner.global_sums(raw, distribution, row_count, vectors)
        results: list[tuple[PendingSums, TensorError | None, list[float] | None]] = []
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
                if vectors is not None:
                    import numpy as np

                    arrays = [np.asarray(v, dtype=np.float64) for v in vectors]
                    extra |= dataclasses.asdict(token_stats(*arrays))
            self.records.append(Record.from_error(item.name, item.kind, item.shape, error, **extra))
        margins = self.runner.flip_margins.setdefault(self.variant.name, {})
        for name, kind, shape, stats, weight_sums, flips in routing_rows:
            error, routing = routing_from_sums(stats, weight_sums)
            self.records.append(Record.from_error(name, kind, shape, error, **dataclasses.asdict(routing)))
            if kind == ROUTING_KIND:
                margins[name] = [value for value in flips if not math.isnan(value)]


def token_vectors(per_row: list[float] | None, logprob_rows: list[float] | None) -> list[list[float]] | None:
    """[kl, agree, logp_reference, logp_variant] per counted position, from the host copies of a pass's
    distribution rows and token log-probabilities (None unless the pass has both, of one length)."""
    if per_row is None or logprob_rows is None or len(per_row) != len(logprob_rows):
        return None
    n = len(per_row) // 2
    return [per_row[:n], per_row[n:], logprob_rows[:n], logprob_rows[n:]]


def second_half_vectors(vectors: list[list[float]], positions: Positions) -> list[list[float]]:
    """token_vectors' vectors at the positions llama.cpp scores only: the second half of each row (see
    token_stats.second_half), for compare(token_stats_second_half=True)."""
    assert positions.valid is not None and positions.valid_index is not None
    columns = int(positions.valid.shape[1])  # the (batch, seq - 1) grid of next-token predictions
    in_row = positions.valid_index.cpu().numpy() % max(columns, 1)
    keep = second_half(in_row, columns + 1)
    return [[value for value, kept in zip(vector, keep, strict=True) if kept] for vector in vectors]


def exact_if_needed(
    runner: Runner, measured: VariantPass, isolation: isolated.Recorded | None = None
) -> tuple[RunInfo | None, VariantPass]:
    """`measured` when its fast pass could be trusted, else the exact pass of the same run (the run again,
    isolated with `isolation`)."""
    if not measured.needs_exact:
        return None, measured
    exact = VariantPass(runner, measured.variant, measured.stored, measured.sums, measured.scale, exact=True)
    info = runner.run(measured.variant, exact.measure, measured.scale, isolation=isolation)
    runner.phase("measure")
    exact.resolve()
    return info, exact


def rms_rel_by_tensor(records: Sequence[Record]) -> dict[TensorKey, float]:
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


def measure_variant(
    runner: Runner,
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
    scaled = runner.backward and variant.dtype == "float16" and not variant.forward_only
    scale = 1.0
    if scaled:
        if loss_scale == CALIBRATE:
            scale = _calibrate_loss_scale(runner, variant)
        elif loss_scale is None:
            scale = fp16_loss_scale(reference_gradient())
        else:
            scale = float(loss_scale)
    while True:
        measured = VariantPass(runner, variant, stored, sums, scale)
        info = runner.run(variant, measured.measure, scale)
        runner.phase("measure")
        measured.resolve()
        if not (scaled and measured.overflowed and scale > 1):
            break
        scale /= 2
    exact_info, measured = exact_if_needed(runner, measured)
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
        passes = [rms_rel_by_tensor(records)]
        for _ in range(repeats - 1):
            again = VariantPass(runner, variant, stored, sums, scale)
            runner.run(variant, again.measure, scale)
            runner.phase("measure")
            again.resolve()
            _, again = exact_if_needed(runner, again)
            passes.append(rms_rel_by_tensor(again.records))
        records = _with_spread(records, passes, noise or {})
    if isolation is not None:  # once, after the repeats: isolated rows have no spread
        records = records + _isolated_records(runner, variant, stored, sums, scale, isolation)
    return (dataclasses.replace(info, loss_scale=scale) if scaled else info), records


def _isolated_records(
    runner: Runner,
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
    measured = VariantPass(runner, variant, stored, sums, scale)
    runner.run(variant, measured.measure, scale, isolation=recorded)
    runner.phase("measure")
    measured.resolve()
    _, measured = exact_if_needed(runner, measured, recorded)
    return measured.records


def isolation_inputs(runner: Runner, ref: Reference) -> isolated.Recorded:
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
