"""The result of a comparison: per variant, one record per captured tensor, plus what each run was."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_precision.base.records import KINDS, METRIC_NAMES, Record, ReportData, RunInfo
from pytest_precision.numbers.cross_engine import logprob_record
from pytest_precision.numbers.logprobs import DEFAULT_CLIP_EPS
from pytest_precision.reports.llama_cpp import kl_divergence_lines
from pytest_precision.reports.tables import format_report

if TYPE_CHECKING:
    from pytest_precision.numbers.cross_engine import LogprobSource


def _mismatch_pairs(pairs: object, known: list[str]) -> list[tuple[str, str]]:
    """The (trainer, sampler) pairs of PrecisionReport.logprob_mismatch, every one checked before any is measured:
    a list (or tuple) of pairs of two different variant names of `known` (the variants whose log-probs the report
    holds), no pair twice. Anything else is a ConfigurationError naming the pair and saying what to pass."""
    from pytest_precision.base.errors import ConfigurationError

    usage = "pass a list of (trainer, sampler) pairs of variant names, e.g. [('bf16', 'bf16_decode')]"
    if isinstance(pairs, (str, bytes, Mapping)) or not isinstance(pairs, (Sequence, Iterator)):
        raise ConfigurationError(f"logprob_mismatch: got {pairs!r}; {usage}")
    items = list(pairs)
    if not items:
        raise ConfigurationError(f"logprob_mismatch: no pair given; {usage}")
    if len(items) == 2 and all(isinstance(item, str) for item in items):
        shown = items if isinstance(pairs, Iterator) else pairs
        raise ConfigurationError(
            f"logprob_mismatch: got one pair {shown!r}, not a list of pairs; pass [{tuple(items)!r}]"
        )
    checked: list[tuple[str, str]] = []
    for index, pair in enumerate(items):
        where = f"logprob_mismatch: pairs[{index}] = {pair!r}"
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ConfigurationError(f"{where} is not a (trainer, sampler) pair of two variant names; {usage}")
        for variant in pair:
            if not isinstance(variant, str):
                raise ConfigurationError(f"{where}: {variant!r} is not a variant name (a str); {usage}")
        trainer, sampler = pair
        if trainer == sampler:
            raise ConfigurationError(
                f"{where} pairs {trainer!r} with itself: its mismatch is zero by construction; pair a trainer "
                "variant with a different sampler variant"
            )
        names = [f"{a} vs {b}" for a, b in checked]
        if f"{trainer} vs {sampler}" in names:  # the same pair, or one whose "<trainer> vs <sampler>" name is the same
            first = names.index(f"{trainer} vs {sampler}")
            raise ConfigurationError(
                f"{where} repeats pairs[{first}] = {checked[first]!r} (each pair is one variant "
                f"'{trainer} vs {sampler}' of the result); give each pair once"
            )
        for variant in pair:
            if variant not in known:
                raise ConfigurationError(
                    f"{where}: no log-probabilities of variant {variant!r} in this report; variants with them: "
                    f"{', '.join(known) or 'none'} (compare() keeps them in memory for causal LMs, not in files)"
                )
        checked.append((trainer, sampler))
    return checked


@dataclass
class PrecisionReport(ReportData):
    """Records of every variant against the reference, in capture (execution) order."""

    def logprob_mismatch(self, pairs: Iterable[Sequence[str]], *, clip_eps: float | None = None) -> PrecisionReport:
        """Trainer-vs-sampler mismatch of pairs of this report's variants, in one report: per pair (trainer,
        sampler) a variant "<trainer> vs <sampler>" with one "logprob" row as compare_logprobs(trainer, sampler)
        gives it: delta = logpi_trainer - logpi_sampler (the log of RL's importance ratio) and its statistics,
        and the decomposition against this report's reference, the same for both sides (rms_floor 0): rho is
        the correlation of the two variants' own errors, rms_e_diff the size of the mismatch. Gate it with
        assert_precision_within like any report. The log-probs are kept in memory by compare() for causal LMs
        (not in report files). `pairs` is a list (tuple, iterator) of pairs, all checked before any is measured:
        anything else is a ConfigurationError naming the pair."""
        merged: PrecisionReport | None = None
        for trainer, sampler in _mismatch_pairs(pairs, list(self.token_logprobs)):
            name = f"{trainer} vs {sampler}"
            pair = compare_logprobs(
                self.token_logprobs[trainer].cpu(),
                self.token_logprobs[sampler].cpu(),
                ref_a=self.reference_logprobs.cpu(),
                ref_b=self.reference_logprobs.cpu(),
                mask=self.logprob_mask.cpu(),
                clip_eps=DEFAULT_CLIP_EPS if clip_eps is None else clip_eps,
                names=(name, "sampler"),
            )
            if merged is None:
                merged = PrecisionReport(reference=pair.reference, device=self.device)
            merged.add(name, pair.runs[name], pair.records(name), [])
        assert merged is not None
        return merged

    def routing_mismatch(self, trainer: str, sampler: str | None = None) -> dict[str, float]:
        """Per router (by label), the share of the counted tokens whose top-k expert set differs between the runs of
        `trainer` and `sampler` (None: the reference): e.g. a trainer variant against a sampler (decode) variant.
        From the routing compare() keeps in memory for mixture-of-experts models (not in report files)."""
        from pytest_precision.numbers.routing import routing_mismatch

        return routing_mismatch(self.routing_choices, self.reference_routing, self.routing_index, trainer, sampler)

    def format(self, *, full: bool = True) -> str:
        """The error-propagation summary per variant and, with `full`, every tensor's row."""
        return format_report(self, full=full)

    def format_kl_divergence(self) -> str:
        """Every statistic llama.cpp's `llama-perplexity --kl-divergence` prints (perplexities and their ratio,
        KLD, Δp, same top p), per variant, line for line in its layout: what quantized models are compared by
        (see pytest_precision.numbers.token_stats and reports.llama_cpp). "" without logprob rows."""
        return "\n".join(kl_divergence_lines(self))

    def __str__(self) -> str:
        return self.format()


def compare_logprobs(
    a: LogprobSource,
    b: LogprobSource,
    *,
    ref_a: LogprobSource | None = None,
    ref_b: LogprobSource | None = None,
    mask: LogprobSource | None = None,
    clip_eps: float = DEFAULT_CLIP_EPS,
    names: tuple[str, str] = ("a", "b"),
) -> PrecisionReport:
    """Compare chosen-token log-probabilities `a` (the variant) against `b` (the reference), in float64.

    Each of a, b, ref_a, ref_b is a tensor, a NumPy array, or the path of a .pt / .safetensors / .npy file
    holding one (a file of several tensors must name it "logprobs"), of shape (tokens,) or (batch, tokens),
    all alike; a 1-D vector is one sequence. `mask` (bool or 0/1, same shape) leaves out its False positions.
    Positions where b is NaN/Inf are left out; where only a is, they count in `nonfinite` and nowhere else.

    The report's one record, "logprob" (kind "logprob") of variant names[0] against reference names[1],
    holds tensor_error(b, a) and the log-ratio statistics of delta = a - b (see logprobs.log_ratio_stats,
    with PPO's clip band [1 - clip_eps, 1 + clip_eps]); with both ref_a and ref_b, also the decomposition
    delta = floor + e_a - e_b (rho, rms_e_a, rms_e_b, rms_e_diff, rms_floor; see `decomposition`).
    """
    record, token_count = logprob_record(a, b, ref_a=ref_a, ref_b=ref_b, mask=mask, clip_eps=clip_eps, names=names)
    variant_name, reference_name = names

    def run_info(name: str) -> RunInfo:
        return RunInfo(
            variant={"name": name, "source": "external"},
            parameter_dtypes={},
            buffer_dtypes={},
            input_shapes={"logprobs": list(record.shape)},
            token_count=token_count,
            backend={"settings": {}, "no_effect": []},
        )

    report = PrecisionReport(reference=run_info(reference_name), device="cpu")
    report.add(variant_name, run_info(variant_name), [record], [])
    return report


__all__ = ["KINDS", "METRIC_NAMES", "PrecisionReport", "Record", "RunInfo", "compare_logprobs"]
