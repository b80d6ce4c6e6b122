"""What a low-bit or quantized variant converted is part of its gate: the format and the modules its baseline's
run converted, compared with this run's (a run's `lowbit` block, see engine.lowbit_build.LowbitApplied.to_dict).

A variant that converts fewer or other modules, or another format, measures something else than its baseline did:
its error may even fall ("precision improved") because fewer modules are low-bit. Baselines written before module
names were recorded hold only a count; then the counts are compared. The kernels (native or emulated) and the
torchao version are the environment's, not the variant's: they are not compared here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_precision.reports.report import PrecisionReport

#: Module names shown per list before "... N more".
SHOWN_NAMES = 6


def _kind(lowbit: Mapping[str, Any]) -> str:
    """The kind of format: "fp8 training", "quantized inference", "fp8 weight storage" (its text before ',')."""
    return str(lowbit.get("format", "low-bit")).split(",")[0]


def shown_names(names: list[str]) -> str:
    """Up to SHOWN_NAMES names, then "... N more"."""
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (f", ... {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def lowbit_change(variant: str, recorded: Mapping[str, Any] | None, obtained: Mapping[str, Any] | None) -> str | None:
    """One line saying how this run's low-bit conversion differs from the baseline's, or None when it does not.

    `recorded`: the baseline's run.lowbit of `variant` (None: its run had no format below 16 bits); `obtained`:
    this run's. Compared: the format (with its recipe or config), then the module names (the count where the
    baseline holds no names).
    """
    if not recorded and not obtained:
        return None
    where = f"variant {variant!r}"
    if not recorded or not obtained:
        then, now = (
            f"{block.get('modules')} module(s) to {block.get('format')}" if block else "no module"
            for block in (recorded, obtained)
        )
        return f"{where}: the baseline's run converted {then}, this run {now}"
    if recorded.get("format") != obtained.get("format"):
        return f"{where}: the baseline's format was {recorded.get('format')}, this run's is {obtained.get('format')}"
    kind, count = _kind(recorded), recorded.get("modules")
    old_names = recorded.get("module_names")
    if not isinstance(old_names, list):  # a baseline from before names were recorded
        if count == obtained.get("modules"):
            return None
        return (
            f"{where}: the baseline's {kind} converted {count} modules, this run {obtained.get('modules')} (the "
            "baseline records no "
            "module names: refresh the baseline to record module names)"
        )
    new_names = list(obtained.get("module_names") or [])
    missing = sorted(set(old_names) - set(new_names))
    added = sorted(set(new_names) - set(old_names))
    if not missing and not added:
        return None
    parts = [f"missing {shown_names(missing)}"] if missing else []
    parts += [f"added {shown_names(added)}"] if added else []
    counts = f"the baseline's {kind} converted {len(old_names)} modules, this run {len(new_names)}"
    return f"{where}: {counts}: {'; '.join(parts)}"


def lowbit_changes(
    recorded: Mapping[str, Mapping[str, Any] | None], obtained: Mapping[str, Mapping[str, Any] | None]
) -> list[str]:
    """A lowbit_change line for each variant in both `recorded` and `obtained` ({variant: its run's lowbit block})
    whose conversion differs, in `obtained`'s order (a variant new or missing is the records' gate's to name)."""
    return changes_by_variant(recorded, obtained, lowbit_change)


def changes_by_variant(
    recorded: Mapping[str, Mapping[str, Any] | None],
    obtained: Mapping[str, Mapping[str, Any] | None],
    change: Callable[[str, Mapping[str, Any] | None, Mapping[str, Any] | None], str | None],
) -> list[str]:
    """`change(variant, recorded block, obtained block)` for each variant in both mappings, in `obtained`'s order,
    where it names a difference."""
    lines = []
    for variant, now in obtained.items():
        if variant in recorded:
            line = change(variant, recorded[variant], now)
            if line is not None:
                lines.append(line)
    return lines


def recorded_run_blocks(document: Mapping[str, Any], field: str) -> dict[str, Mapping[str, Any] | None]:
    """{variant: its run's `field` block, None where it has none} of a baseline file's content."""
    variants = document.get("variants") or {}
    return {name: (entry.get("run") or {}).get(field) for name, entry in variants.items()}


def recorded_lowbit(document: Mapping[str, Any]) -> dict[str, Mapping[str, Any] | None]:
    """{variant: its run's lowbit block, None where it has none} of a baseline file's content."""
    return recorded_run_blocks(document, "lowbit")


def lowbit_message(lines: list[str], baseline: str, refresh: str) -> str:
    """The failure text: a headline, a line per variant, then the baseline and the command that refreshes it."""
    count = f"{len(lines)} variant{'s' if len(lines) > 1 else ''}"
    return "\n".join(
        [
            f"low-bit conversion changed ({count}): the run did not measure what its baseline measured",
            *(f"  {line}" for line in lines),
            f"Baseline: {baseline}",
            f"If the change is intended, refresh it: {refresh}",
        ]
    )


def lowbit_failure(document: Mapping[str, Any], report: PrecisionReport, baseline: str, refresh: str) -> str | None:
    """The failure text when a variant of `report` converted another format or other modules than the baseline
    file's content `document` records for it; None when none did."""
    obtained = {variant: report.runs[variant].lowbit for variant in report.variants}
    lines = lowbit_changes(recorded_lowbit(document), obtained)
    return lowbit_message(lines, baseline, refresh) if lines else None


__all__ = ["lowbit_change", "lowbit_changes", "lowbit_failure", "lowbit_message", "recorded_lowbit"]
