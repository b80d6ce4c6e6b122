"""Text tables of a report: the error-propagation summary (first -> mid median -> mid max -> last) per kind
with one row per variant, parameter gradients and weight casts by category, then every tensor of every
variant (with range-statistics columns when the report has them, compare(range_stats=True)).

Relative errors print in percent; a column's decimals adapt so that its smallest non-zero value still
shows two significant digits.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pytest_precision.base.records import forward_only

if TYPE_CHECKING:
    from pytest_precision.base.records import Record
    from pytest_precision.base.records import ReportData as PrecisionReport

SUMMARY_KINDS = ("fw", "bw", "grad")
_MIN_DECIMALS = 3
_MAX_DECIMALS = 10


def format_number(value: float | None) -> str:
    """4 significant digits; '-' for undefined, 'inf' / '-inf' for infinities."""
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def percent_column(values: Sequence[float | None]) -> list[str]:
    """Percentages with one decimal count per column: enough for two significant digits of the smallest."""
    nonzero = [abs(v) * 100 for v in values if v is not None and math.isfinite(v) and v != 0]
    decimals = _MIN_DECIMALS
    if nonzero:
        smallest = min(nonzero)
        decimals = min(max(_MIN_DECIMALS, 1 - math.floor(math.log10(smallest))), _MAX_DECIMALS)
    return [_percent(v, decimals) for v in values]


def _percent(value: float | None, decimals: int) -> str:
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return str(value)
    return f"{value * 100:.{decimals}f}%"


def _plain(value: float | None, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, spec)


def render(header: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "  ", left: int = 1) -> list[str]:
    """The first `left` columns (names) left-aligned, numbers right-aligned, one line per row."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(c).ljust(w) if i < left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return (indent + "  ".join(parts)).rstrip()

    return [line(header), *(line(r) for r in rows)]


def propagation(records: Sequence[Record], metric: str = "rms_rel") -> tuple[list[float | None], list[str]]:
    """(first, mid median, mid max, last) of a metric over records in order, and the first/last names."""
    values = [r.metric(metric) for r in records]
    if not values:
        return [None, None, None, None], ["-", "-"]
    middle = [v for v in values[1:-1] if v is not None and not math.isnan(v)]
    median = statistics.median(middle) if middle else None
    peak = max(middle) if middle else None
    return [values[0], median, peak, values[-1]], [records[0].name, records[-1].name]


def summary_rows(report: PrecisionReport, kind: str) -> list[tuple[str, list[Record]]]:
    """The rows of `kind`'s summary: (label, records) per variant, each followed by its isolated records
    (label "<variant> isolated", see pytest_precision.engine.isolated) when it has any; variants without records of
    `kind` keep their row when another variant has some, but for arrangements' backward (forward only)."""
    rows: list[tuple[str, list[Record]]] = []
    for variant in report.variants:
        if kind in ("bw", "grad") and forward_only(report.runs[variant].variant):
            continue
        rows.append((variant, report.records(variant, kind)))
        isolated = report.records(variant, f"{kind}_isolated")
        if isolated:
            rows.append((f"{variant} isolated", isolated))
    return rows if any(records for _, records in rows) else []


def summary_values(
    summary: Sequence[tuple[str, Sequence[Record]]], metric: str
) -> tuple[list[list[float | None]], tuple[str, str]]:
    """propagation() of each summary row, and the first and last tensor names of the first row with records; a
    row whose first or last tensor is another one (an isolated bw row starts at the head, not the logits)
    shows None there."""
    results = [propagation(records, metric) for _, records in summary]
    first, last = next(names for (_, names), (_, records) in zip(results, summary, strict=True) if records)
    values = []
    for row, (ends_first, ends_last) in results:
        row = list(row)
        if ends_first != first:
            row[0] = None
        if ends_last != last:
            row[3] = None
        values.append(row)
    return values, (first, last)


def summary_table(report: PrecisionReport, kind: str, metric: str = "rms_rel") -> list[str]:
    """One row per variant (and per isolated variant): the metric at the first tensor, the median and max in
    between, the last."""
    summary = summary_rows(report, kind)
    if not summary:
        return []
    values, (first, last) = summary_values(summary, metric)
    columns = list(zip(*values, strict=True))
    formatted = [percent_column(list(column)) for column in columns]
    header = [kind, f"first ({first})", "mid median", "mid max", f"last ({last})"]
    rows = [[label, *(column[i] for column in formatted)] for i, (label, _) in enumerate(summary)]
    return render(header, rows)


#: Range-statistics columns of the per-tensor table: (header, metric), fractions in percent.
RANGE_COLUMNS = (
    ("underflow", "underflow_frac"),
    ("zero", "zero_frac"),
    ("overflow", "overflow_frac"),
    ("absmax", "ref_absmax"),
    ("range_log2", "dynamic_range_log2"),
)


def _range_cells(records: Sequence[Record]) -> tuple[list[str], list[list[str]]]:
    """The range-statistics header and cells per record; none when no record carries them."""
    if not any(r.metric(metric) is not None for r in records for _, metric in RANGE_COLUMNS):
        return [], [[] for _ in records]
    fractions = {m: percent_column([r.metric(m) for r in records]) for _, m in RANGE_COLUMNS[:3]}
    cells = [
        [
            *(fractions[m][i] for _, m in RANGE_COLUMNS[:3]),
            _plain(r.ref_absmax, ".3g"),
            _plain(r.dynamic_range_log2, ".1f"),
        ]
        for i, r in enumerate(records)
    ]
    return [header for header, _ in RANGE_COLUMNS], cells


def tensor_table(records: Sequence[Record]) -> list[str]:
    """Every record of one variant, grouped by kind, with the main metrics (and the range statistics of the
    reference in the variant's dtype, when the records carry them)."""
    header = [
        "tensor",
        "kind",
        "rms_rel",
        "max_rel",
        "bias_rel",
        "resid_rel",
        "corr",
        "slope",
        "sqnr_dB",
        "nonfin",
    ]
    rel = {m: percent_column([r.metric(m) for r in records]) for m in ("rms_rel", "max_rel", "bias_rel")}
    residual = percent_column([r.metric("residual_rms_rel") for r in records])
    range_header, range_cells = _range_cells(records)
    header += range_header
    rows = [
        [
            r.name,
            r.kind,
            rel["rms_rel"][i],
            rel["max_rel"][i],
            rel["bias_rel"][i],
            residual[i],
            _plain(r.correlation, ".6f"),
            _plain(r.slope, ".5f"),
            _plain(r.sqnr_db, ".1f"),
            str(r.nonfinite),
            *range_cells[i],
        ]
        for i, r in enumerate(records)
    ]
    return render(header, rows, left=2)


def _median_and_max(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return (statistics.median(finite), max(finite)) if finite else (None, None)


def gradient_category_table(report: PrecisionReport, metric: str = "rms_rel", kind: str = "grad") -> list[str]:
    """Parameter gradients (or, with kind "weight_cast", the parameters' casts) by category: the LM head (n/a when
    tied to the embedding), linear weights and norm weights (median and max), biases when the model has any,
    and the embedding; gradients with each variant's loss scale."""
    categories = report.reference.parameter_categories
    if not categories or not any(report.records(v, kind) for v in report.variants):
        return []
    gradients = kind == "grad"
    has_bias = "bias" in categories.values()
    header = [kind, "lm_head", "linear med", "linear max", "norm med", "norm max"]
    header += ["bias med", "bias max"] if has_bias else []
    header += ["embedding", "loss scale"] if gradients else ["embedding"]
    columns: list[list[float | None]] = [[] for _ in header[1 : -1 if gradients else None]]
    variants = [v for v in report.variants if report.records(v, kind)]
    for variant in variants:
        by_category: dict[str, list[float | None]] = {}
        for record in report.records(variant, kind):
            by_category.setdefault(categories.get(record.name, "other"), []).append(record.metric(metric))
        head = by_category.get("lm_head", [None])
        cells = [head[0] if head else None]
        cells += [*_median_and_max(by_category.get("linear", [])), *_median_and_max(by_category.get("norm", []))]
        cells += list(_median_and_max(by_category.get("bias", []))) if has_bias else []
        embedding = by_category.get("embedding", [None])
        cells.append(embedding[0] if embedding else None)
        for column, cell in zip(columns, cells, strict=True):
            column.append(cell)
    formatted = [percent_column(column) for column in columns]
    if report.reference.tied_head:
        formatted[0] = ["n/a (tied)"] * len(variants)
    rows = []
    for i, variant in enumerate(variants):
        row = [variant, *(column[i] for column in formatted)]
        if gradients:
            scale = report.runs[variant].loss_scale
            row.append("-" if scale is None else f"{scale:g}")
        rows.append(row)
    return render(header, rows)


def logprob_table(report: PrecisionReport) -> list[str]:
    """Chosen-token log-probabilities, one row per variant: relative errors, the linear fit, the |logpi|
    scale, and the log-ratio delta = logpi_variant - logpi_reference (in nats)."""
    rows_by_variant = {v: [r for r in report.records(v, "logprob")] for v in report.variants}
    records = [rows[0] for rows in rows_by_variant.values() if rows]
    if not records:
        return []
    variants = [v for v, rows in rows_by_variant.items() if rows]
    relative = {m: percent_column([r.metric(m) for r in records]) for m in ("rms_rel", "bias_rel", "residual_rms_rel")}
    header = ["logprob", "rms_rel", "bias_rel", "resid_rel", "corr", "slope", "max_abs", "scale"]
    header += ["delta_mean", "delta_rms", "delta_max", "clip", "kl_mean", "top1"]
    rows = []
    for i, (variant, r) in enumerate(zip(variants, records, strict=True)):
        rows.append(
            [
                variant,
                relative["rms_rel"][i],
                relative["bias_rel"][i],
                relative["residual_rms_rel"][i],
                _plain(r.correlation, ".6f"),
                _plain(r.slope, ".5f"),
                _plain(r.max_abs, ".3g"),
                _plain(r.ref_rms, ".3g"),
                _plain(r.delta_mean, ".2e"),
                _plain(r.delta_rms, ".3g"),
                _plain(r.delta_max_abs, ".3g"),
                _percent(r.clip_fraction, 2),
                _plain(r.kl_mean, ".2e"),
                _percent(r.top1_agreement, 1),
            ]
        )
    return render(header, rows)


def decomposition_table(report: PrecisionReport) -> list[str]:
    """Cross-engine rows: delta = floor + (e_a - e_b), each side's error against its own reference."""
    rows = [
        [
            variant,
            _plain(r.rho, ".4f"),
            *(_plain(r.metric(m), ".3g") for m in ("rms_e_a", "rms_e_b", "rms_e_diff", "rms_floor")),
        ]
        for variant in report.variants
        for r in report.records(variant, "logprob")
        if r.rho is not None or r.rms_e_a is not None
    ]
    if not rows:
        return []
    return render(["decomposition", "rho", "rms_e_a", "rms_e_b", "rms_e_diff", "rms_floor"], rows)


def routing_cells(report: PrecisionReport, kind: str = "routing") -> tuple[list[str], list[list[str]]]:
    """Per router (in execution order), each variant's share of tokens whose top-k experts agree with the
    reference's, then the flips it made and the median reference margin of those flips: the header and rows of
    the routing table (no rows: the report has no routing rows)."""
    variants = [v for v in report.variants if report.records(v, kind)]
    routers = list(dict.fromkeys(r.name for v in variants for r in report.records(v, kind)))
    rows = []
    for router in routers:
        cells = [router]
        for variant in variants:
            found = [r for r in report.records(variant, kind) if r.name == router]
            record = found[0] if found else None
            agreement = None if record is None else record.expert_agreement
            if agreement is None:
                cells.append("-")
                continue
            flips = round((1 - agreement) * (record.shape[0] if record and record.shape else 0))  # type: ignore[union-attr]
            margin = "" if record.flip_margin_median is None else f", margin {record.flip_margin_median:.3g}"  # type: ignore[union-attr]
            cells.append(f"{100 * agreement:.1f}% ({flips} flip{'' if flips == 1 else 's'}{margin})")
        rows.append(cells)
    return [kind, *variants], rows


def routing_table(report: PrecisionReport) -> list[str]:
    """The routing agreement of every router and variant (see routing_cells); [] without routing rows."""
    header, rows = routing_cells(report)
    if not rows:
        return []
    return [
        "routing: tokens whose top-k experts agree with the reference's (flips, their median reference margin)",
        *render(header, rows),
    ]


def lowbit_lines(report: PrecisionReport) -> list[str]:
    """One line per variant below 16 bits: its format, whether its kernels ran natively or emulated, and how
    many modules took it."""
    lines = []
    for variant in report.variants:
        lowbit = report.runs[variant].lowbit
        if lowbit:
            torchao = f", torchao {lowbit['torchao']}" if lowbit.get("torchao") else ""
            lines.append(
                f"  {variant}: {lowbit['format']}, {lowbit['kernels']}{torchao}, {lowbit['modules']} module(s)"
            )
    return lines


def compiled_lines(report: PrecisionReport) -> list[str]:
    """One line per compiled variant: what it compiled (scope, backend, mode, options), its regions, graph breaks,
    the numeric Inductor settings, and what compiling cost in this run."""
    lines = []
    for variant in report.variants:
        compiled = report.runs[variant].compiled
        if not compiled:
            continue
        spec = [f"{compiled['scope']} torch.compile, backend {compiled['backend']}"]
        spec += [f"mode {compiled['mode']}"] if compiled.get("mode") else []
        spec += ["fullgraph"] if compiled.get("fullgraph") else []
        spec += [f"{key}={value}" for key, value in (compiled.get("options") or {}).items()]
        regions = compiled.get("regions") or []
        breaks = compiled.get("graph_breaks", 0)
        reasons = compiled.get("break_reasons") or []
        why = f" ({reasons[0]})" if breaks and reasons else ""
        split = compiled.get("graphs_per_call", 1)
        graphs = f", up to {split} graphs per region call" if split and split > 1 else ""
        line = f"  {variant}: {', '.join(spec)}; {len(regions)} region(s), {breaks} graph break(s){why}{graphs}"
        cost = getattr(report, "compile_costs", {}).get(variant)
        if cost:
            line += (
                f"; compiling {cost['compile_seconds']:.2f}s of {cost['run_seconds']:.2f}s over {cost['runs']} run(s), "
                f"{cost['compilations']} graph(s)"
            )
        lines.append(line)
        settings = compiled.get("numeric_settings") or {}
        if settings:
            isa = f" (CPU code for {compiled['cpu_isa']})" if compiled.get("cpu_isa") else ""
            lines.append(f"    inductor{isa}: " + ", ".join(f"{key}={value}" for key, value in settings.items()))
    return lines


def port_lines(report: PrecisionReport) -> list[str]:
    """The port lines of the report (see reports.ports.port_lines)."""
    from pytest_precision.reports import ports

    return ports.port_lines(report)


def format_report(report: PrecisionReport, *, full: bool = True, metric: str = "rms_rel") -> str:
    """The summary tables, then (with `full`) each variant's per-tensor table."""
    reference = report.reference.variant.get("name", "fp32")
    where = report.device
    ranks = getattr(report, "distributed", {})
    if ranks:
        mesh = ranks.get("mesh")
        shape = f", mesh {' x '.join(map(str, mesh))}" if mesh else ""
        names = ranks.get("mesh_dims")
        shape += f" ({', '.join(names)})" if mesh and names else ""
        where += f", {ranks['world_size']} ranks{shape}"
    lines = [f"precision: {metric} against the {reference} reference on {where}, in execution order"]
    lines += lowbit_lines(report)
    lines += compiled_lines(report)
    lines += port_lines(report)
    for kind in SUMMARY_KINDS:
        table = summary_table(report, kind, metric)
        if table:
            lines += ["", *table]
    for table in (
        routing_table(report),
        gradient_category_table(report, metric),
        gradient_category_table(report, metric, kind="weight_cast"),
        logprob_table(report),
        decomposition_table(report),
    ):
        if table:
            lines += ["", *table]
    with_loss = [v for v in report.variants if any(r.kind == "loss" for r in report.records(v))]
    if with_loss:
        losses = percent_column([report.get(v, "loss", "loss").metric(metric) for v in with_loss])
        lines += ["", *render(["loss", metric], [[v, losses[i]] for i, v in enumerate(with_loss)])]
    if full:
        for variant in report.variants:
            lines += [
                "",
                f"{variant}: every tensor (mid = excluding first and last)",
                *tensor_table(report.records(variant)),
            ]
            missing = report.missing.get(variant) or []
            if missing:
                lines.append("  missing in this variant: " + ", ".join(f"{n} ({k})" for n, k in missing))
    return "\n".join(lines)
