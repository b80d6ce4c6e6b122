"""What `pytest-precision run --output-dir DIR` writes, so that a run can be read and reused without rerunning:

    precision-report.json   the session report's schema (pytest --precision-report), one entry for the run
    summary.md              the error-propagation tables, as markdown
    error-vs-depth.png      rms_rel against depth per variant (with the `plot` extra: matplotlib)
    inputs.safetensors      the exact inputs ("input_ids", ...), to score byte-identical tokens elsewhere
    logprobs/<run>.npy      per run ("reference" and each variant): the chosen-token log-probabilities,
                            float64 (batch, length - 1); NaN where a position does not count (no next
                            token, padding). compare_logprobs("logprobs/bf16.npy", "logprobs/reference.npy")
                            reads them as they are; another engine's, of the same tokens, compares the same way.

A folder that exists and is not empty is refused (an earlier run's files beside this one's would be read as
this one's) unless `overwrite`: then this module's own files in it are removed first, and nothing else.

While a run goes on, its claim file `.pytest-precision-run.lock` (pid, host, start time) holds the folder: a
second run into it is refused, also with `overwrite`, so that the files of two runs never mix. The claim goes
when the run ends, however it ends; one left by a killed run (its pid gone on this host) is taken over. One that
names no process (no pid, or no valid one) is respected for a few seconds (being written) and then taken over;
anything at its path that no run makes (a folder, a FIFO, a symbolic link, an unreadable file) is refused, never
removed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_precision.base.atomic_files import (
    Claim,
    ClaimFileError,
    claim_exclusively,
    claim_names,
    write_atomically,
)
from pytest_precision.base.errors import PrecisionError

if TYPE_CHECKING:
    import torch

    from pytest_precision.reports.report import PrecisionReport

REPORT_FILE = "precision-report.json"
SUMMARY_FILE = "summary.md"
PLOT_FILE = "error-vs-depth.png"
INPUTS_FILE = "inputs.safetensors"
LOGPROBS_DIR = "logprobs"
#: The name of the reference run's log-prob file (variant files carry the variant's name).
REFERENCE_RUN = "reference"
OWN_FILES = (REPORT_FILE, SUMMARY_FILE, PLOT_FILE, INPUTS_FILE)
#: The claim file of the run writing the folder (see claim_exclusively).
CLAIM_FILE = ".pytest-precision-run.lock"


def prepare_output_dir(directory: Path, *, overwrite: bool) -> Claim:
    """Claim `directory` for this run and check, before the run, that it can take the run's files: absent or
    empty, or with `overwrite` holding an earlier run's (removed by write_outputs once this run has succeeded,
    so that a failed run loses nothing). Refused: a file in its place, a folder another run is writing, a
    non-empty folder without `overwrite`. The caller releases the claim when the run ends."""
    if directory.exists() and not directory.is_dir():
        raise PrecisionError(f"--output-dir {directory}: a file is in its place; choose a folder")
    claim_path = directory / CLAIM_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        claim = claim_exclusively(claim_path)
    except ClaimFileError as error:  # a folder, FIFO, link, ... or an unreadable file where the claim goes
        raise PrecisionError(f"--output-dir {directory}: {error}") from None
    except OSError as error:
        raise PrecisionError(f"--output-dir {directory}: cannot write there ({error.strerror or error})") from None
    if not isinstance(claim, Claim):
        # Its claim file is created, its pid not yet written; or it is no run's claim (no valid pid), taken over
        # once older than CLAIM_STARTING_SECONDS.
        who = "one starting just now: its claim file names no process yet"
        if claim.pid is not None:
            host = f" on {claim.host}" if claim.host else ""
            started = f", started {claim.started}" if claim.started else ""
            who = f"pid {claim.pid}{host}{started}"
        raise PrecisionError(
            f"another pytest-precision run ({who}) is writing {directory}; wait for it or choose another "
            f"--output-dir (if that run is gone, delete {claim_path})"
        )
    try:
        # Checked while holding the claim: no other run can start writing here between the check and the run.
        # The claim's own files are no earlier run's.
        if not overwrite and any(entry.name not in claim_names(claim_path) for entry in directory.iterdir()):
            raise PrecisionError(
                f"--output-dir {directory} is not empty: an earlier run's files would sit beside this run's and "
                "be read as its; choose a new folder, or pass --overwrite to replace the files a run writes there"
            )
    except BaseException:
        claim.release()
        raise
    return claim


def _remove_own_files(directory: Path) -> None:
    """Remove the files a run writes (OWN_FILES and logprobs/*.npy), nothing else."""
    try:
        for name in OWN_FILES:
            path = directory / name
            if path.is_file() or path.is_symlink():
                path.unlink()
        logprobs = directory / LOGPROBS_DIR
        if logprobs.is_dir() and not logprobs.is_symlink():
            for path in logprobs.glob("*.npy"):
                if path.is_file() or path.is_symlink():
                    path.unlink()
            if not any(logprobs.iterdir()):
                logprobs.rmdir()
    except OSError as error:
        raise PrecisionError(
            f"--output-dir {directory}: cannot remove an earlier run's files ({error.strerror or error})"
        ) from None


def _numpy_logprobs(values: torch.Tensor, mask: torch.Tensor | None) -> Any:
    """float64 (batch, positions) log-probs with NaN where `mask` is False."""
    import torch

    array = values.detach().to("cpu", torch.float64).clone()
    if mask is not None:
        array[~mask.to("cpu", torch.bool)] = float("nan")
    return array.numpy()


def _save_array(path: Path, array: Any) -> None:
    """np.save, atomically. Through an open file: given a path, np.save would add .npy to the temporary name."""
    import numpy as np

    def save(temporary: Path) -> None:
        with open(temporary, "wb") as handle:
            np.save(handle, array, allow_pickle=False)

    write_atomically(path, save)


def write_inputs(directory: Path, inputs: Mapping[str, torch.Tensor]) -> Path:
    """inputs.safetensors: the input tensors by name (a tensor given twice, as input_ids and labels, twice)."""
    from safetensors.torch import save_file

    path = directory / INPUTS_FILE
    tensors = {name: tensor.detach().cpu().contiguous().clone() for name, tensor in inputs.items()}
    write_atomically(path, lambda temporary: save_file(tensors, os.fspath(temporary)))
    return path


def write_logprobs(directory: Path, report: PrecisionReport) -> list[Path]:
    """logprobs/reference.npy and logprobs/<variant>.npy of the runs that have them (causal LMs)."""
    if report.reference_logprobs is None:
        return []
    folder = directory / LOGPROBS_DIR
    folder.mkdir(exist_ok=True)
    mask = report.logprob_mask
    runs = {REFERENCE_RUN: report.reference_logprobs, **report.token_logprobs}
    written = []
    for name, values in runs.items():
        path = folder / f"{name}.npy"
        _save_array(path, _numpy_logprobs(values, mask))
        written.append(path)
    return written


def _logprob_lines(report: PrecisionReport) -> str:
    """Markdown: per variant, the chosen-token log-prob and loss rows (causal LMs), what an RL user reads first."""
    from pytest_precision.outputs.summary import markdown_table

    def number(value: float | None, percent: bool = False) -> str:
        if value is None:
            return "-"
        return f"{value:.3%}" if percent else f"{value:.3g}"

    rows = []
    for variant in report.variants:
        logprob = report.records(variant, "logprob")
        loss = report.records(variant, "loss")
        if not logprob:
            continue
        row = logprob[0]
        rows.append(
            [
                variant,
                number(row.rms_rel, percent=True),
                number(row.delta_mean),
                number(row.delta_rms),
                number(row.clip_fraction, percent=True),
                number(row.kl_mean),
                number(row.top1_agreement, percent=True),
                number(loss[0].rms_rel, percent=True) if loss else "-",
            ]
        )
    if not rows:
        return ""
    header = ["variant", "logprob rms_rel", "delta_mean", "delta_rms", "clip", "kl_mean", "top-1", "loss rms_rel"]
    lines = ["", "Chosen-token log-probabilities (delta = variant - reference, per token) and the loss.", ""]
    return "\n".join([*lines, *markdown_table(header, rows)]) + "\n"


def report_document(
    report: PrecisionReport, label: str, environment: Mapping[str, Any], command: Mapping[str, Any]
) -> dict[str, Any]:
    """The session report's document (see PrecisionSession.write_report) with one entry, `label`, for the run."""
    entry = {
        "outcome": "measured",
        "device": report.device,
        "reference": report.reference.to_dict(),
        "variants": report.to_dict()["variants"],
        "nonfinite_origin": dict(report.nonfinite_origin),
    }
    return {
        "schema_version": 1,
        "baseline_dir": None,
        "environment": dict(environment),
        "stale": [],
        "drift": {},
        "command": dict(command),
        "tests": {label: entry},
    }


def write_outputs(
    directory: Path,
    report: PrecisionReport,
    *,
    label: str,
    inputs: Mapping[str, torch.Tensor],
    command: Mapping[str, Any],
    overwrite: bool = False,
) -> list[Path]:
    """Every file of the module docstring (the plot only with matplotlib), after removing an earlier run's
    when `overwrite`; the paths written."""
    from pytest_precision.gate.baseline import json_ready
    from pytest_precision.outputs.plots import plot_error_vs_depth
    from pytest_precision.outputs.summary import markdown_summary
    from pytest_precision.reports.environment import session_environment

    if overwrite:
        _remove_own_files(directory)
    document = report_document(report, label, session_environment(Path.cwd(), report.device), command)
    written = []
    path = directory / REPORT_FILE
    write_atomically(path, json.dumps(json_ready(document), indent=1, sort_keys=True, allow_nan=False) + "\n")
    written.append(path)
    plot = plot_error_vs_depth(report, directory / PLOT_FILE, title=label)
    text = markdown_summary(
        document["tests"],
        title=f"Precision of {label}",
        environment=document["environment"],
        plots={label: PLOT_FILE} if plot is not None else None,
    )
    path = directory / SUMMARY_FILE
    write_atomically(path, text + _logprob_lines(report))
    written.append(path)
    if plot is not None:
        written.append(plot)
    written.append(write_inputs(directory, inputs))
    written += write_logprobs(directory, report)
    return written


__all__ = ["CLAIM_FILE", "prepare_output_dir", "report_document", "write_outputs"]
