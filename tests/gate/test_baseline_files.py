"""Baseline files on disk: legal names, which files the plugin owns, atomic writes and their leftovers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_precision.base import atomic_files
from pytest_precision.base.atomic_files import TEMPORARY_SUFFIX, remove_stale_temporaries, write_atomically
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.gate.baseline import (
    MAX_STEM_BYTES,
    SCHEMA_VERSION,
    baseline_stem,
    checked_stem,
    owned_document,
    parse_baseline_name,
    stem_problem,
)

REPOSITORY = Path(__file__).resolve().parents[2]
#: The longest device key a file name gets ("cuda-sm" and a two-digit major, minor).
LONGEST_SUFFIX = ".cuda-sm120.json"


@pytest.mark.parametrize(
    ("stem", "reason"),
    [
        ("", "it is empty"),
        ("/etc/passwd", "it is an absolute path"),
        ("\\server\\share", "it is an absolute path"),
        ("C:\\stem", "it is an absolute path"),
        ("C:stem", "it holds ':', not allowed in a file name on every system"),
        ("..", "it climbs out of the baseline folder with '..'"),
        ("../outside", "it climbs out of the baseline folder with '..'"),
        ("a/../../b", "it climbs out of the baseline folder with '..'"),
        ("sub/name", "it holds a path separator ('/' or '\\'); subfolders are not supported"),
        ("sub\\name", "it holds a path separator ('/' or '\\'); subfolders are not supported"),
        ("a<b>c", "it holds '<', '>', not allowed in a file name on every system"),
        ('say "hi"', "it holds '\"', not allowed in a file name on every system"),
        ("a|b?c*", "it holds '*', '?', '|', not allowed in a file name on every system"),
        ("tab\there", "it holds '\\t', not allowed in a file name on every system"),
        ("nul\x00byte", "it holds '\\x00', not allowed in a file name on every system"),
        (".hidden", "it starts with '.' (a hidden file)"),
        ("trailing.", "it ends with a dot or a space (Windows drops those)"),
        ("trailing ", "it ends with a dot or a space (Windows drops those)"),
        ("CON", "'CON' is a device name Windows reserves"),
        ("nul.result", "'nul' is a device name Windows reserves"),
        ("Lpt9", "'Lpt9' is a device name Windows reserves"),
        ("com1.x", "'com1' is a device name Windows reserves"),
        ("CON .txt", "'CON ' is a device name Windows reserves"),
        ("lpt³", "'lpt³' is a device name Windows reserves"),
        ("Com².cpu", "'Com²' is a device name Windows reserves"),
        ("x" * (MAX_STEM_BYTES + 1), "it is 201 bytes long in UTF-8, more than the 200 that fit every filesystem"),
        ("é" * 101, "it is 202 bytes long in UTF-8, more than the 200 that fit every filesystem"),
    ],
)
def test_names_no_system_can_hold_are_refused(stem, reason):
    assert stem_problem(stem) == reason
    with pytest.raises(ConfigurationError) as error:
        checked_stem(stem)
    message = str(error.value)
    assert message.startswith("baseline=")
    assert f"cannot name a baseline file: {reason}. Give a plain file name stem such as baseline=" in message


@pytest.mark.parametrize(
    "stem", ["llama_bf16", "a.b-c_d", "CONSOLE", "con_", "com10", "x" * MAX_STEM_BYTES, "é" * 100, "日本語", "a b"]
)
def test_names_every_system_can_hold_are_accepted(stem):
    assert stem_problem(stem) is None
    assert checked_stem(stem) == stem


def test_a_baseline_name_must_be_a_string():
    with pytest.raises(ConfigurationError, match=r"^baseline= must be a string \(a file name stem\), got PosixPath$"):
        checked_stem(Path("x"))


def test_longest_names_fit_with_their_temporary_file(tmp_path):
    # 200 bytes of stem, the longest device key, and write_atomically's temporary twin all fit in the 255 bytes
    # a file name may have: the write succeeds on this (Linux, 255-byte) filesystem.
    name = "x" * MAX_STEM_BYTES + LONGEST_SUFFIX
    assert len(name.encode()) <= 255
    write_atomically(tmp_path / name, "{}\n")
    assert (tmp_path / name).read_text() == "{}\n"
    multibyte = "é" * 100 + LONGEST_SUFFIX
    write_atomically(tmp_path / multibyte, "{}\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(TEMPORARY_SUFFIX)] == []


def test_stems_of_ordinary_test_ids_are_unchanged():
    assert baseline_stem("tests/test_x.py::test_llama_bf16") == "test_llama_bf16"
    assert baseline_stem("test_x.py::TestLlama::test_y[bf16-2]") == "TestLlama.test_y_bf16-2"
    assert baseline_stem("test_x.py::test_y[a/b c]") == "test_y_a_b_c"


def test_stems_of_ids_naming_windows_devices_or_ending_in_a_dot():
    assert baseline_stem("test_x.py::Aux::test_y") == "Aux_.test_y"
    assert baseline_stem("test_x.py::CON") == "CON_"
    assert baseline_stem("test_x.py::test_y[a.]") == "test_y_a"
    for stem in ("Aux_.test_y", "CON_", "test_y_a"):
        assert stem_problem(stem) is None


def test_long_parametrized_ids_are_cut_with_a_stable_unique_hash():
    first = "test_x.py::test_long[" + "-".join(f"param{i}" for i in range(60)) + "]"
    second = first[:-2] + "X]"  # differs only past the cut
    stem = baseline_stem(first)
    assert len(stem) == MAX_STEM_BYTES
    assert re.fullmatch(r"test_long_param0-param1-.*-[0-9a-f]{12}", stem)
    assert stem_problem(stem) is None
    assert baseline_stem(first) == stem  # stable: the same name every run
    assert baseline_stem(second) != stem  # unique: the hash covers the whole id
    assert baseline_stem(second)[:-12] == stem[:-12]
    # Stable across processes too (no per-process hash seed).
    code = f"from pytest_precision.gate.baseline import baseline_stem; print(baseline_stem({first!r}))"
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": str(REPOSITORY)}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == stem


@pytest.mark.parametrize(
    "nodeid",
    [
        't.py::test_[<>:"/\\|?*]',
        "t.py::test_x[\x00\x1f]",
        "t.py::test_x[日本語]",
        "t.py::test_x[ . ]",
        "t.py::test_x[..]",
        "t.py::Nul::test_x",
        "t.py::test_x[" + "é" * 300 + "]",
    ],
)
def test_every_test_id_gives_a_legal_stem(nodeid):
    assert stem_problem(baseline_stem(nodeid)) is None


def test_baseline_file_names_are_recognised():
    assert parse_baseline_name("test_x.cpu.json") == ("test_x", "cpu")
    assert parse_baseline_name("T.test_y_bf16.cuda-sm90.json") == ("T.test_y_bf16", "cuda-sm90")
    for name in ("settings.json", "package.json", "test_x.json", "test_x.cuda.json", ".x.cpu.json", "x.cpu.json.bak"):
        assert parse_baseline_name(name) is None, name


def _document(**changes):
    return {"schema_version": SCHEMA_VERSION, "test": "test_x.py::test_y", "variants": {}, **changes}


@pytest.mark.parametrize(
    ("name", "content", "owned"),
    [
        ("test_y.cpu.json", _document(), True),
        ("test_y.cuda-sm90.json", _document(), True),
        ("settings.json", _document(), False),
        ("test_y.cpu.json", _document(schema_version=99), False),
        ("test_y.cpu.json", _document(test=42), False),
        ("test_y.cpu.json", _document(test="not a test id"), False),
        ("test_y.cpu.json", {"schema_version": SCHEMA_VERSION, "test": "a.py::b"}, False),
        ("test_y.cpu.json", [_document()], False),
        ("test_y.cpu.json", "not json {", False),
    ],
)
def test_owned_documents(tmp_path, name, content, owned):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert (owned_document(path) is not None) is owned


def test_a_reader_holding_the_old_file_reads_the_old_content(tmp_path):
    path = tmp_path / "test_y.cpu.json"
    write_atomically(path, "old\n" * 1000)
    with open(path, encoding="utf-8") as held:
        write_atomically(path, "new\n")
        assert held.read() == "old\n" * 1000
    assert path.read_text() == "new\n"


def test_a_writer_between_the_data_and_the_rename_cannot_mix_documents(tmp_path, monkeypatch):
    """A second writer runs while the first has written its data but not yet renamed it (os.fsync is the
    pause point): both complete, and the file holds one whole document."""
    path = tmp_path / "test_y.cpu.json"
    first, second = "A" * 50_000 + "\n", "B" * 10 + "\n"
    fsync = os.fsync
    nested = []

    def fsync_then_write(descriptor):
        fsync(descriptor)
        if not nested:
            nested.append(True)
            write_atomically(path, second)

    monkeypatch.setattr(os, "fsync", fsync_then_write)
    write_atomically(path, first)
    assert nested
    assert path.read_text() in (first, second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_y.cpu.json"]


#: A writer process: 60 whole documents of 100,001 characters, "A0A0...", "A1A1...", ... (or B).
WRITER = """
import sys
from pathlib import Path
from pytest_precision.base.atomic_files import write_atomically
for i in range(60):
    write_atomically(Path(sys.argv[1]), f"{sys.argv[2]}{i % 10}" * 50_000 + "\\n")
"""


def test_two_writer_processes_and_a_reader_see_only_whole_documents(tmp_path):
    path = tmp_path / "test_y.cpu.json"
    write_atomically(path, "A0" * 50_000 + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), letter], env=env) for letter in "AB"]
    reads = 0
    while any(writer.poll() is None for writer in writers) or reads == 0:
        text = path.read_text()
        assert re.fullmatch(r"([AB]\d)\1{49999}\n", text), f"a torn read: {len(text)} characters"
        reads += 1
    assert [writer.wait() for writer in writers] == [0, 0]
    assert re.fullmatch(r"([AB]\d)\1{49999}\n", path.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_y.cpu.json"]


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _leftover(folder: Path, pid: int, age_seconds: float, token: str = "abc123_x") -> Path:
    path = folder / f".test_y.cpu.json.{pid}.{token}{TEMPORARY_SUFFIX}"
    path.write_text('{"half": ')
    stamp = time.time() - age_seconds
    os.utime(path, (stamp, stamp))
    return path


def test_temporary_files_are_named_for_gitignore_and_removed_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "test_y.cpu.json"
    path.write_text("old\n")
    seen = []

    def failing_replace(source, target):
        seen.append(Path(source).name)
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(PermissionError):
        write_atomically(path, "new\n")
    assert re.fullmatch(rf"\.test_y\.cpu\.json\.{os.getpid()}\.[a-z0-9_]+\.precision-tmp", seen[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_y.cpu.json"]
    assert path.read_text() == "old\n"
    assert "*.precision-tmp" in (REPOSITORY / ".gitignore").read_text().splitlines()


def test_leftovers_of_dead_or_old_writers_are_removed_not_those_of_live_ones(tmp_path):
    dead = _leftover(tmp_path, _dead_pid(), age_seconds=60, token="dead")
    old = _leftover(tmp_path, os.getpid(), age_seconds=3600, token="old")
    live = _leftover(tmp_path, os.getpid(), age_seconds=60, token="live")
    # A writer that just died here may be one at work on another machine sharing the folder: a grace period.
    just_died = _leftover(tmp_path, _dead_pid(), age_seconds=0, token="died")
    others = [tmp_path / name for name in ("notes.precision-tmp", ".x.json.123.tmp", f".x.{os.getpid()}.json")]
    for other in others:
        other.write_text("not ours")
        os.utime(other, (0, 0))

    write_atomically(tmp_path / "test_z.cpu.json", "{}\n")
    assert not dead.exists() and not old.exists()
    assert live.exists() and just_died.exists()
    assert all(other.exists() for other in others)


def test_a_recursive_sweep_finds_leftovers_in_subfolders(tmp_path):
    (tmp_path / "tests" / "test_x").mkdir(parents=True)
    leftover = _leftover(tmp_path / "tests" / "test_x", _dead_pid(), age_seconds=60)
    assert remove_stale_temporaries(tmp_path) == []
    assert remove_stale_temporaries(tmp_path, recursive=True) == [leftover]
    assert not leftover.exists()


def test_an_unreadable_folder_is_not_an_error(tmp_path):
    assert remove_stale_temporaries(tmp_path / "missing", recursive=True) == []
    assert atomic_files.STALE_TEMPORARY_SECONDS >= 60
