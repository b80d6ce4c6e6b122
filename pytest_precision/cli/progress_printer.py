"""Progress printing of `pytest-precision run`: one line per run phase on stderr, live on a terminal, with the
time elapsed and an estimate of the time left from the runs that finished."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from pytest_precision.engine.progress import ProgressEvent, Role


def duration(seconds: float) -> str:
    """A wall time as people read it: 4.2s, 1m05s, 1h02m."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{rest:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def remaining_estimate(finished: Sequence[float], left: int) -> float | None:
    """Seconds left for `left` more runs: the mean of the finished runs' times each (None before any)."""
    if not finished:
        return None
    return left * sum(finished) / len(finished)


def time_left(finished: Sequence[float], left: int, current: float | None = None) -> str:
    """The estimate of a progress line: ", about T left", or "" before the first run finished and after the last.

    `finished`: the finished runs' seconds; `left`: the runs not finished, the current one included;
    `current`: how long the current run has run (None between runs). Each run not started counts the mean of
    the finished runs. The current run counts the mean less its time so far while it is within the mean; once
    it has outlasted the mean, the mean says nothing about how much more it needs, and no number would be
    honest: the line says so and counts only the runs after it (", longer than the mean run (1m20s); about 2m40s
    left after it"). So the estimate is never negative, and never counts down to a figure the current run has
    already proved too short.
    """
    estimate = remaining_estimate(finished, left)
    if estimate is None or left <= 0:
        return ""
    if current is None:
        return f", about {duration(estimate)} left"
    mean = estimate / left
    if current < mean:
        return f", about {duration(estimate - current)} left"
    after = f"; about {duration(estimate - mean)} left after it" if left > 1 else ""
    return f", longer than the mean run ({duration(mean)}){after}"


class ProgressPrinter:
    """Render ProgressEvents on `stream` (stderr): a live bar rewritten in place when `live` (a terminal),
    redrawn every `tick_seconds` so that its clock runs during a long phase; else one plain line per event
    (the estimate of the time left on the lines of finished runs). `planned` names every run the command will
    make, in order, as (role, name), so that the estimate covers the runs of later calls too (the reference,
    then the variants).

    `note(text)` prints a step of the command itself (loading, writing files) the same way. `close()` clears
    the bar and stops its redrawing. `clock` gives the time in seconds (time.perf_counter; a test's own clock).
    """

    BAR_WIDTH = 24

    def __init__(
        self,
        stream: TextIO,
        *,
        live: bool,
        planned: Sequence[tuple[Role, str]],
        tick_seconds: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._stream = stream
        self._live = live
        self._planned = list(planned)
        self._clock = clock
        self._start = clock()
        self._finished: list[float] = []
        #: The live bar's text (run and phase), while one is on the line.
        self._live_text: str | None = None
        #: The run under way and when its first event came.
        self._current: tuple[str, str] | None = None
        self._current_start = 0.0
        # The redrawing thread and the events both write: one at a time.
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._ticker: threading.Thread | None = None
        if live:
            self._ticker = threading.Thread(target=self._tick, args=(tick_seconds,), daemon=True)
            self._ticker.start()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def _position(self, event: ProgressEvent) -> str:
        label = f"{event.role} {event.run}"
        if (event.role, event.run) in self._planned:
            return f"{label} ({self._planned.index((event.role, event.run)) + 1}/{len(self._planned)})"
        return label

    def _left(self) -> str:
        """The estimate of the time left (see time_left), counting the current run's time so far."""
        current = None if self._current is None else self._clock() - self._current_start
        return time_left(self._finished, len(self._planned) - len(self._finished), current)

    def _write_line(self, text: str) -> None:
        if self._live_text is not None:
            self._stream.write("\r\x1b[K")
            self._live_text = None
        self._stream.write(f"[{duration(self.elapsed()):>7}] {text}\n")
        self._stream.flush()

    def _draw_live(self) -> None:
        assert self._live_text is not None
        done = len(self._finished)
        total = max(len(self._planned), 1)
        filled = round(self.BAR_WIDTH * min(done, total) / total)
        bar = "#" * filled + "-" * (self.BAR_WIDTH - filled)
        self._stream.write(f"\r\x1b[K[{bar}] {done}/{total} {duration(self.elapsed())} {self._live_text}{self._left()}")
        self._stream.flush()

    def _tick(self, seconds: float) -> None:
        while not self._stopped.wait(seconds):
            with self._lock:
                if self._live_text is not None:
                    self._draw_live()

    def __call__(self, event: ProgressEvent) -> None:
        with self._lock:
            if event.phase == "done":
                self._finished.append(event.seconds or 0.0)
                self._current = None
                self._write_line(f"{self._position(event)}: done in {duration(event.seconds or 0.0)}{self._left()}")
                return
            if self._current != (event.role, event.run):
                self._current = (event.role, event.run)
                self._current_start = self._clock()
            if self._live:
                self._live_text = f"{self._position(event)}: {event.phase}"
                self._draw_live()
            else:
                self._write_line(f"{self._position(event)}: {event.phase}")

    def note(self, text: str) -> None:
        with self._lock:
            self._write_line(text)

    def close(self) -> None:
        """Stop redrawing and clear a live bar left on the line."""
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self._live_text is not None:
                self._stream.write("\r\x1b[K")
                self._stream.flush()
                self._live_text = None


__all__ = ["ProgressPrinter", "duration", "remaining_estimate", "time_left"]
