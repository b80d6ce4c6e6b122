"""What a baseline was measured on: versions, device, platform, threads, backend settings."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any


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


def device_key(device: str) -> str:
    """The baseline file's device key: "cpu", or "cuda-sm<major><minor>" (GPU generations pick other kernels)."""
    if device.startswith("cuda"):
        import torch

        major, minor = torch.cuda.get_device_capability(torch.device(device))
        return f"cuda-sm{major}{minor}"
    return device.split(":", 1)[0]


def environment(device: str, backend: dict[str, Any], distributed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The environment block of a baseline file. `cpu_capability` is the vector ISA ATen dispatches CPU kernels
    to ("AVX2", "AVX512", ...): CPU bf16 matmuls and reductions block and accumulate differently per ISA.
    `world_size` and `mesh` (the device mesh's shape, None unsharded): what a distributed run was split over
    (see PrecisionReport.distributed)."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": package_version("numpy"),
        "transformers": package_version("transformers"),
        "device": device_name(device),
        "platform": f"{platform.system()}-{platform.machine()} ({sys.platform})",
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "backend": backend,
        "world_size": (distributed or {}).get("world_size", 1),
        "mesh": (distributed or {}).get("mesh"),
    }
