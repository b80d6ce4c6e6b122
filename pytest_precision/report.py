"""The result of a comparison: per variant, one record per captured tensor, plus what each run was."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .metrics import METRIC_NAMES, OPTIONAL_METRICS, TensorError

#: Propagated kinds, the parameters' cast ("weight_cast", compare(weight_cast=True): next to the gradients, one row
#: per parameter), then the isolated ones (see pytest_precision.isolated).
KINDS = ("fw", "logprob", "loss", "bw", "grad", "weight_cast", "fw_isolated", "bw_isolated", "grad_isolated")


def kind_rank(kind: str) -> int:
    """Display and gate order of kinds: forward rows, the loss, backward rows, parameter gradients, weights."""
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


_ERROR_FIELDS = dataclasses.fields(TensorError)


@dataclass(frozen=True)
class Record(TensorError):
    """The error of one tensor of one variant; each metric of TensorError is an attribute."""

    name: str = ""
    kind: str = ""
    shape: tuple[int, ...] = ()
    # Log-probability rows only (None elsewhere): statistics of delta = logpi_variant - logpi_reference.
    delta_mean: float | None = None
    delta_rms: float | None = None
    delta_max_abs: float | None = None
    clip_fraction: float | None = None
    seq_delta_mean: float | None = None
    seq_delta_std: float | None = None
    seq_delta_rms: float | None = None
    seq_delta_max: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    # Cross-engine rows only: the error decomposition against each side's own reference.
    rho: float | None = None
    rms_e_a: float | None = None
    rms_e_b: float | None = None
    rms_e_diff: float | None = None
    rms_floor: float | None = None
    # compare(range_stats=True) only, not on logprob and loss rows: metrics.RangeStats of the reference tensor
    # in the variant's compute dtype (bw and grad rows at the variant's loss scale).
    underflow_frac: float | None = None
    zero_frac: float | None = None
    overflow_frac: float | None = None
    ref_absmax: float | None = None
    dynamic_range_log2: float | None = None
    # compare(repeats > 1) only: run-to-run noise of rms_rel, see compare.
    spread: float | None = None

    @classmethod
    def from_error(cls, name: str, kind: str, shape: tuple[int, ...], error: TensorError, **extra: Any) -> Record:
        values = {f.name: getattr(error, f.name) for f in _ERROR_FIELDS}  # flat: asdict would deep-copy
        return cls(**values, name=name, kind=kind, shape=tuple(shape), **extra)

    def metric(self, metric: str) -> float | None:
        """A metric by name (None when undefined)."""
        value = getattr(self, metric)
        return None if value is None else float(value)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; optional metrics appear only where defined, keeping baseline lines short."""
        data = dataclasses.asdict(self)
        data["shape"] = list(self.shape)
        for metric in (*OPTIONAL_METRICS, "spread"):
            if data[metric] is None:
                del data[metric]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        values: dict[str, Any] = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        values["shape"] = tuple(data.get("shape") or ())
        values["count"] = int(data.get("count") or 0)
        values["nonfinite"] = int(data.get("nonfinite") or 0)
        return cls(**values)


@dataclass(frozen=True)
class RunInfo:
    """What one run was: its spec, the dtypes it held, its inputs and the backend settings it pinned."""

    variant: dict[str, Any]
    parameter_dtypes: dict[str, int]
    buffer_dtypes: dict[str, int]
    input_shapes: dict[str, list[int]]
    token_count: int | None
    backend: dict[str, Any]
    #: fp16 gradient loss scale of this run (None when the run was not scaled).
    loss_scale: float | None = None
    #: Parameter name -> "lm_head", "embedding", "linear", "norm", "bias" or "other" (tied parameters once).
    parameter_categories: dict[str, str] = field(default_factory=dict)
    #: Whether the output head shares its weight with the input embedding.
    tied_head: bool | None = None
    #: Runs of this variant compare(repeats=...) made to measure run-to-run noise.
    repeats: int = 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; `repeats` only when more than one, keeping single-run baselines unchanged."""
        data = dataclasses.asdict(self)
        if self.repeats == 1:
            del data["repeats"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunInfo:
        values: dict[str, Any] = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        return cls(**values)


def _mismatch_pairs(pairs: object, known: list[str]) -> list[tuple[str, str]]:
    """The (trainer, sampler) pairs of PrecisionReport.logprob_mismatch, every one checked before any is measured:
    a list (or tuple) of pairs of two different variant names of `known` (the variants whose log-probs the report
    holds), no pair twice. Anything else is a ConfigurationError naming the pair and saying what to pass."""
    from .errors import ConfigurationError

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
class PrecisionReport:
    """Records of every variant against the reference, in capture (execution) order."""

    reference: RunInfo
    device: str
    runs: dict[str, RunInfo] = field(default_factory=dict)
    _records: dict[str, list[Record]] = field(default_factory=dict)
    missing: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    #: Variant -> where its first NaN/Inf appeared, "module.name (fw)" or "module.name (bw)" (see compare).
    nonfinite_origin: dict[str, str] = field(default_factory=dict)
    #: Under torch.distributed: {"world_size": N, "mesh": [..] or None, "mesh_dims": [..] or None}; else empty.
    distributed: dict[str, Any] = field(default_factory=dict)
    #: For a causal LM, in memory only (not in the report's files): each variant's chosen-token log-probs
    #: (batch, seq - 1), the reference's, and which positions count; see logprob_mismatch.
    token_logprobs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    reference_logprobs: Any = field(default=None, repr=False, compare=False)
    logprob_mask: Any = field(default=None, repr=False, compare=False)

    @property
    def variants(self) -> list[str]:
        """Variant names, in the order they ran."""
        return list(self.runs)

    def records(self, variant: str, kind: str | None = None) -> list[Record]:
        """The variant's records (optionally of one kind), in execution order."""
        if variant not in self._records:
            raise KeyError(f"no variant {variant!r} in this report; variants: {', '.join(self.variants)}")
        rows = self._records[variant]
        return [r for r in rows if kind is None or r.kind == kind]

    def get(self, variant: str, name: str, kind: str = "fw") -> Record:
        """One record by variant, tensor name and kind."""
        for record in self.records(variant):
            if record.name == name and record.kind == kind:
                return record
        names = [r.name for r in self.records(variant, kind)]
        raise KeyError(f"variant {variant!r} has no {kind} tensor {name!r}; {kind} tensors: {', '.join(names)}")

    def add(self, variant: str, run: RunInfo, records: list[Record], missing: list[tuple[str, str]]) -> None:
        self.runs[variant] = run
        # Grouped by kind, each kind in capture order: forward order, backward order, gradient order.
        self._records[variant] = sorted(records, key=lambda r: kind_rank(r.kind))
        self.missing[variant] = missing

    def logprob_mismatch(self, pairs: Iterable[Sequence[str]], *, clip_eps: float | None = None) -> PrecisionReport:
        """Trainer-vs-sampler mismatch of pairs of this report's variants, in one report: per pair (trainer,
        sampler) a variant "<trainer> vs <sampler>" with one "logprob" row as compare_logprobs(trainer, sampler)
        gives it: delta = logpi_trainer - logpi_sampler (the log of RL's importance ratio) and its statistics,
        and the decomposition against this report's reference, the same for both sides (rms_floor 0): rho is
        the correlation of the two variants' own errors, rms_e_diff the size of the mismatch. Gate it with
        assert_precision_within like any report. The log-probs are kept in memory by compare() for causal LMs
        (not in report files). `pairs` is a list (tuple, iterator) of pairs, all checked before any is measured:
        anything else is a ConfigurationError naming the pair."""
        from .cross_engine import compare_logprobs
        from .logprobs import DEFAULT_CLIP_EPS

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

    def format(self, *, full: bool = True) -> str:
        """The error-propagation summary per variant and, with `full`, every tensor's row."""
        from .tables import format_report

        return format_report(self, full=full)

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "reference": self.reference.to_dict(),
            "variants": {
                name: {
                    "run": self.runs[name].to_dict(),
                    "records": [r.to_dict() for r in self._records[name]],
                    "missing": [list(m) for m in self.missing.get(name, [])],
                }
                for name in self.variants
            },
            "order": self.variants,
            "nonfinite_origin": dict(self.nonfinite_origin),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrecisionReport:
        report = cls(reference=RunInfo.from_dict(data["reference"]), device=data.get("device", "cpu"))
        variants = data["variants"]
        for name in data.get("order") or list(variants):
            entry = variants[name]
            report.add(
                name,
                RunInfo.from_dict(entry["run"]),
                [Record.from_dict(r) for r in entry["records"]],
                [(m[0], m[1]) for m in entry.get("missing", [])],
            )
        report.nonfinite_origin = dict(data.get("nonfinite_origin") or {})
        return report


__all__ = ["KINDS", "METRIC_NAMES", "PrecisionReport", "Record", "RunInfo"]
