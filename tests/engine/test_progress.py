"""Progress events of compare / reference, and their rendering on stderr by `pytest-precision run`."""

from __future__ import annotations

import io
import re

import pytest
import torch
from test_host_syncs import TinyCausalLM, counted_compare, token_inputs

import pytest_precision
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.cli.progress_printer import ProgressPrinter, duration, remaining_estimate, time_left
from pytest_precision.engine.progress import ProgressEvent

RUN_PHASES = ["build", "forward", "backward", "measure", "done"]


def phases(events: list[ProgressEvent], run: str, role: str) -> list[str]:
    return [e.phase for e in events if e.run == run and e.role == role]


def test_compare_sends_each_runs_phases_in_order_with_its_position() -> None:
    """Reference then variants, each build -> forward -> backward -> measure -> done, numbered 1..3 of 3."""
    events: list[ProgressEvent] = []
    pytest_precision.compare(TinyCausalLM(2), token_inputs(), ["bf16", "tf32"], progress=events.append)
    assert phases(events, "fp32", "reference") == RUN_PHASES
    assert phases(events, "bf16", "variant") == RUN_PHASES
    assert phases(events, "tf32", "variant") == RUN_PHASES
    assert [(e.run, e.index, e.total) for e in events if e.phase == "done"] == [
        ("fp32", 1, 3),
        ("bf16", 2, 3),
        ("tf32", 3, 3),
    ]
    # The order of the whole stream: every event of a run before the next run's.
    assert [e.run for e in events] == ["fp32"] * 5 + ["bf16"] * 5 + ["tf32"] * 5
    done = [e for e in events if e.phase == "done"]
    assert all(e.seconds is not None and e.seconds > 0 for e in done)
    assert all(e.seconds is None for e in events if e.phase != "done")


def test_forward_only_runs_have_no_backward_phase() -> None:
    events: list[ProgressEvent] = []
    pytest_precision.compare(TinyCausalLM(2), token_inputs(), ["bf16"], backward=False, progress=events.append)
    assert phases(events, "fp32", "reference") == ["build", "forward", "measure", "done"]
    assert phases(events, "bf16", "variant") == ["build", "forward", "measure", "done"]


def test_a_kept_reference_sends_its_own_events_and_compare_numbers_only_the_variants() -> None:
    model = TinyCausalLM(2)
    events: list[ProgressEvent] = []
    ref = pytest_precision.reference(model, token_inputs(), progress=events.append)
    assert [(e.phase, e.index, e.total) for e in events] == [(p, 1, 1) for p in RUN_PHASES]
    events.clear()
    pytest_precision.compare(ref, variants=["bf16", "fp16"], progress=events.append)
    assert {e.role for e in events} == {"variant"}
    assert [(e.run, e.index, e.total) for e in events if e.phase == "done"] == [("bf16", 1, 2), ("fp16", 2, 2)]


def test_extra_passes_of_a_variant_repeat_its_phases_under_the_same_run() -> None:
    """repeats=2 runs the variant twice: two forward phases, one done."""
    events: list[ProgressEvent] = []
    pytest_precision.compare(TinyCausalLM(2), token_inputs(), ["bf16"], repeats=2, progress=events.append)
    assert phases(events, "bf16", "variant").count("forward") == 2
    assert phases(events, "bf16", "variant").count("done") == 1


def test_progress_must_be_callable() -> None:
    with pytest.raises(ConfigurationError, match="progress must be a callable taking a ProgressEvent"):
        pytest_precision.compare(TinyCausalLM(2), token_inputs(), ["bf16"], progress="stderr")  # type: ignore[arg-type]


def test_an_error_in_the_callback_reaches_the_caller_and_leaves_the_model_as_it_was() -> None:
    model = TinyCausalLM(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def failing(event: ProgressEvent) -> None:
        if event.phase == "backward":
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        pytest_precision.compare(model, token_inputs(), ["bf16"], progress=failing)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_progress_adds_no_host_synchronisation() -> None:
    """The same number of host syncs with a printer attached as without (events read no device value)."""
    plain, _ = counted_compare(4, ["bf16"])
    printer = ProgressPrinter(io.StringIO(), live=False, planned=[("reference", "fp32"), ("variant", "bf16")])
    watched, _ = counted_compare(4, ["bf16"], progress=printer)
    assert watched.total == plain.total, watched.describe()


def test_durations_read_as_people_read_them() -> None:
    assert duration(4.24) == "4.2s"
    assert duration(65) == "1m05s"
    assert duration(3725) == "1h02m"


def test_the_estimate_is_the_mean_finished_run_times_the_runs_left() -> None:
    assert remaining_estimate([], 3) is None
    assert remaining_estimate([2.0, 4.0], 3) == pytest.approx(9.0)
    assert remaining_estimate([2.0], 0) == 0


def printed(events: list[ProgressEvent], *, live: bool) -> str:
    stream = io.StringIO()
    printer = ProgressPrinter(stream, live=live, planned=[("reference", "fp32"), ("variant", "bf16")])
    for event in events:
        printer(event)
    printer.close()
    return stream.getvalue()


EVENTS = [
    ProgressEvent("fp32", "reference", "build", 1, 2),
    ProgressEvent("fp32", "reference", "forward", 1, 2),
    ProgressEvent("fp32", "reference", "done", 1, 2, seconds=80.0),
    ProgressEvent("bf16", "variant", "forward", 2, 2),
    ProgressEvent("bf16", "variant", "done", 2, 2, seconds=40.0),
]


def test_plain_lines_name_the_run_its_position_and_phase_and_estimate_after_a_run_finished() -> None:
    lines = printed(EVENTS, live=False).splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "reference fp32 (1/2): build",
        "reference fp32 (1/2): forward",
        "reference fp32 (1/2): done in 1m20s, about 1m20s left",
        "variant bf16 (2/2): forward",
        "variant bf16 (2/2): done in 40.0s",
    ]
    assert all(line.startswith("[") and "s] " in line for line in lines)
    assert "\r" not in "".join(lines)


def test_a_terminal_gets_one_line_rewritten_in_place_and_a_line_per_finished_run() -> None:
    text = printed(EVENTS, live=True)
    assert "\r\x1b[K[" in text  # the bar is rewritten in place
    assert "] 0/2 " in text and "reference fp32 (1/2): forward" in text
    assert "] 1/2 " in text and "variant bf16 (2/2): forward, about" in text  # the estimate while it runs
    finished = [line.split("] ", 1)[1] for line in text.replace("\r\x1b[K", "\n").splitlines() if "done in" in line]
    assert finished == ["reference fp32 (1/2): done in 1m20s, about 1m20s left", "variant bf16 (2/2): done in 40.0s"]
    assert text.endswith("\n")  # close() leaves no half-drawn bar behind


def test_the_live_bar_keeps_its_clock_running_during_a_long_phase_and_stops_on_close() -> None:
    import time

    stream = io.StringIO()
    printer = ProgressPrinter(stream, live=True, planned=[("reference", "fp32")], tick_seconds=0.02)
    printer(ProgressEvent("fp32", "reference", "forward", 1, 1))
    time.sleep(0.3)  # no event: the ticker alone redraws
    drawn = stream.getvalue().count("reference fp32 (1/1): forward")
    assert drawn >= 3
    printer.close()
    after = stream.getvalue()
    assert after.endswith("\r\x1b[K")
    time.sleep(0.1)
    assert stream.getvalue() == after  # nothing drawn once closed


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def live_estimates(clock: Clock, steps: list[tuple[float, ProgressEvent]]) -> list[str]:
    """The live bar's estimate after each event, the clock set to each step's time (no ticker redraws)."""
    stream = io.StringIO()
    planned: list[tuple[str, str]] = [("reference", "fp32"), ("variant", "bf16"), ("variant", "fp16")]
    printer = ProgressPrinter(stream, live=True, planned=planned, tick_seconds=3600, clock=clock)  # type: ignore[arg-type]
    shown = []
    for seconds, event in steps:
        clock.now = 1000.0 + seconds
        before = len(stream.getvalue())
        printer(event)
        drawn = stream.getvalue()[before:].split("\r\x1b[K")[-1]
        shown.append(
            drawn.split(f": {event.phase}", 1)[1] if event.phase != "done" else drawn.split("] ", 1)[1].strip()
        )
    printer.close()
    return shown


def test_the_estimate_counts_down_within_the_mean_and_never_below_what_is_plainly_left() -> None:
    """The reference took 80s. bf16 at 20s: 60s of its own and 80s for fp16 are left. Past 80s the mean says
    nothing about bf16's rest: the bar says so and counts fp16 only, never a negative or shrinking figure. The
    last run past the mean: no number at all."""
    clock = Clock()

    def reference(phase: str, seconds: float | None = None) -> ProgressEvent:
        return ProgressEvent("fp32", "reference", phase, 1, 3, seconds)  # type: ignore[arg-type]

    def bf16(phase: str, seconds: float | None = None) -> ProgressEvent:
        return ProgressEvent("bf16", "variant", phase, 2, 3, seconds)  # type: ignore[arg-type]

    def fp16(phase: str) -> ProgressEvent:
        return ProgressEvent("fp16", "variant", phase, 3, 3)  # type: ignore[arg-type]

    shown = live_estimates(
        clock,
        [
            (0.0, reference("forward")),
            (80.0, reference("done", 80.0)),
            (80.0, bf16("build")),
            (100.0, bf16("forward")),
            (150.0, bf16("backward")),
            (170.0, bf16("measure")),
            (400.0, bf16("measure")),
            (400.0, bf16("done", 320.0)),
            (400.0, fp16("build")),
            (500.0, fp16("forward")),
            (900.0, fp16("backward")),
        ],
    )
    assert shown == [
        "",  # no run finished yet: no estimate
        "reference fp32 (1/3): done in 1m20s, about 2m40s left",
        ", about 2m40s left",
        ", about 2m20s left",  # 60s of bf16 (at the 80s mean) and 80s of fp16
        ", about 1m30s left",
        # bf16 has run 90s, past the 80s mean: how much more it needs is unknown; fp16's 80s are counted, as such
        ", longer than the mean run (1m20s); about 1m20s left after it",
        ", longer than the mean run (1m20s); about 1m20s left after it",
        "variant bf16 (2/3): done in 5m20s, about 3m20s left",  # the mean is now (80 + 320) / 2 = 200s
        ", about 3m20s left",
        ", about 1m40s left",
        ", longer than the mean run (3m20s)",  # the last run past the mean: no figure
    ]
    assert not any("-" in line for line in shown)


@pytest.mark.parametrize("current", [0.0, 10.0, 59.9, 60.0, 61.0, 1e6])
@pytest.mark.parametrize("left", [1, 2, 5])
def test_time_left_is_never_negative_nor_below_the_runs_after_the_current_one(current: float, left: int) -> None:
    text = time_left([60.0], left, current)
    numbers = re.findall(r"about ([0-9.hms]+) left", text)
    assert "-" not in text
    if current < 60.0:
        assert text == f", about {duration(left * 60.0 - current)} left"
    else:  # the current run outlasted the mean: only the later runs are counted, by name
        assert text.startswith(", longer than the mean run (1m00s)")
        assert numbers == ([] if left == 1 else [duration((left - 1) * 60.0)])
        assert text.endswith("left after it") == (left > 1)
    assert time_left([60.0], left) == f", about {duration(left * 60.0)} left"
    assert time_left([], left, current) == "" and time_left([60.0], 0, current) == ""
