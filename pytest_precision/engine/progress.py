"""Progress of a comparison: the events `compare` / `reference` send to a progress callback.

`compare(..., progress=callback)` and `reference(..., progress=callback)` call `callback(event)` with a
`ProgressEvent` when a run starts a phase: "build" (the run's model), "forward", "backward", "measure" (the
run's one device-to-host copy of its statistics), and "done" with the run's wall time. A variant that needs
more passes (fp16 loss-scale retries, repeats, the isolated pass, the NaN/Inf diagnosis) goes through the
phases again under the same run. Events add no host synchronisation: on a GPU a phase's start is when its
kernels were queued, and "measure" is where the queue drains.

The CLI renders them (pytest_precision.cli.progress_printer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Phase = Literal["build", "forward", "backward", "measure", "done"]
Role = Literal["reference", "variant"]


@dataclass(frozen=True)
class ProgressEvent:
    """One step of one run of a comparison.

    run: the variant's name (the reference's own name, "fp32", for the reference run).
    role: "reference" or "variant".
    phase: "build", "forward", "backward", "measure", or "done" when the run (every pass of it) finished.
    index, total: this run's position (1-based) among the runs of this call, and their number: the
        reference counts only when the call runs it (not for compare(ref, ...) on a Reference).
    seconds: for "done", the run's wall time in seconds; else None.
    """

    run: str
    role: Role
    phase: Phase
    index: int
    total: int
    seconds: float | None = None


ProgressCallback = Callable[[ProgressEvent], None]


class RunProgress:
    """The events of one run, sent to a ProgressCallback (or nowhere)."""

    def __init__(self, callback: ProgressCallback | None, run: str, role: Role, index: int, total: int) -> None:
        self._callback = callback
        self._run = run
        self._role = role
        self._index = index
        self._total = total
        self._start = time.perf_counter()

    def phase(self, phase: Phase) -> None:
        if self._callback is not None:
            self._callback(ProgressEvent(self._run, self._role, phase, self._index, self._total))

    def done(self) -> None:
        if self._callback is not None:
            seconds = time.perf_counter() - self._start
            self._callback(ProgressEvent(self._run, self._role, "done", self._index, self._total, seconds))


def checked_callback(progress: object) -> ProgressCallback | None:
    """`progress` when it is None or callable; anything else is a ConfigurationError."""
    from pytest_precision.base.errors import ConfigurationError

    if progress is not None and not callable(progress):
        raise ConfigurationError(
            f"progress must be a callable taking a ProgressEvent, or None; got {type(progress).__name__}"
        )
    return progress  # type: ignore[return-value]


__all__ = ["Phase", "ProgressCallback", "ProgressEvent", "Role", "RunProgress", "checked_callback"]
