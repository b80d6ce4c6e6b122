"""Record types every layer shares: the metric names and their directions, one tensor's error (TensorError),
one captured tensor's record (Record), what one run was (RunInfo), and the records of a comparison (ReportData,
the data half of PrecisionReport). Frozen dataclasses of plain floats, JSON-ready; nothing here computes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

Direction = Literal["lower", "higher", "unit"]

#: Whether a smaller ("lower"), larger ("higher") or closer-to-one ("unit": |1 - value|) value is better.
METRIC_DIRECTIONS: dict[str, Direction] = {
    "ref_rms": "lower",
    "rms_abs": "lower",
    "rms_rel": "lower",
    "max_abs": "lower",
    "max_rel": "lower",
    "bias_abs": "lower",
    "bias_rel": "lower",
    "correlation": "higher",
    "slope": "unit",
    "residual_rms_rel": "lower",
    "cosine": "higher",
    "sqnr_db": "higher",
    "nonfinite": "lower",
    # Log-ratio statistics of chosen-token log-probabilities (kind "logprob"), see logprobs.py.
    "delta_mean": "lower",
    "delta_rms": "lower",
    "delta_max_abs": "lower",
    "clip_fraction": "lower",
    "seq_delta_mean": "lower",
    "seq_delta_std": "lower",
    "seq_delta_rms": "lower",
    "seq_delta_max": "lower",
    "kl_mean": "lower",
    "kl_max": "lower",
    "top1_agreement": "higher",
    # llama.cpp's KL-divergence statistics of logprob rows (see token_stats.py). The Δp location statistics
    # are signed (SIGNED_METRICS): their magnitude is gated, a tail toward losing probability as one toward
    # gaining it.
    "kl_mean_se": "lower",
    "kl_median": "lower",
    "kl_p90": "lower",
    "kl_p99": "lower",
    "kl_p999": "lower",
    "dp_mean": "lower",
    "dp_mean_se": "lower",
    "dp_rms": "lower",
    "dp_rms_se": "lower",
    "dp_p1": "lower",
    "dp_p5": "lower",
    "dp_p95": "lower",
    "dp_p99": "lower",
    "dp_min": "lower",
    "dp_max": "lower",
    "top1_agreement_se": "lower",
    "ppl_ratio": "unit",
    "ppl_ratio_se": "lower",
    "ln_ppl_corr": "higher",
    "kl_p95": "lower",
    "kl_p10": "lower",
    "kl_p5": "lower",
    "kl_p1": "lower",
    "kl_p01": "lower",
    "kl_min": "lower",
    "dp_p999": "lower",
    "dp_p90": "lower",
    "dp_p75": "lower",
    "dp_median": "lower",
    "dp_p25": "lower",
    "dp_p10": "lower",
    "dp_p01": "lower",
    "ppl_variant": "lower",
    "ppl_variant_se": "lower",
    "ppl_reference": "lower",
    "ppl_reference_se": "lower",
    # Routing rows of mixture-of-experts routers (kind "routing", see numbers/routing.py).
    "expert_agreement": "higher",
    "top1_changed": "lower",
    "experts_changed": "lower",
    "load_shift": "lower",
    "flip_margin_median": "lower",
    "flip_margin_max": "lower",
    "margin_median": "lower",
    # Cross-engine decomposition delta = floor + (e_a - e_b), see cross_engine.py.
    "rho": "higher",
    "rms_e_a": "lower",
    "rms_e_b": "lower",
    "rms_e_diff": "lower",
    "rms_floor": "lower",
    # Range statistics (compare(range_stats=True)), see RangeStats. All "lower": a fraction of elements lost to
    # underflow or overflow is harm done by the variant's dtype, and a bound on the reference's own largest
    # magnitude or dynamic range (descriptive of the reference, but what decides whether a narrow dtype can
    # hold it) is a maximum, "activations stay below 1e4 so that fp16 keeps headroom".
    "underflow_frac": "lower",
    "zero_frac": "lower",
    "overflow_frac": "lower",
    "ref_absmax": "lower",
    "dynamic_range_log2": "lower",
}

#: llama.cpp's KL-divergence statistics of logprob rows, the fields of numbers.token_stats.TokenStats.
TOKEN_STAT_METRICS: tuple[str, ...] = (
    "kl_mean_se",
    "kl_median",
    "kl_p90",
    "kl_p99",
    "kl_p999",
    "dp_mean",
    "dp_mean_se",
    "dp_rms",
    "dp_rms_se",
    "dp_p1",
    "dp_p5",
    "dp_p95",
    "dp_p99",
    "dp_min",
    "dp_max",
    "top1_agreement_se",
    "ppl_ratio",
    "ppl_ratio_se",
    "ln_ppl_corr",
    "kl_p95",
    "kl_p10",
    "kl_p5",
    "kl_p1",
    "kl_p01",
    "kl_min",
    "dp_p999",
    "dp_p90",
    "dp_p75",
    "dp_median",
    "dp_p25",
    "dp_p10",
    "dp_p01",
    "ppl_variant",
    "ppl_variant_se",
    "ppl_reference",
    "ppl_reference_se",
)
#: The Δp location statistics among them: signed, gated by magnitude.
DP_LOCATION_METRICS = (
    "dp_mean",
    "dp_p1",
    "dp_p5",
    "dp_p95",
    "dp_p99",
    "dp_min",
    "dp_max",
    "dp_p999",
    "dp_p90",
    "dp_p75",
    "dp_median",
    "dp_p25",
    "dp_p10",
    "dp_p01",
)

#: The routing metrics of routing rows (numbers.routing.RoutingStats).
ROUTING_METRICS: tuple[str, ...] = (
    "expert_agreement",
    "top1_changed",
    "experts_changed",
    "load_shift",
    "flip_margin_median",
    "flip_margin_max",
    "margin_median",
)
#: Routing metrics a routing row is always gated on, whatever metrics the gate is given: a flipped expert is the
#: error a routing row exists to catch (its rms_rel covers the weights of the tokens whose experts agree).
ROUTING_GATED_METRICS: tuple[str, ...] = ("expert_agreement", "experts_changed")

#: Metrics only some records carry (log-probability rows); None elsewhere and left out of their JSON.
OPTIONAL_METRICS: tuple[str, ...] = (
    "delta_mean",
    "delta_rms",
    "delta_max_abs",
    "clip_fraction",
    "seq_delta_mean",
    "seq_delta_std",
    "seq_delta_rms",
    "seq_delta_max",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    *TOKEN_STAT_METRICS,
    *ROUTING_METRICS,
    "rho",
    "rms_e_a",
    "rms_e_b",
    "rms_e_diff",
    "rms_floor",
    "underflow_frac",
    "zero_frac",
    "overflow_frac",
    "ref_absmax",
    "dynamic_range_log2",
)

#: Metrics describing the reference, or one run on its own rather than its error, never gated (the perplexities:
#: their ratio is the error).
DESCRIPTIVE_METRICS = frozenset(
    {"ref_rms", "margin_median", "ppl_variant", "ppl_variant_se", "ppl_reference", "ppl_reference_se"}
)

#: Signed metrics whose magnitude is what matters (the gate compares |value|).
SIGNED_METRICS = frozenset({"bias_abs", "bias_rel", "delta_mean", "seq_delta_mean", *DP_LOCATION_METRICS})


@dataclass(frozen=True)
class TensorError:
    """Error of one variant tensor against its reference. Undefined values are None.

    count: elements compared (both finite, not masked out).
    ref_rms: sqrt(mean(x^2)).
    rms_abs: sqrt(mean((y-x)^2)); rms_rel = rms_abs / ref_rms (None when ref_rms is 0).
    max_abs: max|y-x|; max_rel = max_abs / ref_rms.
    bias_abs: mean(y-x); bias_rel = bias_abs / ref_rms.
    correlation: centred Pearson correlation of x and y (None when either is constant).
    slope: cov(x,y) / var(x), the least-squares fit y ~ slope*x + c (None when x is constant).
    residual_rms_rel: RMS of y about that fit over ref_rms, sqrt(max(var_y - cov^2/var_x, 0)) / ref_rms.
    cosine: sum(xy) / sqrt(sum(x^2) sum(y^2)) (None when either is all zeros).
    sqnr_db: 10 log10(sum x^2 / sum (y-x)^2); +inf when y equals x, -inf when x is all zeros and y is not.
    nonfinite: count of NaN/Inf in y where x is finite.
    """

    count: int
    ref_rms: float | None
    rms_abs: float | None
    rms_rel: float | None
    max_abs: float | None
    max_rel: float | None
    bias_abs: float | None
    bias_rel: float | None
    correlation: float | None
    slope: float | None
    residual_rms_rel: float | None
    cosine: float | None
    sqnr_db: float | None
    nonfinite: int


METRIC_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TensorError) if f.name != "count")


#: Propagated kinds, the parameters' cast ("weight_cast", compare(weight_cast=True): next to the gradients, one row
#: per parameter), then the isolated ones (see pytest_precision.engine.isolated).
#: Routing rows (a mixture-of-experts router's expert choice) come first: a router's flip is where an MoE's error
#: jumps, and the first failing row a gate names should be the flipped router, not the blocks after it.
KINDS = (
    "routing",
    "fw",
    "logprob",
    "loss",
    "bw",
    "grad",
    "weight_cast",
    "routing_isolated",
    "fw_isolated",
    "bw_isolated",
    "grad_isolated",
)


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
    # Logprob rows only: llama.cpp's KL-divergence statistics (token_stats.TokenStats).
    kl_mean_se: float | None = None
    kl_median: float | None = None
    kl_p90: float | None = None
    kl_p99: float | None = None
    kl_p999: float | None = None
    dp_mean: float | None = None
    dp_mean_se: float | None = None
    dp_rms: float | None = None
    dp_rms_se: float | None = None
    dp_p1: float | None = None
    dp_p5: float | None = None
    dp_p95: float | None = None
    dp_p99: float | None = None
    dp_min: float | None = None
    dp_max: float | None = None
    top1_agreement_se: float | None = None
    ppl_ratio: float | None = None
    ppl_ratio_se: float | None = None
    ln_ppl_corr: float | None = None
    kl_p95: float | None = None
    kl_p10: float | None = None
    kl_p5: float | None = None
    kl_p1: float | None = None
    kl_p01: float | None = None
    kl_min: float | None = None
    dp_p999: float | None = None
    dp_p90: float | None = None
    dp_p75: float | None = None
    dp_median: float | None = None
    dp_p25: float | None = None
    dp_p10: float | None = None
    dp_p01: float | None = None
    ppl_variant: float | None = None
    ppl_variant_se: float | None = None
    ppl_reference: float | None = None
    ppl_reference_se: float | None = None
    # Routing rows only (numbers.routing.RoutingStats); their error metrics are those of the routing weights on the
    # tokens whose experts agree.
    expert_agreement: float | None = None
    top1_changed: float | None = None
    experts_changed: float | None = None
    load_shift: float | None = None
    flip_margin_median: float | None = None
    flip_margin_max: float | None = None
    margin_median: float | None = None
    # Cross-engine rows only: the error decomposition against each side's own reference.
    rho: float | None = None
    rms_e_a: float | None = None
    rms_e_b: float | None = None
    rms_e_diff: float | None = None
    rms_floor: float | None = None
    # compare(range_stats=True) only, not on logprob and loss rows: range_stats.RangeStats of the reference tensor
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


def forward_only(variant: dict[str, Any]) -> bool:
    """Whether a run described by `variant` (RunInfo.variant) made no backward: an arrangement, or quantize."""
    return bool(variant.get("arrangement") or variant.get("quantize"))


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
    #: A format below 16 bits: {"format", "kernels" ("native", "emulated", "plain casts"), "modules" (how many
    #: took it), "torchao" (its version)}; None for the others.
    lowbit: dict[str, Any] | None = None
    #: A compiled run (engine.compile_build.CompileWatch.facts): the torch.compile spec, the numeric Inductor
    #: settings, the compiled regions and the graph breaks; None for eager runs.
    compiled: dict[str, Any] | None = None
    #: Another implementation's run (engine.port_build.PortModel.facts): its name and class, the module map, the
    #: parameters whose weights were checked equal, and the modules of either side left unmapped; None otherwise.
    port: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; `repeats` only when more than one, `lowbit`, `compiled` and `port` only when set, keeping other
        baselines unchanged."""
        data = dataclasses.asdict(self)
        if self.repeats == 1:
            del data["repeats"]
        for optional in ("lowbit", "compiled", "port"):
            if data[optional] is None:
                del data[optional]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunInfo:
        values: dict[str, Any] = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        return cls(**values)


_Report = TypeVar("_Report", bound="ReportData")


@dataclass
class ReportData:
    """Records of every variant against the reference, in capture (execution) order: the data of a
    PrecisionReport (pytest_precision.reports.report), which adds what needs the layers above."""

    reference: RunInfo
    device: str
    runs: dict[str, RunInfo] = field(default_factory=dict)
    _records: dict[str, list[Record]] = field(default_factory=dict)
    missing: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    #: Variant -> where its first NaN/Inf appeared, "module.name (fw)" or "module.name (bw)" (see compare).
    nonfinite_origin: dict[str, str] = field(default_factory=dict)
    #: Compiled variant -> what compiling cost in its run (engine.compile_build.CompileWatch.cost).
    compile_costs: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Under torch.distributed: {"world_size": N, "mesh": [..] or None, "mesh_dims": [..] or None}; else empty.
    distributed: dict[str, Any] = field(default_factory=dict)
    #: For a causal LM, in memory only (not in the report's files): each variant's chosen-token log-probs
    #: (batch, seq - 1), the reference's, and which positions count; see logprob_mismatch.
    token_logprobs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    reference_logprobs: Any = field(default=None, repr=False, compare=False)
    logprob_mask: Any = field(default=None, repr=False, compare=False)
    #: For a mixture-of-experts model, in memory only: each run's routing tensors by router label (the reference's
    #: apart), the flat indices of the positions that count (None: all), and per variant and router the
    #: reference's margins of the tokens whose experts changed; see routing_mismatch and engine/routers.py.
    routing_choices: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)
    reference_routing: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    routing_index: Any = field(default=None, repr=False, compare=False)
    flip_margins: dict[str, dict[str, list[float]]] = field(default_factory=dict, repr=False, compare=False)

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
    def from_dict(cls: type[_Report], data: dict[str, Any]) -> _Report:
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
