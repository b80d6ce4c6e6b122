"""Every file the plugin writes goes through `write_atomically`: a temporary file beside the target, fsync,
the umask's ordinary mode, then os.replace. A reader sees the old or the new content, never a part; of two
writers one whole file wins, also across processes; and no writer differs in mode, durability or the name of
its temporary file.

The one other way a file is made here is `claim_exclusively`: a claim file created only where none is (O_EXCL),
by which one process holds a folder (`pytest-precision run --output-dir`) against others until it ends.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_precision.base.errors import PrecisionError

#: Temporary files of write_atomically end with this; `*.precision-tmp` in .gitignore keeps leftovers of an
#: interrupted write out of commits, and later writes remove them (remove_stale_temporaries).
TEMPORARY_SUFFIX = ".precision-tmp"
#: A temporary file older than this is a leftover even when a process of its writer's pid lives: a write
#: takes milliseconds, and pids are reused.
STALE_TEMPORARY_SECONDS = 600.0
#: A leftover of a dead writer is removed only after this grace, so that a writer on another machine
#: sharing the folder (whose pid means nothing here) can finish its write.
DEAD_WRITER_GRACE_SECONDS = 10.0
_TEMPORARY = re.compile(rf"^\..*\.(?P<pid>\d+)\.[A-Za-z0-9_]+{re.escape(TEMPORARY_SUFFIX)}$")

#: What write_atomically writes: text (UTF-8), bytes, or a function writing the file at the path it is given
#: (for writers that only take a file name, like safetensors' save_file or matplotlib's savefig).
Content = str | bytes | Callable[[Path], None]


#: Process ids are positive C ints (pid_t): 0 and negatives name process groups in os.kill, and a larger number
#: overflows it (OverflowError).
_PID_LIMIT = 2**31


def _process_alive(pid: int) -> bool:
    if not 0 < pid < _PID_LIMIT:
        return False  # no process has it: os.kill would signal a group (0, negative) or overflow
    if sys.platform == "win32":
        return True  # os.kill(pid, 0) would terminate it there: rely on the age alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def remove_stale_temporaries(directory: Path, *, recursive: bool = False) -> list[Path]:
    """Delete the leftovers of interrupted writes in `directory`: files named like write_atomically's
    temporary files whose writer process is gone, or that are older than STALE_TEMPORARY_SECONDS. Those of a
    writer still at work are kept. Returns the deleted paths."""
    candidates = directory.rglob(f"*{TEMPORARY_SUFFIX}") if recursive else directory.glob(f"*{TEMPORARY_SUFFIX}")
    now = time.time()
    removed = []
    try:
        for path in sorted(candidates):
            match = _TEMPORARY.match(path.name)
            if match is None or path.is_symlink() or not path.is_file():
                continue
            age = now - path.stat().st_mtime
            dead = age > DEAD_WRITER_GRACE_SECONDS and not _process_alive(int(match["pid"]))
            if dead or age > STALE_TEMPORARY_SECONDS:
                path.unlink(missing_ok=True)
                removed.append(path)
    except OSError:
        pass  # an unreadable folder or a file removed meanwhile: the next write tries again
    return removed


def _temporary_prefix(name: str) -> str:
    """ "." + the target's name (cut to 100 bytes, so the temporary name fits where the target fits) + pid."""
    short = name.encode("utf-8", "surrogatepass")[:100].decode("utf-8", "ignore")
    return f".{short}.{os.getpid()}."


def ordinary_mode() -> int:
    """The mode an ordinary `open(path, "w")` gives a new file: 0666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomically(path: Path, content: Content, *, make_parents: bool = True) -> None:
    """Write `content` to `path` via a temporary file in the same folder and os.replace.

    The temporary file is .<name>.<pid>.<random>.precision-tmp; leftovers of interrupted writes in the folder
    are removed first (remove_stale_temporaries). The file gets the umask's ordinary mode (mkstemp's 0600 is
    not kept) and is fsynced before it replaces the target. `make_parents=False` refuses a missing folder
    (FileNotFoundError) instead of creating it.
    """
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    descriptor, name = tempfile.mkstemp(prefix=_temporary_prefix(path.name), suffix=TEMPORARY_SUFFIX, dir=path.parent)
    temporary = Path(name)
    try:
        if callable(content):
            os.close(descriptor)
            content(temporary)
            descriptor = os.open(temporary, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        else:
            data = content.encode("utf-8") if isinstance(content, str) else content
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(temporary, ordinary_mode())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


#: A claim file whose content cannot be read yet, younger than this, is being written by its creator just now
#: (creating and writing it are two steps); older, its creator died in between.
CLAIM_STARTING_SECONDS = 10.0
#: Taking over a dead process's claim takes milliseconds: a takeover file older than this was left by a process
#: killed meanwhile.
STALE_TAKEOVER_SECONDS = 10.0
#: How often a claim is tried before giving up, while other processes take over a dead claim at the same time.
CLAIM_ATTEMPTS = 50
_TAKEOVER_SUFFIX = ".takeover"


def create_exclusively(path: Path, content: str) -> bool:
    """Create `path` holding `content` (UTF-8) only when nothing is there: True when created, False when a file
    was there already. O_CREAT | O_EXCL makes this atomic, also across processes; the umask's ordinary mode,
    fsynced."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    try:
        descriptor = os.open(path, flags, 0o666)  # less the umask: ordinary_mode()
    except FileExistsError:
        return False
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(content.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return True


#: A claim file is about 150 bytes: one much longer is no claim a run wrote, and is read no further.
_CLAIM_BYTES = 4096
#: A host or start time longer than this, or with characters that are not printable, is no claim's: it is shown
#: in a one-line message.
_FIELD_CHARACTERS = 255


class ClaimFileError(PrecisionError):
    """A claim file (or its takeover file) that is no file a claim makes (a folder, a FIFO, a symbolic link, ...),
    or one that cannot be read: no run's claim can be judged from it, and it is never removed for the user."""


@dataclass(frozen=True)
class Holder:
    """Who holds a claim file: its process id, host and start time (ISO 8601, UTC); None where the file says
    nothing readable (being written, or not a claim)."""

    pid: int | None
    host: str | None
    started: str | None


@dataclass(frozen=True)
class Claim:
    """This process's exclusive hold on the claim file `path`, until release() (also as a context manager)."""

    path: Path
    token: str

    def release(self) -> None:
        """Remove the claim file while it is still this claim's; again, once taken over, or once replaced by
        something that is no claim file, nothing."""
        try:
            seen = _claim_state(self.path)
        except ClaimFileError:
            return  # not this claim's file any more: left as it is
        if seen is not None and _claim_record(seen[0]).get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _file_type(mode: int) -> str | None:
    """What a file of `mode` is, in words, when it is not a regular file (None when it is)."""
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISLNK: "a symbolic link", stat.S_ISFIFO: "a FIFO (named pipe)"}
    kinds |= {stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device"}
    return next((words for test, words in kinds.items() if test(mode)), "not a regular file")


def _not_a_claim(path: Path, kind: str) -> ClaimFileError:
    return ClaimFileError(
        f"{path} is {kind}, not a file a pytest-precision run makes; if no run is writing to {path.parent}, delete it"
    )


def _claim_state(path: Path) -> tuple[bytes, int, float] | None:
    """(content, inode, age in seconds) of a claim file, None when there is none. A path that is not a regular
    file, or cannot be read, is a ClaimFileError: never followed (a symbolic link), never waited on (a FIFO's
    open would block until a writer comes: O_NONBLOCK), never read past _CLAIM_BYTES."""
    try:
        kind = _file_type(os.lstat(path).st_mode)
        if kind is not None:
            raise _not_a_claim(path, kind)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ClaimFileError(
            f"cannot read the claim file {path} ({error.strerror or error}): another user's run may hold "
            f"{path.parent}; if no run is writing there, delete it"
        ) from None
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(handle.fileno())
        kind = _file_type(status.st_mode)  # replaced between lstat and open
        if kind is not None:
            raise _not_a_claim(path, kind)
        content = handle.read(_CLAIM_BYTES + 1)
    return content, status.st_ino, time.time() - status.st_mtime


def _claim_record(content: bytes) -> dict[str, Any]:
    """The JSON object of a claim file; {} for anything else (too long, not UTF-8, not JSON, not an object)."""
    if len(content) > _CLAIM_BYTES:
        return {}
    try:
        record = json.loads(content.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError is one
        return {}
    return record if isinstance(record, dict) else {}


def _text_field(value: object) -> str | None:
    """A host or start time as a claim writes it: short printable text (it is shown in a one-line message)."""
    if isinstance(value, str) and 0 < len(value) <= _FIELD_CHARACTERS and value.isprintable():
        return value
    return None


def _holder(content: bytes) -> Holder:
    """Who the claim `content` names. A pid that is no process id (not an int, a bool, 0 or below, beyond a C int)
    is no pid: such a claim is judged by its age alone, as one that names nobody."""
    record = _claim_record(content)
    pid = record.get("pid")
    valid = isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < _PID_LIMIT
    return Holder(pid if valid else None, _text_field(record.get("host")), _text_field(record.get("started")))


def _holder_gone(holder: Holder, age_s: float) -> bool:
    """Whether a claim's process has ended: on this host, its pid is gone; a claim saying nothing readable is
    gone once older than CLAIM_STARTING_SECONDS. A process on another host sharing the folder cannot be
    checked: it is taken to live."""
    if holder.pid is None or holder.host is None:
        return age_s > CLAIM_STARTING_SECONDS
    return holder.host == socket.gethostname() and not _process_alive(holder.pid)


def _take_over(path: Path, seen: tuple[bytes, int, float]) -> None:
    """Remove the dead claim `seen` at `path`, holding the takeover file meanwhile so that of two processes
    taking over at once only one removes it (the other would remove the claim the first has made since)."""
    guard = path.with_name(path.name + _TAKEOVER_SUFFIX)
    if not create_exclusively(guard, json.dumps({"pid": os.getpid(), "host": socket.gethostname()})):
        try:
            status = os.lstat(guard)  # not followed: a link's target is never judged or removed
            kind = _file_type(status.st_mode)
            if kind is not None:
                raise _not_a_claim(guard, kind)
            if time.time() - status.st_mtime > STALE_TAKEOVER_SECONDS:
                guard.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        time.sleep(0.01)  # another process is taking over: then its claim is met on the next try
        return
    try:
        now = _claim_state(path)
        if now is not None and now[:2] == seen[:2]:  # still the same dead claim (content and inode)
            path.unlink(missing_ok=True)
    finally:
        guard.unlink(missing_ok=True)


def claim_names(path: Path) -> tuple[str, str]:
    """The names of the files claim_exclusively(path) creates in path's folder: the claim, and (for the
    milliseconds of taking over a dead one) its takeover file."""
    return path.name, path.name + _TAKEOVER_SUFFIX


def claim_exclusively(path: Path) -> Claim | Holder:
    """Create the claim file `path` (pid, host, start time), so that of several processes claiming it at once,
    also on other machines sharing the folder, exactly one gets the Claim. A claim left by a process that has
    ended (killed, even by SIGKILL) is taken over; a live one is returned as its Holder. OSError: the folder
    cannot be written; ClaimFileError: `path` (or its takeover file) is no regular file, or cannot be read."""
    token = secrets.token_hex(16)
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "token": token,
    }
    holder = Holder(None, None, None)
    for _ in range(CLAIM_ATTEMPTS):
        if create_exclusively(path, json.dumps(record)):
            return Claim(path, token)
        seen = _claim_state(path)
        if seen is None:
            continue  # released meanwhile: try again
        holder = _holder(seen[0])
        if not _holder_gone(holder, seen[2]):
            return holder
        _take_over(path, seen)
    return holder
