"""One run at a time per --output-dir: the claim file (claim_exclusively) taken when the folder is checked and
removed when the run ends; a live holder refuses a second run (also with --overwrite), a dead one (killed, even
by SIGKILL) is taken over; two real processes started together never mix their files."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_LLAMA_DIR
from pytest_precision.base import atomic_files
from pytest_precision.base.atomic_files import (
    CLAIM_STARTING_SECONDS,
    STALE_TAKEOVER_SECONDS,
    Claim,
    ClaimFileError,
    Holder,
    claim_exclusively,
    claim_names,
    ordinary_mode,
)
from pytest_precision.base.errors import PrecisionError
from pytest_precision.cli import checkpoint
from pytest_precision.cli.checkpoint import open_checkpoint
from pytest_precision.cli.main import main
from pytest_precision.cli.run import RunOptions, run_checkpoint
from pytest_precision.cli.run_outputs import CLAIM_FILE, prepare_output_dir
from pytest_precision.gate.report_files import reports_in

HOST = socket.gethostname()
#: `pytest-precision run ARGS...` whose run waits, once the folder is claimed, until the file GO exists.
HELD_RUN = """
import sys, time
from pathlib import Path

import pytest_precision.cli.checkpoint as checkpoint
from pytest_precision.cli.main import main

go, opened = Path(sys.argv[1]), checkpoint.open_checkpoint


def held_open(directory):
    while not go.exists():
        time.sleep(0.02)
    return opened(directory)


checkpoint.open_checkpoint = held_open
sys.exit(main(sys.argv[2:]))
"""
#: Claims the file argv[1] at time argv[2] (all processes together), prints "claimed" or "held", keeps it 1 s.
CLAIMER = """
import sys, time
from pathlib import Path

from pytest_precision.base.atomic_files import Claim, claim_exclusively

time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
claim = claim_exclusively(Path(sys.argv[1]))
print("claimed" if isinstance(claim, Claim) else "held", flush=True)
time.sleep(1.0)
"""


def cli_run(*args: str | Path) -> tuple[int, str]:
    """`pytest-precision run ARGS` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["run", *map(str, args)])
    return code, err.getvalue()


def cli_process(*args: str | Path, script: str | None = None) -> subprocess.Popen[str]:
    """`pytest-precision run ARGS` as a process of its own (`script`: run by python -c instead, given ARGS)."""
    command = ["-m", "pytest_precision.cli.main", "run"] if script is None else ["-c", script]
    return subprocess.Popen(
        [sys.executable, *command, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def ended_pid() -> int:
    """The pid of a process that has ended."""
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)


def write_claim(path: Path, pid: int, host: str = HOST, age_s: float = 0.0) -> Path:
    """A claim file as another process leaves it, `age_s` seconds old."""
    path.write_text(json.dumps({"pid": pid, "host": host, "started": "2026-01-01T00:00:00+00:00", "token": "x"}))
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def wait_for(path: Path, process: subprocess.Popen[str], timeout_s: float = 120.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)
    return path


def test_a_claim_holds_until_released_and_names_its_holder(tmp_path: Path) -> None:
    path = tmp_path / CLAIM_FILE
    claim = claim_exclusively(path)
    assert isinstance(claim, Claim)
    record = json.loads(path.read_text())
    assert (record["pid"], record["host"]) == (os.getpid(), HOST) and record["started"].endswith("+00:00")
    assert stat.S_IMODE(path.stat().st_mode) == ordinary_mode()
    assert claim_exclusively(path) == Holder(os.getpid(), HOST, record["started"])  # held, also against itself
    with claim:
        pass
    assert not path.exists()
    claim.release()  # again: nothing
    second = claim_exclusively(path)
    assert isinstance(second, Claim) and second.token != claim.token
    # Released after another took over: the other's claim stays.
    path.unlink()
    third = claim_exclusively(path)
    second.release()
    assert isinstance(third, Claim) and json.loads(path.read_text())["token"] == third.token
    third.release()


def test_a_claim_of_an_ended_process_is_taken_over_and_no_other(tmp_path: Path) -> None:
    path = tmp_path / CLAIM_FILE
    dead = ended_pid()
    write_claim(path, dead)
    claim = claim_exclusively(path)
    assert isinstance(claim, Claim) and json.loads(path.read_text())["pid"] == os.getpid()
    claim.release()
    # A process of another host sharing the folder cannot be checked: it is taken to live.
    write_claim(path, dead, host="elsewhere.example")
    assert claim_exclusively(path) == Holder(dead, "elsewhere.example", "2026-01-01T00:00:00+00:00")
    # A live process of this host, however old its claim.
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        try:
            write_claim(path, live.pid, age_s=3600)
            assert claim_exclusively(path) == Holder(live.pid, HOST, "2026-01-01T00:00:00+00:00")
        finally:
            live.kill()
    live.wait()
    claim = claim_exclusively(path)
    assert isinstance(claim, Claim)
    claim.release()


def test_a_claim_being_written_is_respected_and_an_unreadable_old_one_taken_over(tmp_path: Path) -> None:
    path = tmp_path / CLAIM_FILE
    path.write_text("")  # created, its content not yet written
    assert claim_exclusively(path) == Holder(None, None, None)
    old = time.time() - CLAIM_STARTING_SECONDS - 5
    os.utime(path, (old, old))
    claim = claim_exclusively(path)
    assert isinstance(claim, Claim)
    claim.release()


@pytest.mark.parametrize("half", [{"host": "HOST"}, {"pid": 1}, {"pid": "12", "host": "HOST"}])
def test_a_claim_naming_no_pid_or_no_host_is_judged_by_its_age_alone(tmp_path: Path, half: dict[str, object]) -> None:
    """A claim file that says who holds it only in part (another writer's, an edited one) cannot be checked by
    pid: it is respected while young and taken over once old, never judged by a pid it does not give."""
    path = tmp_path / CLAIM_FILE
    path.write_text(json.dumps({key: socket.gethostname() if v == "HOST" else v for key, v in half.items()}))
    assert isinstance(claim_exclusively(path), Holder)
    old = time.time() - CLAIM_STARTING_SECONDS - 5
    os.utime(path, (old, old))
    claim = claim_exclusively(path)
    assert isinstance(claim, Claim)
    claim.release()


def test_a_takeover_file_left_by_a_killed_process_does_not_block(tmp_path: Path) -> None:
    path = write_claim(tmp_path / CLAIM_FILE, ended_pid())
    guard = tmp_path / claim_names(path)[1]
    guard.write_text("{}")
    assert isinstance(claim_exclusively(path), Holder)  # someone is taking over just now: not this process
    assert guard.exists() and path.exists()
    old = time.time() - STALE_TAKEOVER_SECONDS - 5
    os.utime(guard, (old, old))
    claim = claim_exclusively(path)
    assert isinstance(claim, Claim) and not guard.exists()
    claim.release()
    assert list(tmp_path.iterdir()) == []


def test_a_dead_claim_that_another_takes_over_meanwhile_is_left_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_claim(tmp_path / CLAIM_FILE, ended_pid())
    judged = atomic_files._holder_gone
    others: list[Claim | Holder] = []

    def overtaken(holder: Holder, age_s: float) -> bool:
        """The dead claim is judged gone; before this process removes it, another has taken it over."""
        verdict = judged(holder, age_s)
        if verdict and not others:
            path.unlink()
            others.append(claim_exclusively(path))
        return verdict

    monkeypatch.setattr(atomic_files, "_holder_gone", overtaken)
    held = claim_exclusively(path)
    (other,) = others
    assert isinstance(other, Claim)
    record = json.loads(path.read_text())
    assert record["token"] == other.token  # the other's claim stands
    assert held == Holder(os.getpid(), HOST, record["started"])  # and holds this process off
    other.release()


def test_of_processes_taking_over_a_dead_claim_at_once_exactly_one_gets_it(tmp_path: Path) -> None:
    path = write_claim(tmp_path / CLAIM_FILE, ended_pid())
    start = time.time() + 2.0  # every process has imported by then
    processes = [cli_process(path, start, script=CLAIMER) for _ in range(6)]
    said = sorted(process.communicate(timeout=60)[0].strip() for process in processes)
    assert said == ["claimed"] + ["held"] * 5


def test_the_emptiness_check_ignores_the_runs_own_claim_and_a_refusal_leaves_none(tmp_path: Path) -> None:
    output = tmp_path / "new" / "out"
    claim = prepare_output_dir(output, overwrite=False)
    assert [p.name for p in output.iterdir()] == [CLAIM_FILE]
    claim.release()
    assert list(output.iterdir()) == []
    (output / "notes.txt").write_text("mine")
    with pytest.raises(PrecisionError, match="is not empty"):
        prepare_output_dir(output, overwrite=False)
    assert [p.name for p in output.iterdir()] == ["notes.txt"]
    with prepare_output_dir(output, overwrite=True):
        assert sorted(p.name for p in output.iterdir()) == [CLAIM_FILE, "notes.txt"]
    assert [p.name for p in output.iterdir()] == ["notes.txt"]


def test_a_live_run_refuses_a_second_one_also_with_overwrite(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            write_claim(output / CLAIM_FILE, other.pid)
            for overwrite in (False, True):
                with pytest.raises(PrecisionError) as refused:
                    prepare_output_dir(output, overwrite=overwrite)
                assert str(refused.value) == (
                    f"another pytest-precision run (pid {other.pid} on {HOST}, started 2026-01-01T00:00:00+00:00) "
                    f"is writing {output}; wait for it or choose another --output-dir (if that run is gone, delete "
                    f"{output / CLAIM_FILE})"
                )
        finally:
            other.kill()
    assert json.loads((output / CLAIM_FILE).read_text())["pid"] == other.pid  # not taken while it lived
    (output / CLAIM_FILE).write_text("")
    with pytest.raises(
        PrecisionError,
        match=r"^another pytest-precision run \(one starting just now: its claim file names no process yet\) is ",
    ):
        prepare_output_dir(output, overwrite=True)


@pytest.mark.parametrize("ending", [KeyboardInterrupt(), PrecisionError("no such checkpoint")])
def test_a_run_removes_its_claim_however_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: BaseException
) -> None:
    output = tmp_path / "out"

    def interrupted(directory: Path) -> None:
        assert (output / CLAIM_FILE).is_file()  # held while the run goes on
        raise ending

    monkeypatch.setattr(checkpoint, "open_checkpoint", interrupted)
    options = RunOptions(TINY_LLAMA_DIR, length=8, output_dir=output, quiet=True)
    with pytest.raises(type(ending)):
        run_checkpoint(options, out=io.StringIO())
    assert list(output.iterdir()) == []
    # Refused by a check after the folder was claimed: no claim either.
    (tmp_path / "ref.safetensors").write_bytes(b"")
    with pytest.raises(PrecisionError, match="exists; pass --overwrite"):
        run_checkpoint(RunOptions(TINY_LLAMA_DIR, output_dir=output, save_reference=tmp_path / "ref.safetensors"))
    assert list(output.iterdir()) == []


def test_a_run_holds_its_folder_against_another_until_it_ends_even_when_killed(tmp_path: Path) -> None:
    output, go = tmp_path / "out", tmp_path / "go"
    args = ("run", TINY_LLAMA_DIR, "--length", "8", "--output-dir", output, "--quiet")
    held = cli_process(go, *args, "--variants", "fp16", script=HELD_RUN)
    try:
        record = json.loads(wait_for(output / CLAIM_FILE, held).read_text())
        assert record["pid"] == held.pid
        for extra in ([], ["--overwrite"]):
            code, err = cli_run(*args[1:], "--variants", "bf16", *extra)
            assert code == 2
            assert err == (
                f"pytest-precision run: another pytest-precision run (pid {held.pid} on {HOST}, started "
                f"{record['started']}) is writing {output}; wait for it or choose another --output-dir (if that "
                f"run is gone, delete {output / CLAIM_FILE})\n"
            )
        held.send_signal(signal.SIGKILL)  # no finally runs: its claim stays behind
        held.wait(timeout=60)
        assert json.loads((output / CLAIM_FILE).read_text())["pid"] == held.pid
    finally:
        held.kill()
        held.communicate()
    code, err = cli_run(*args[1:], "--variants", "bf16")
    assert code == 0, err
    assert sorted(p.name for p in output.rglob("*")) == sorted(
        ["precision-report.json", "summary.md", "inputs.safetensors", "logprobs", "bf16.npy", "reference.npy"]
        + (["error-vs-depth.png"] if (output / "error-vs-depth.png").exists() else [])
    )


def test_two_runs_started_together_into_one_new_folder_never_mix_their_files(tmp_path: Path) -> None:
    output = tmp_path / "out"
    seeds = {"fp16": 1, "bf16": 2}
    processes = {
        variant: cli_process(
            TINY_LLAMA_DIR, "--length", "8", "--variants", variant, "--seed", seed, "--output-dir", output, "--quiet"
        )
        for variant, seed in seeds.items()
    }
    ended = {variant: (p.wait(timeout=300), p.communicate()[1]) for variant, p in processes.items()}
    (winner,) = [variant for variant, (code, _) in ended.items() if code == 0]
    ((code, err),) = [ended[variant] for variant in seeds if variant != winner]
    assert code == 2
    assert err.startswith(
        (
            f"pytest-precision run: another pytest-precision run (pid {processes[winner].pid} on {HOST}, started ",
            f"pytest-precision run: --output-dir {output} is not empty: ",  # the winner had ended already
            # the winner's claim file was there, its pid not yet written in it
            "pytest-precision run: another pytest-precision run (one starting just now: its claim file names no "
            f"process yet) is writing {output}; ",
        )
    ), err
    # Every file is the winner's: its variant, and the inputs its seed makes.
    assert sorted(p.name for p in (output / "logprobs").iterdir()) == [f"{winner}.npy", "reference.npy"]
    ((_, report),) = reports_in(output / "precision-report.json").items()
    assert report.variants == [winner]
    made = {
        variant: open_checkpoint(TINY_LLAMA_DIR).inputs(batch=2, length=8, text_file=None, seed=seed)["input_ids"]
        for variant, seed in seeds.items()
    }
    assert not torch.equal(made["fp16"], made["bf16"])
    assert torch.equal(load_file(output / "inputs.safetensors")["input_ids"], made[winner])
    assert not (output / CLAIM_FILE).exists()


def claim_then(path: Path, make: str) -> None:
    """Put at the claim path `path` what no run makes (`make`), its target where it has one."""
    if make == "fifo":
        os.mkfifo(path)
    elif make == "folder":
        path.mkdir()
        (path / "kept.txt").write_text("mine")
    elif make == "link to a claim":
        write_claim(path.with_name("elsewhere.lock"), os.getpid())
        path.symlink_to(path.with_name("elsewhere.lock"))
    elif make == "dangling link":
        path.symlink_to(path.with_name("nowhere"))


@pytest.mark.parametrize(
    "make, kind",
    [
        ("fifo", "a FIFO (named pipe)"),
        ("folder", "a folder"),
        ("link to a claim", "a symbolic link"),
        ("dangling link", "a symbolic link"),
    ],
)
def test_a_claim_path_that_is_no_file_is_refused_in_one_line_and_left_alone(
    tmp_path: Path, make: str, kind: str
) -> None:
    """A FIFO made `run` wait forever for a writer; a folder read as 'cannot write there (Is a directory)', a link
    was followed. Each is one line, exit 2, and is left where it is (never the run's to remove)."""
    output = tmp_path / "out"
    output.mkdir()
    claim_then(output / CLAIM_FILE, make)
    before = sorted((p.name, p.is_symlink()) for p in output.rglob("*"))
    process = cli_process(TINY_LLAMA_DIR, "--length", "8", "--variants", "bf16", "--output-dir", output, "--quiet")
    try:
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 2
    assert err == (
        f"pytest-precision run: --output-dir {output}: {output / CLAIM_FILE} is {kind}, not a file a "
        f"pytest-precision run makes; if no run is writing to {output}, delete it\n"
    )
    assert sorted((p.name, p.is_symlink()) for p in output.rglob("*")) == before


def test_a_takeover_file_that_is_no_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = write_claim(tmp_path / CLAIM_FILE, ended_pid())
    guard = tmp_path / claim_names(path)[1]
    guard.mkdir()
    old = time.time() - STALE_TAKEOVER_SECONDS - 5
    os.utime(guard, (old, old))
    with pytest.raises(ClaimFileError, match=rf"^{guard} is a folder, not a file a pytest-precision run makes; "):
        claim_exclusively(path)
    assert guard.is_dir() and path.exists()


def test_an_unreadable_claim_file_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's claim (their umask 077) cannot be read: it may hold the folder, so it is not taken over.
    EACCES is simulated: this suite may run as root, which reads any file."""
    output = tmp_path / "out"
    output.mkdir()
    claim = write_claim(output / CLAIM_FILE, 1)
    opened = os.open

    def refused(path: str | Path, flags: int, *args: int, **kwargs: object) -> int:
        if Path(path) == claim and not flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied")
        return opened(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(atomic_files.os, "open", refused)
    code, err = cli_run(TINY_LLAMA_DIR, "--length", "8", "--output-dir", output, "--quiet")
    assert code == 2
    assert err == (
        f"pytest-precision run: --output-dir {output}: cannot read the claim file {claim} (Permission denied): "
        f"another user's run may hold {output}; if no run is writing there, delete it\n"
    )
    assert claim.exists()


@pytest.mark.parametrize(
    "content",
    [
        {"pid": 10**30, "host": "HOST"},  # OverflowError in os.kill before
        {"pid": 2**31, "host": "HOST"},
        {"pid": -1, "host": "HOST"},  # os.kill(-1, 0): every process, so "alive" before
        {"pid": 0, "host": "HOST"},  # os.kill(0, 0): this process group
        {"pid": True, "host": "HOST"},  # pid 1 before
        {"pid": 12.0, "host": "HOST"},
        {"pid": "12.5", "host": "HOST"},
        b'{"pid": 1, "host": "\xff"}',  # not UTF-8
        b"{" + b" " * 10_000 + b'"pid": 1, "host": "HOST"}',  # no claim is that long
    ],
)
def test_a_claim_naming_no_valid_process_is_refused_while_young_and_taken_over_when_old(
    tmp_path: Path, content: dict[str, object] | bytes
) -> None:
    """Judged like a claim being written: one line and exit 2 while it is younger than CLAIM_STARTING_SECONDS,
    then taken over; never a traceback, never a pid that is no process shown or signalled."""
    output = tmp_path / "out"
    output.mkdir()
    claim = output / CLAIM_FILE
    if isinstance(content, bytes):
        claim.write_bytes(content.replace(b"HOST", HOST.encode()))
    else:
        claim.write_text(json.dumps({k: HOST if v == "HOST" else v for k, v in content.items()}))
    code, err = cli_run(TINY_LLAMA_DIR, "--length", "8", "--output-dir", output, "--quiet")
    assert code == 2
    assert err == (
        "pytest-precision run: another pytest-precision run (one starting just now: its claim file names no "
        f"process yet) is writing {output}; wait for it or choose another --output-dir (if that run is gone, "
        f"delete {claim})\n"
    )
    old = time.time() - CLAIM_STARTING_SECONDS - 5
    os.utime(claim, (old, old))
    taken = claim_exclusively(claim)
    assert isinstance(taken, Claim) and json.loads(claim.read_text())["pid"] == os.getpid()
    taken.release()


def test_a_claims_host_or_start_that_would_break_the_line_is_not_shown(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    claim = output / CLAIM_FILE
    claim.write_text(json.dumps({"pid": 1, "host": f"{HOST}\nforged line", "started": "x\ry"}))
    code, err = cli_run(TINY_LLAMA_DIR, "--length", "8", "--output-dir", output, "--quiet")
    assert code == 2
    assert err.startswith("pytest-precision run: another pytest-precision run (pid 1) is writing ")
    assert err.count("\n") == 1 and "\r" not in err


def test_an_old_claim_of_an_overflowing_pid_is_taken_over_by_a_run(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    write_claim(output / CLAIM_FILE, 10**30, age_s=CLAIM_STARTING_SECONDS + 5)
    code, err = cli_run(TINY_LLAMA_DIR, "--length", "8", "--variants", "bf16", "--output-dir", output, "--quiet")
    assert code == 0, err
    assert not (output / CLAIM_FILE).exists()


def test_a_claim_replaced_by_a_fifo_is_left_alone_on_release(tmp_path: Path) -> None:
    path = tmp_path / CLAIM_FILE
    claim = claim_exclusively(path)
    assert isinstance(claim, Claim)
    path.unlink()
    os.mkfifo(path)
    claim.release()  # not this claim's file any more: no hang, no error, not removed
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


def test_a_temporary_file_naming_an_overflowing_pid_is_judged_by_its_age(tmp_path: Path) -> None:
    leftover = tmp_path / f".report.json.{10**30}.abc{atomic_files.TEMPORARY_SUFFIX}"
    leftover.write_text("partial")
    old = time.time() - atomic_files.DEAD_WRITER_GRACE_SECONDS - 5
    os.utime(leftover, (old, old))
    assert atomic_files.remove_stale_temporaries(tmp_path) == [leftover]
