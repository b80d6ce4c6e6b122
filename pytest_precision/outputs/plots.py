"""Error-vs-depth plots of a report (the `plot` extra: matplotlib).

matplotlib is imported only when a plot is drawn; without it every function here returns None quietly.
Plots are drawn on a standalone Figure with the Agg canvas: pyplot and matplotlib's global state
(backend, rcParams, open figures) are never touched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_precision.base.atomic_files import write_atomically
from pytest_precision.base.records import Record
from pytest_precision.gate.baseline import baseline_stem
from pytest_precision.reports.report import PrecisionReport
from pytest_precision.reports.tables import SUMMARY_KINDS

PANEL_TITLES = {"fw": "forward activations", "bw": "backward (activation gradients)", "grad": "parameter gradients"}


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (the `plot` extra is installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_path(directory: Path, nodeid: str) -> Path:
    """Where a test's plot goes: DIR/<test file, without .py>/<sanitised test name>.png, the layout of the
    baseline files, so that tests of the same name in two files get two plots."""
    file_part = nodeid.split("::", 1)[0] if "::" in nodeid else ""
    folders = [re.sub(r"[^A-Za-z0-9_.\-]+", "_", part) for part in Path(file_part).with_suffix("").parts]
    folders = [part for part in folders if part.strip(".")]  # no "..", ".", or empty components
    return Path(directory, *folders, f"{baseline_stem(nodeid) or 'test'}.png")


def _series(records: Sequence[Record], metric: str) -> tuple[list[int], list[float]]:
    """Depth and value per record; values that cannot be shown on a log scale (None, NaN, inf, <= 0)
    become NaN, which matplotlib leaves as a gap without a warning."""
    values: list[float] = []
    for record in records:
        value = record.metric(metric)
        values.append(value if value is not None and math.isfinite(value) and value > 0 else math.nan)
    return list(range(len(values))), values


def plot_error_vs_depth(
    report: PrecisionReport,
    path: Path,
    *,
    baseline: Mapping[str, list[Record]] | None = None,
    title: str = "",
    metric: str = "rms_rel",
) -> Path | None:
    """One PNG of `metric` against depth (row index in execution order within each kind), panels fw, bw
    and grad, one line per variant (and a dotted one for its isolated error, when measured); the baseline's
    records, when given, dashed in the same colour.

    Returns the path written, or None (writing nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401  (first: a cached submodule must not hide a missing package)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None

    figure: Any = Figure(figsize=(15, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(SUMMARY_KINDS))
    for ax, kind in zip(axes, SUMMARY_KINDS, strict=True):
        drawn = False
        for index, variant in enumerate(report.variants):
            colour = f"C{index % 10}"
            records = report.records(variant, kind)
            depth, values = _series(records, metric)
            if any(not math.isnan(v) for v in values):
                ax.plot(depth, values, color=colour, marker="o", markersize=3, linewidth=1.5, label=variant)
                drawn = True
            isolated = report.records(variant, f"{kind}_isolated")
            depth_of = {record.name: index for index, record in enumerate(records)}
            _, values = _series(isolated, metric)
            # At the depth of the same tensor's propagated row (an isolated bw row has no logits row before it).
            placed = sorted(
                (depth_of.get(record.name, index), value)
                for index, (record, value) in enumerate(zip(isolated, values, strict=True))
            )
            depth, values = [d for d, _ in placed], [v for _, v in placed]
            if any(not math.isnan(v) for v in values):
                ax.plot(
                    depth,
                    values,
                    color=colour,
                    marker="s",
                    markersize=3,
                    linestyle=":",
                    linewidth=1.5,
                    label=f"{variant} isolated",
                )
                drawn = True
            if baseline is not None and variant in baseline:
                old = [r for r in baseline[variant] if r.kind == kind]
                depth, values = _series(old, metric)
                if any(not math.isnan(v) for v in values):
                    ax.plot(
                        depth,
                        values,
                        color=colour,
                        linestyle="--",
                        linewidth=1.2,
                        alpha=0.7,
                        label=f"{variant} (baseline)",
                    )
                    drawn = True
        ax.set_title(f"{kind}: {PANEL_TITLES.get(kind, kind)}", fontsize=10)
        ax.set_xlabel("depth (execution order)")
        if drawn:
            ax.set_yscale("log")
            ax.grid(True, which="major", alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, f"no {kind} rows", ha="center", va="center", transform=ax.transAxes, color="grey")
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0].set_ylabel(f"{metric} (log scale)")
    reference = report.reference.variant.get("name", "fp32")
    figure.suptitle(title or f"{metric} against the {reference} reference on {report.device}", fontsize=11)
    path = Path(path)
    write_atomically(path, lambda temporary: figure.savefig(temporary, format="png"))
    return path


__all__ = ["matplotlib_available", "plot_error_vs_depth", "plot_path"]
