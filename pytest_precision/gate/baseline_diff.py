"""`pytest-precision diff`: two baseline files, two folders of baselines, or the baselines committed at a git
ref against the working tree. NEW fails against OLD when a metric got worse beyond the tolerance, when it no
longer checks something OLD checked (a variant, a tensor, a defined metric), when a variant converted another
format or other modules below 16 bits, or, for folders, when a baseline of OLD is gone (a dropped gate).
Unreadable files are PrecisionErrors naming the file (exit 2).
"""

from __future__ import annotations

import math
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_precision.base.errors import PrecisionError
from pytest_precision.gate.baseline import baseline_stem, owned_document, parse_baseline_name
from pytest_precision.gate.compile_check import compile_changes
from pytest_precision.gate.diff_gate import DiffOptions as DiffOptions
from pytest_precision.gate.diff_gate import check_carried, recorded_gates
from pytest_precision.gate.lowbit_check import lowbit_changes
from pytest_precision.gate.report_files import _read_json, reports_in

if TYPE_CHECKING:
    from pytest_precision.gate.tolerance_rules import ToleranceRules
    from pytest_precision.reports.report import PrecisionReport

Row = tuple[str, str, str, str, float | None, float | None, float | None]


def _undefined(value: float | None) -> bool:
    return value is None or math.isnan(value)


def diff_rows(old: PrecisionReport, new: PrecisionReport, metrics: Sequence[str]) -> list[Row]:
    """(variant, tensor, kind, metric, old, new, new error / old error) for tensors in both, largest change
    first."""
    rows = []
    for variant in new.variants:
        if variant not in old.variants:
            continue
        before = {(r.name, r.kind): r for r in old.records(variant)}
        for record in new.records(variant):
            previous = before.get((record.name, record.kind))
            if previous is None:
                continue
            for metric in metrics:
                a, b = previous.metric(metric), record.metric(metric)
                rows.append((variant, record.name, record.kind, metric, a, b, _error_ratio(metric, a, b)))
    return sorted(rows, key=_change, reverse=True)


def _error_ratio(metric: str, before: float | None, after: float | None) -> float | None:
    """How many times its error (its distance from perfect: 1 - cosine, ...) the metric's new value holds, as
    the gate compares it; None when either is undefined or the old error is 0."""
    from pytest_precision.gate.tolerance import metric_magnitude

    if before is None or after is None or math.isnan(before) or math.isnan(after):
        return None
    old_error, new_error = metric_magnitude(metric, before), metric_magnitude(metric, after)
    return None if old_error == 0 else new_error / old_error


def _change(row: Row) -> float:
    """|log(new/old)|; 0 when both are equal or undefined, inf when one of them is 0, undefined or infinite."""
    ratio = row[6]
    if ratio is None or ratio <= 0 or not math.isfinite(ratio):
        return 0.0 if row[4] == row[5] or (_undefined(row[4]) and _undefined(row[5])) else math.inf
    return abs(math.log(ratio))


def _worse(row: Row, rules: ToleranceRules) -> bool:
    """Whether a row's metric is a number in both and got worse beyond the metric's tolerance."""
    from pytest_precision.gate.tolerance import is_worse

    name, kind, metric, before, after = row[1], row[2], row[3], row[4], row[5]
    if before is None or after is None or math.isnan(before) or math.isnan(after):
        return False
    return is_worse(metric, before, after, rules.for_metric(name, kind, metric))


def lost_checks(old: PrecisionReport, new: PrecisionReport, metrics: Sequence[str]) -> list[str]:
    """What `new` no longer checks or newly breaks, one line each: a variant or tensor it dropped, a metric
    that was a number and became undefined (null/NaN), more non-finite values than before."""
    lines = [f"dropped variant {variant}" for variant in old.variants if variant not in new.variants]
    for variant in old.variants:
        if variant not in new.variants:
            continue
        after = {(r.name, r.kind): r for r in new.records(variant)}
        for previous in old.records(variant):
            tensor = f"{variant} {previous.name} ({previous.kind})"
            record = after.get((previous.name, previous.kind))
            if record is None:
                lines.append(f"dropped tensor {tensor}")
                continue
            for metric in metrics:
                if not _undefined(previous.metric(metric)) and _undefined(record.metric(metric)):
                    lines.append(f"{tensor}: {metric} became undefined")
            if record.nonfinite > previous.nonfinite:
                lines.append(f"{tensor}: nonfinite {previous.nonfinite} -> {record.nonfinite}")
    return lines


def _pairs(old_path: Path, new_path: Path) -> list[tuple[str, PrecisionReport | None, PrecisionReport | None]]:
    """(label, old report, new report) per test, paired by test id (None: not in that file); the only test of
    each file pair up whatever their ids. A single test against several pairs with its own id, or refuses."""
    old_reports, new_reports = reports_in(old_path), reports_in(new_path)
    for path, reports in ((old_path, old_reports), (new_path, new_reports)):
        if not reports:
            raise PrecisionError(f"{path} holds no precision results (a session report without tests?)")
    if len(old_reports) == 1 and len(new_reports) == 1:
        (label, new), old = next(iter(new_reports.items())), next(iter(old_reports.values()))
        return [(label, old, new)]
    shared = set(old_reports) & set(new_reports)
    if not shared:
        raise PrecisionError(
            f"no test is in both {old_path} ({', '.join(sorted(old_reports)[:3])}"
            f"{', ...' if len(old_reports) > 3 else ''}) and {new_path} ({', '.join(sorted(new_reports)[:3])}"
            f"{', ...' if len(new_reports) > 3 else ''}); diff the baseline of a test against a session report "
            "holding that test id, or two files of the same tests"
        )
    if len(old_reports) == 1 or len(new_reports) == 1:
        # One test against a session report: only that test is compared.
        return [(label, old_reports[label], new_reports[label]) for label in sorted(shared)]
    return [(label, old_reports.get(label), new) for label, new in new_reports.items()] + [
        (label, old, None) for label, old in old_reports.items() if label not in new_reports
    ]


def _tensors(report: PrecisionReport) -> set[tuple[str, str, str]]:
    return {(variant, r.name, r.kind) for variant in report.variants for r in report.records(variant)}


def print_test(
    label: str, old: PrecisionReport, new: PrecisionReport, options: DiffOptions, *, short_if_unchanged: bool = False
) -> tuple[int, bool]:
    """Print one test's section: (failures, whether any compared metric or check changed). With
    `short_if_unchanged`, a test whose compared numbers are all equal is one line."""
    from pytest_precision.gate.tolerance import format_value
    from pytest_precision.reports.tables import render

    rows = diff_rows(old, new, options.metrics)
    got_worse = {row for row in rows if _worse(row, options.tolerances)}
    # A variant that converted another format or other modules below 16 bits measures something else: it fails.
    converted = lowbit_changes(
        {v: old.runs[v].lowbit for v in old.variants}, {v: new.runs[v].lowbit for v in new.variants}
    ) + compile_changes(
        {v: old.runs[v].compiled for v in old.variants}, {v: new.runs[v].compiled for v in new.variants}
    )
    lost = converted + lost_checks(old, new, options.metrics)
    only_new = [v for v in new.variants if v not in old.variants]
    changed = bool(lost or only_new or _tensors(old) != _tensors(new) or any(_change(row) > 0 for row in rows))
    if short_if_unchanged and not changed:
        print(f"== {label}: unchanged ({len(rows)} tensor metrics)")
        return 0, False
    lost_note = f"; {len(lost)} check{'s' if len(lost) > 1 else ''} lost or newly non-finite" if lost else ""
    if converted:
        lost_note = lost_note.replace("lost or newly non-finite", "lost, newly non-finite or converted otherwise")
    print(f"== {label}: {len(got_worse)} of {len(rows)} tensor metrics worse beyond {options.describe()}{lost_note}")
    for line in lost:
        print(f"  {line}")
    if only_new:
        print(f"  variants only in new: {', '.join(only_new)}")
    shown = rows[: options.limit]
    table = [
        [
            *row[:4],
            format_value(row[3], row[4]),
            format_value(row[3], row[5]),
            "-" if row[6] is None else f"{row[6]:.3g}x",
            "WORSE" if row in got_worse else "UNDEFINED" if _undefined(row[5]) and not _undefined(row[4]) else "",
        ]
        for row in shown
    ]
    for line in render(["variant", "tensor", "kind", "metric", "old", "new", "ratio", ""], table, left=4):
        print(line)
    if len(rows) > len(shown):
        print(f"  ... {len(rows) - len(shown)} more (--limit)")
    return len(got_worse) + len(lost), changed


def diff_files(old_path: Path, new_path: Path, options: DiffOptions, *, old_shown: str | None = None) -> int:
    """`diff OLD NEW` on two files (baselines or session reports): 1 when NEW is worse, else 0. `old_shown`
    names OLD in the output when it is a scratch copy."""
    failed = 0
    old_name = old_shown or str(old_path)
    pairs = _pairs(old_path, new_path)
    check_carried([report for _, old, new in pairs for report in (old, new) if report is not None], options)
    # A session report's tests recorded the gate they ran: NEW's, else OLD's, serves what nothing else sets.
    gates = {**recorded_gates(old_path), **recorded_gates(new_path)}
    for label, old, new in pairs:
        if old is None:
            print(f"== {label}: not in {old_name} (a new test)")
            continue
        if new is None:
            print(f"== {label}: dropped, in {old_name} but not in {new_path}")
            failed += 1
            continue
        failed += print_test(label, old, new, options.for_test(gates.get(label), f"test {label}"))[0]
    return 1 if failed else 0


# ---------------------------------------------------------------- folders of baselines


@dataclass
class Side:
    """One side of a folder diff: its baselines by path relative to `root` (posix), and the JSON files that
    are not baselines. `shown` names the side in messages (a folder as given, or "REF:PATH")."""

    root: Path
    shown: str
    baselines: dict[str, Path] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def name(self, relative: str) -> str:
        return f"{self.shown.rstrip('/')}/{relative}"

    @contextmanager
    def naming(self, relative: str) -> Iterator[None]:
        """PrecisionErrors about `relative` name it as the user knows it (not a scratch copy)."""
        try:
            yield
        except PrecisionError as error:
            raise PrecisionError(str(error).replace(str(self.root / relative), self.name(relative))) from None

    def add(self, relative: str, path: Path) -> None:
        """File `relative` (at `path`) as a baseline, as ignored JSON, or a PrecisionError when it has a
        baseline's name but cannot be read as JSON (corrupt, truncated, a merge conflict)."""
        if parse_baseline_name(path.name) is None:
            self.ignored.append(relative)
        elif owned_document(path) is not None:
            self.baselines[relative] = path
        else:
            with self.naming(relative):
                if not path.is_symlink():
                    _read_json(path)  # raises, naming the file, when it is not a JSON object
            self.ignored.append(relative)

    def report(self, relative: str) -> PrecisionReport:
        """The report of baseline `relative`; a PrecisionError naming it when its content is malformed."""
        with self.naming(relative):
            (report,) = reports_in(self.baselines[relative]).values()
        return report


def folder_side(root: Path, shown: str) -> Side:
    """The baselines (<stem>.<device>.json the plugin wrote) under folder `root`, at any depth."""
    side = Side(root, shown)
    for path in sorted(root.rglob("*.json")):
        if path.is_file():
            side.add(path.relative_to(root).as_posix(), path)
    return side


def _label(relative: str, test: str) -> str:
    """The test id and device of a baseline, and its stem when not the test's own (`baseline=` of compare)."""
    stem, device = parse_baseline_name(Path(relative).name) or (relative, "?")
    return f"{test} [{device}]" if stem == baseline_stem(test) else f"{test} [baseline={stem}, {device}]"


def diff_trees(old: Side, new: Side, options: DiffOptions) -> int:
    """Pair the baselines of two sides by relative path; print a section per test, the removed and added
    files and a summary. 1 when a test got worse or lost a check, or a baseline of OLD is gone; else 0."""
    if not old.baselines and not new.baselines:
        raise PrecisionError(
            f"neither {old.shown} nor {new.shown} holds a pytest-precision baseline (<stem>.<device>.json files "
            "the plugin writes); give the baseline folders, e.g. baselines"
        )
    print(f"OLD {old.shown} ({len(old.baselines)} baselines) -> NEW {new.shown} ({len(new.baselines)} baselines)")
    removed = sorted(set(old.baselines) - set(new.baselines))
    added = sorted(set(new.baselines) - set(old.baselines))
    compared = sorted(set(old.baselines) & set(new.baselines))
    # Every file is read before anything is printed: a corrupt one is an error wherever it is.
    before = {relative: old.report(relative) for relative in old.baselines}
    after = {relative: new.report(relative) for relative in new.baselines}
    check_carried([*before.values(), *after.values()], options)
    failed = worse = changed = 0
    for relative in compared:
        label = _label(relative, _test_id(new, relative))
        failures, moved = print_test(label, before[relative], after[relative], options, short_if_unchanged=True)
        failed += failures
        worse += failures > 0
        changed += moved and not failures
    for relative in removed:
        print(f"== removed: {relative} ({_test_id(old, relative)}): in OLD, not in NEW; its gate is gone")
    for relative in added:
        print(f"== added: {relative} ({_test_id(new, relative)}): a new baseline")
    ignored = sorted(set(old.ignored) | set(new.ignored))
    if ignored:
        listed = ", ".join(ignored[:3]) + (", ..." if len(ignored) > 3 else "")
        print(
            f"note: {len(ignored)} JSON file{'s' if len(ignored) > 1 else ''} ignored, not pytest-precision "
            f"baselines: {listed}"
        )
    print(
        f"{len(compared)} test{'s' if len(compared) != 1 else ''} compared: {worse} worse, {changed} changed "
        f"(not worse), {len(compared) - worse - changed} unchanged; {len(added)} added, {len(removed)} removed"
    )
    return 1 if failed or removed else 0


def _test_id(side: Side, relative: str) -> str:
    document = owned_document(side.baselines[relative]) or {}
    return str(document.get("test", relative))


# ---------------------------------------------------------------- a git ref against the working tree


def _git(arguments: Sequence[str], cwd: Path, what: Callable[[str], str]) -> bytes:
    """stdout of `git ARGUMENTS` run in `cwd`; a PrecisionError from `what(git's message)` when it fails."""
    try:
        done = subprocess.run(["git", *arguments], cwd=cwd, capture_output=True, check=False)
    except FileNotFoundError:
        raise PrecisionError("--against needs git, which is not installed or not on PATH") from None
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise PrecisionError(what(message[-1] if message else f"git exited with {done.returncode}"))
    return done.stdout


def _committed(ref: str, path: Path) -> tuple[Path, str, list[tuple[str, str, str]]]:
    """(the checkout's top folder, `path` relative to it, [(path relative to `path`, path in the repository,
    blob id)]) of the files under `path` (relative to the current directory) committed at `ref`; symlinks and
    submodules left out. PrecisionErrors say what to do when this is no git checkout, `ref` is unknown or
    nothing is there."""
    cwd = Path.cwd()
    top = _git(
        ["rev-parse", "--show-toplevel"],
        cwd,
        lambda message: (
            f"--against needs a git checkout, and {cwd} is not in one ({message}); run it from "
            "inside the repository, or compare two folders: pytest-precision diff OLD_DIR NEW_DIR"
        ),
    )
    toplevel = Path(top.decode("utf-8", "surrogateescape").strip()).resolve()
    unknown = (
        f"--against {ref}: no such branch, tag or commit in {toplevel}; check the name (git branch -a), or fetch "
        f"it first (git fetch origin {ref})"
    )
    if ref.startswith("-"):
        raise PrecisionError(unknown)
    commit = _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], toplevel, lambda _: unknown)
    try:
        inside = (cwd / path).resolve().relative_to(toplevel).as_posix()
    except ValueError:
        raise PrecisionError(f"{path} is outside the git checkout at {toplevel}") from None
    listing = _git(
        ["--literal-pathspecs", "ls-tree", "-r", "-z", commit.decode().strip(), "--", inside],
        toplevel,
        lambda message: f"--against {ref}: cannot list {path} ({message})",
    )
    prefix = "" if inside == "." else f"{inside}/"
    files = []
    for entry in filter(None, listing.split(b"\0")):
        info, _, name_bytes = entry.partition(b"\t")
        mode, kind, blob = info.decode().split()
        name = name_bytes.decode("utf-8", "surrogateescape")
        if kind == "blob" and mode != "120000":
            files.append((name[len(prefix) :] if name.startswith(prefix) else Path(name).name, name, blob))
    if not files:
        raise PrecisionError(
            f"--against {ref}: nothing under {path} is committed at {ref} (git ls-tree -r {ref} -- {path} lists "
            "no file); check the path (the baseline folder, default baselines, relative to the current "
            "directory) and the ref, or commit the baselines first"
        )
    return toplevel, inside, files


def _blob(toplevel: Path, blob: str, shown: str) -> bytes:
    """The content of git object `blob`, `shown` naming it in an error."""
    return _git(["cat-file", "blob", blob], toplevel, lambda message: f"cannot read {shown} ({message})")


def ref_side(ref: str, path: Path, scratch: Path) -> Side:
    """The baselines under folder `path` as committed at `ref`, written to `scratch` (a temporary folder);
    shown as git names them (REF:path from the top of the checkout)."""
    toplevel, inside, files = _committed(ref, path)
    side = Side(scratch, f"{ref}:{inside}")
    for relative, name, blob in files:
        target = scratch / relative
        if not relative.endswith(".json"):
            continue
        if parse_baseline_name(target.name) is None:  # only baselines are read; other JSON is counted
            side.ignored.append(relative)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_blob(toplevel, blob, f"{ref}:{name}"))
        side.add(relative, target)
    return side


def diff_against(ref: str, path: Path, options: DiffOptions) -> int:
    """`diff --against REF [PATH]`: the baselines committed at REF under PATH (OLD) against the working
    tree's (NEW), committed or not, ignored by git or not. PATH may be one file: then as `diff OLD NEW`."""
    if not path.exists():
        raise PrecisionError(
            f"{path} does not exist; give the baseline folder (default: baselines, relative to the current "
            "directory) or a baseline file"
        )
    with tempfile.TemporaryDirectory(prefix="pytest-precision-diff-") as scratch:
        if path.is_dir():
            return diff_trees(ref_side(ref, path, Path(scratch)), folder_side(path, path.as_posix()), options)
        toplevel, _, files = _committed(ref, path)
        (_, name, blob), *_ = files
        shown = f"{ref}:{name}"
        old = Path(scratch) / path.name
        old.write_bytes(_blob(toplevel, blob, shown))
        try:
            return diff_files(old, path, options, old_shown=shown)
        except PrecisionError as error:
            raise PrecisionError(str(error).replace(str(old), shown)) from None
