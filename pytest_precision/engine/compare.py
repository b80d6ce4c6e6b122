"""Run the reference and each variant, streaming every captured variant tensor into its metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_precision.base.dtypes import ModelFactory
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.distributed import ranks as distributed
from pytest_precision.distributed.sharding import ShardedModel
from pytest_precision.engine.capture import GRADIENT_KINDS, LOGITS_KIND, WEIGHT_KIND
from pytest_precision.engine.compile_build import check_compilable
from pytest_precision.engine.fingerprint import state_checksum
from pytest_precision.engine.isolation import ambient_modes_off, comparison_device, preserved_rng
from pytest_precision.engine.losses import LossFn, LossScale, loss_scale_for
from pytest_precision.engine.lowbit_build import check_runnable
from pytest_precision.engine.progress import ProgressCallback, RunProgress, checked_callback
from pytest_precision.engine.reference_run import (
    _is_module,
    build_reference,
    check_model,
    check_repeats,
    new_runner,
    reference_noise,
)
from pytest_precision.engine.references import Reference, ReferenceCache
from pytest_precision.engine.routers import ROUTING_KIND, Routers
from pytest_precision.engine.runner import checked_flag
from pytest_precision.engine.variant_pass import (
    WithWeights,
    isolation_inputs,
    measure_variant,
    reference_max_gradient,
    reference_weights,
)
from pytest_precision.engine.variants import Variant, resolve_variants
from pytest_precision.reports.report import PrecisionReport

if TYPE_CHECKING:
    import torch
    from torch import nn


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
    token_stats_second_half: bool = False,
) -> PrecisionReport:
    """Measure each variant against the reference's stored tensors (the reference does not run again, but
    for repeats > 1, to measure its noise once per Reference). Under torch.distributed, a failure on any rank
    fails every rank alike. `range_stats`, `weight_cast`, `token_stats_second_half`: see compare. `progress`: see
    progress.py; variant i is run `progress_offset + i` (1-based) of `progress_offset + len(variants)`."""
    progress = checked_callback(progress)
    checked_flag(range_stats, "range_stats")
    checked_flag(weight_cast, "weight_cast")
    checked_flag(token_stats_second_half, "token_stats_second_half")
    if ref.source is None:
        where = f" from {ref.path}" if ref.path else ""
        raise ConfigurationError(
            f"this Reference was loaded{where} without its model: the variants are built from it; pass "
            "Reference.load(path, model=...) (the model or a factory (dtype, device) -> nn.Module), or "
            "ref.with_model(model)"
        )
    check_model(ref.source)
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
        runner = new_runner(ref, repeats)
        if weight_cast and (runner.distributed or isinstance(ref.source, ShardedModel)):
            raise ConfigurationError(
                "weight_cast=True: weight rows are measured in one process, not under torch.distributed or for a "
                "sharded model; leave weight_cast off there (compare the unsharded model in one process instead)"
            )
        noise = reference_noise(runner, ref, repeats)
        runner.reference_routing = {name: tensor for (name, kind), tensor in stored.items() if kind == ROUTING_KIND}
        # Set after the reference's noise passes, which measure its captured tensors only.
        runner.range_stats = range_stats
        runner.token_stats_second_half = token_stats_second_half
        if weight_cast:
            runner.weight_cast = True
            stored = WithWeights(stored, reference_weights(ref))
        report = PrecisionReport(reference=dataclasses.replace(ref.info, repeats=repeats), device=str(ref.device))
        isolation = isolation_inputs(runner, ref) if any(v.isolate for v in variants) else None
        total = progress_offset + len(variants)
        for number, variant in enumerate(variants, start=progress_offset + 1):
            runner.progress = RunProgress(progress, variant.name, "variant", number, total)
            info, records = measure_variant(
                runner,
                variant,
                stored,
                ref.sums,
                loss_scale_for(loss_scale, variant.name),
                reference_gradient=lambda: reference_max_gradient(ref),
                repeats=repeats,
                noise=noise,
                origin=report.nonfinite_origin,
                isolation=isolation if variant.isolate else None,
                logprobs=report.token_logprobs,
            )
            runner.progress.done()
            seen = {(r.name, r.kind) for r in records}
            absent: tuple[str, ...] = (LOGITS_KIND,)
            absent += ("loss",) if variant.arrangement is not None else ()
            absent += GRADIENT_KINDS if variant.forward_only else ()
            absent += (ROUTING_KIND,) if variant.compiled else ()
            # A whole-graph compilation has no module rows: no hook may sit inside its graph.
            whole = variant.compiled is not None and variant.compiled.scope == "whole"
            unhooked = {*(runner.module_names or ()), "logits"} if whole else set()
            missing = [
                key
                for key in stored
                if key not in seen and key[1] not in absent and not (key[0] in unhooked and key[1] in ("fw", "bw"))
            ]
            report.add(variant.name, info, records, missing)
        # The weights' reference_sums served this call's variants only (harmless if an error leaves them).
        for key in [key for key in ref.sums if key[1] == WEIGHT_KIND]:
            del ref.sums[key]
        report.compile_costs = dict(runner.compile_costs)
        report.routing_choices = dict(runner.recorded_routing)
        report.reference_routing = runner.reference_routing
        report.routing_index = runner.positions.index
        report.flip_margins = runner.flip_margins
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
    routers: Routers | bool | None = None,
    token_stats_second_half: bool = False,
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
        reference's gradient at its output (arrangement and whole-graph compiled variants excepted); the
        rows fw_isolated, bw_isolated and grad_isolated then hold the error each module adds itself (see
        pytest_precision.engine.isolated for the rules).
    cache: a ReferenceCache to reuse (and keep) the reference run of the same model object with the same
        parameter values, hooks, attributes, inputs and options (see pytest_precision.engine.references for what
        the key covers; a model it cannot fingerprint runs its reference again).
    range_stats: True gives every record but logprob and loss rows the range statistics of its reference
        tensor in the variant's compute dtype (see range_stats.RangeStats): underflow_frac, zero_frac,
        overflow_frac, ref_absmax, dynamic_range_log2; bw and grad rows of a loss-scaled fp16 variant are
        counted at its loss scale, as the variant holds them. Off: None, and left out of JSON.
    weight_cast: True adds a "weight_cast" row per floating parameter (tied ones once): the parameter as the
        variant's model holds it, built as for its run (cast, fp32-kept modules, autocast's fp32 weights),
        against the reference's, with the usual metrics: the error of the cast alone (no extra forward or
        backward). Also for arrangement variants (a weight does not depend on how the tokens are run); not
        in isolated passes, not under torch.distributed (a ConfigurationError).
    progress: a callable taking a pytest_precision.engine.progress.ProgressEvent, called as each run (the reference,
        then each variant) starts a phase (build, forward, backward, measure) and when it is done, with its
        wall time; it adds no host synchronisation. Default: no events.
    routers: the mixture-of-experts routers whose expert choice per token makes a "routing" row per router and run
        (see pytest_precision.numbers.routing for its metrics): None (default) finds transformers' routers (the
        router modules of transformers >= 5, the nn.Linear gates of 4.x's MoE blocks; see
        pytest_precision.engine.routers), False makes none, a pytest_precision.Routers names a model's own. Variants
        with replay_routing replay another run's choice through them (see Variant).
    token_stats_second_half: True computes the logprob row's token statistics (kl_*, dp_*, top1_agreement,
        ppl_*; see pytest_precision.numbers.token_stats) over the second half of each row only, the tokens
        llama.cpp's `llama-perplexity --kl-divergence` scores when each row is one of its context windows
        (predicted from positions seq // 2 and later); the row's other metrics stay over every counted token.

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
            "routers": routers,
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
        check_model(model)
    check_repeats(repeats)
    checked_flag(range_stats, "range_stats")
    checked_flag(weight_cast, "weight_cast")
    checked_flag(token_stats_second_half, "token_stats_second_half")
    if variants is None:
        raise ConfigurationError("variants: give a non-empty list, e.g. variants=['bf16', 'fp16']")
    variant_list = resolve_variants(variants)
    if isolate is not None:
        if not isinstance(isolate, bool):
            raise ConfigurationError(f"isolate must be True or False, got {isolate!r}")
        if isolate:
            # Arrangements compare another way of running the same tokens, forward only: not isolated.
            # A whole-graph compiled variant has no boundary to isolate at either.
            variant_list = [
                v
                if v.arrangement or (v.compiled and v.compiled.scope == "whole")
                else dataclasses.replace(v, isolate=True)
                for v in variant_list
            ]
    if any(v.lowbit for v in variant_list):
        check_runnable(variant_list, model.device if isinstance(model, Reference) else comparison_device(model, device))
    if any(v.compiled for v in variant_list):
        check_compilable(
            variant_list, model.device if isinstance(model, Reference) else comparison_device(model, device)
        )
    if isinstance(model, Reference):
        return measure(
            model,
            variant_list,
            loss_scale=loss_scale,
            repeats=repeats,
            range_stats=range_stats,
            weight_cast=weight_cast,
            progress=progress,
            token_stats_second_half=token_stats_second_half,
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
        routers=routers,
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
            token_stats_second_half=token_stats_second_half,
        )
    finally:
        if cache is None:
            ref.stored.clear()
