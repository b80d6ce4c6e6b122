"""The installed torch's version, for features that need a newer torch than the oldest supported one."""

from __future__ import annotations


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch ("2.10.0+cpu" -> (2, 10))."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def version_text(version: tuple[int, int]) -> str:
    """(2, 9) -> "2.9"."""
    return ".".join(str(part) for part in version)
