"""What a baseline was measured on: versions, device, platform, threads, backend settings."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The environment fields whose change is worth a warning: they pick other kernels or thread splits. A baseline
#: refreshed with unchanged numbers is still rewritten when one of them differs, so that it records where it holds.
DRIFT_FIELDS = ("torch", "device", "threads", "cpu_capability", "world_size", "mesh")
#: What a baseline without the field was measured with (files from before the field was recorded).
DRIFT_DEFAULTS: dict[str, Any] = {"world_size": 1, "mesh": None}


def package_version(name: str) -> str | None:
    """An installed distribution's version, read from its metadata (imports nothing)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: str) -> str:
    """ "cpu: <processor>" or the CUDA device's name."""
    import torch

    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    return f"cpu: {platform.processor() or platform.machine()}"


def cudnn_version() -> int | None:
    """The cuDNN version torch runs with (None without cuDNN)."""
    import torch.backends.cudnn

    available = torch.backends.cudnn.is_available()  # type: ignore[no-untyped-call]
    return int(torch.backends.cudnn.version()) if available else None  # type: ignore[no-untyped-call]


def device_key(device: str) -> str:
    """The baseline file's device key: "cpu", or "cuda-sm<major><minor>" (GPU generations pick other kernels)."""
    if device.startswith("cuda"):
        import torch

        major, minor = torch.cuda.get_device_capability(torch.device(device))
        return f"cuda-sm{major}{minor}"
    return device.split(":", 1)[0]


def environment(device: str, backend: dict[str, Any], distributed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The environment block of a baseline file. `gpu`, `cuda`, `cudnn`: the GPU's name and the CUDA and cuDNN
    versions torch runs with (None on the CPU). `cpu_capability` is the vector ISA ATen dispatches CPU kernels
    to ("AVX2", "AVX512", ...): CPU bf16 matmuls and reductions block and accumulate differently per ISA.
    `world_size` and `mesh` (the device mesh's shape, None unsharded): what a distributed run was split over
    (see PrecisionReport.distributed)."""
    import torch

    cuda = device.startswith("cuda")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": package_version("numpy"),
        "transformers": package_version("transformers"),
        "pytest_precision": package_version("pytest-precision"),
        "device": device_name(device),
        "gpu": device_name(device) if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": cudnn_version() if cuda else None,
        "platform": f"{platform.system()}-{platform.machine()} ({sys.platform})",
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "backend": backend,
        "world_size": (distributed or {}).get("world_size", 1),
        "mesh": (distributed or {}).get("mesh"),
    }


@functools.lru_cache(maxsize=8)
def git_state(directory: str) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout holding `directory`; (None, None) outside one or without git.
    Dirty: tracked files differ from the commit (untracked files do not count). Read once per process."""

    def git(*arguments: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *arguments], cwd=directory, capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def provenance(root: Path | str) -> dict[str, Any]:
    """Where the numbers came from: the git commit of `root` (the rootdir) and whether it was dirty."""
    commit, dirty = git_state(os.fspath(root))
    return {"commit": commit, "dirty": dirty}


def session_environment(root: Path | str, device: str) -> dict[str, Any]:
    """The environment block of the session report: the baseline fields, the commit and the date (UTC)."""
    return {
        **environment(device, {}),
        **provenance(root),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
