"""What a compiled variant compiled is part of its gate: its torch.compile spec, the Inductor settings that change
numbers, the regions compiled, the graph breaks and the graphs one region's call runs, compared with what its
baseline's run compiled (a run's `compiled` block, see engine.compile_build.CompileWatch.facts).

A compiled variant whose regions split into more graphs, or that compiles other regions or with other settings,
runs other code than its baseline did: its numbers may still pass the tolerance, and the gate says so instead.
The seconds compiling took and the cache's hits are the machine's, not the variant's: they are not compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pytest_precision.gate.lowbit_check import changes_by_variant, recorded_run_blocks, shown_names

if TYPE_CHECKING:
    from pytest_precision.reports.report import PrecisionReport

#: The fields of a `compiled` block the gate compares, in the order a change is named.
GATED_FIELDS = (
    "scope",
    "backend",
    "mode",
    "fullgraph",
    "dynamic",
    "options",
    "numeric_settings",
    "regions",
    "graph_breaks",
    "graphs_per_call",
)


def compile_change(variant: str, recorded: Mapping[str, Any] | None, obtained: Mapping[str, Any] | None) -> str | None:
    """One line saying how this run's compilation differs from the baseline's (`recorded`: the baseline's
    run.compiled of `variant`, None when it ran eager), or None when it does not."""
    if not recorded and not obtained:
        return None
    where = f"variant {variant!r}"
    if not recorded or not obtained:
        then, now = ("compiled" if block else "eager" for block in (recorded, obtained))
        return f"{where}: the baseline's run was {then}, this run is {now}"
    for name in GATED_FIELDS:
        old, new = recorded.get(name), obtained.get(name)
        if old == new:
            continue
        if name == "regions":
            missing = [r for r in old or [] if r not in (new or [])]
            added = [r for r in new or [] if r not in (old or [])]
            parts = [f"missing {shown_names(missing)}"] if missing else []
            parts += [f"added {shown_names(added)}"] if added else []
            detail = "; ".join(parts) or "the same regions in another order"
            return f"{where}: the baseline compiled {len(old or [])} regions, this run {len(new or [])}: {detail}"
        if name == "graph_breaks":
            reasons = list(obtained.get("break_reasons") or [])
            why = f" ({reasons[0]})" if reasons else ""
            return f"{where}: the baseline's run had {old} graph break(s), this run {new}{why}"
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            # Numeric settings one torch has and the other lacks are the torch's difference (the drift rules' to
            # allow for), not the variant's: only settings both runs report are compared.
            keys = sorted(set(old) & set(new) if name == "numeric_settings" else set(old) | set(new))
            if not any(old.get(key) != new.get(key) for key in keys):
                continue
            changed = [f"{key} {old.get(key)!r} -> {new.get(key)!r}" for key in keys if old.get(key) != new.get(key)]
            return f"{where}: compile {name} changed: {', '.join(changed)}"
        return f"{where}: compile {name} was {old!r} in the baseline's run, {new!r} in this run"
    return None


def compile_changes(
    recorded: Mapping[str, Mapping[str, Any] | None], obtained: Mapping[str, Mapping[str, Any] | None]
) -> list[str]:
    """A compile_change line for each variant in both mappings ({variant: its run's compiled block}) whose
    compilation differs, in `obtained`'s order."""
    return changes_by_variant(recorded, obtained, compile_change)


def recorded_compiled(document: Mapping[str, Any]) -> dict[str, Mapping[str, Any] | None]:
    """{variant: its run's compiled block, None where it ran eager} of a baseline file's content."""
    return recorded_run_blocks(document, "compiled")


def compile_failure(document: Mapping[str, Any], report: PrecisionReport, baseline: str, refresh: str) -> str | None:
    """The failure text when a variant of `report` compiled otherwise than the baseline file's content `document`
    records for it; None when none did."""
    obtained = {variant: report.runs[variant].compiled for variant in report.variants}
    lines = compile_changes(recorded_compiled(document), obtained)
    if not lines:
        return None
    count = f"{len(lines)} variant{'s' if len(lines) > 1 else ''}"
    return "\n".join(
        [
            f"compilation changed ({count}): the run did not run the code its baseline measured",
            *(f"  {line}" for line in lines),
            f"Baseline: {baseline}",
            f"If the change is intended, refresh it: {refresh}",
        ]
    )


__all__ = ["GATED_FIELDS", "compile_change", "compile_changes", "compile_failure", "recorded_compiled"]
