"""Every file the plugin writes goes through `write_atomically`: a temporary file beside the target, fsync,
the umask's ordinary mode, then os.replace. A reader sees the old or the new content, never a part; of two
writers one whole file wins, also across processes; and no writer differs in mode, durability or the name of
its temporary file.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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


def _process_alive(pid: int) -> bool:
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
