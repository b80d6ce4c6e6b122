"""The one check of a name that becomes a file name: not a device name Windows reserves (CON, NUL, COM1, ...).

Variant names (logprobs/<name>.npy of `pytest-precision run`), `baseline=` stems and the stems made from test
ids all go through `windows_device_name`, so that a name accepted in one place is accepted in every other.
"""

from __future__ import annotations

#: Names Windows reserves for devices, in any case, also with any extension ("nul.txt", "Com1.cpu.json") and
#: with spaces after it ("CON .txt"): opening such a file opens the device. The superscript digits are in
#: Microsoft's list too ("Naming Files, Paths, and Namespaces").
WINDOWS_DEVICE_NAMES = frozenset(
    [
        "CON",
        "PRN",
        "AUX",
        "NUL",
        *(f"COM{i}" for i in [*range(1, 10), "¹", "²", "³"]),
        *(f"LPT{i}" for i in [*range(1, 10), "¹", "²", "³"]),
    ]
)


def windows_device_name(name: str) -> str | None:
    """The part of `name` that Windows reads as a device ("con" of "con.txt", "NUL " of "NUL .x", "aux" of
    "aux."), or None when `name` can name a file there. Case-insensitive; only the part before the first dot
    counts, spaces around it apart ("console", "con_", "com10" and "x.con" are ordinary names)."""
    base = name.split(".", 1)[0]
    return base if base.strip().upper() in WINDOWS_DEVICE_NAMES else None


__all__ = ["WINDOWS_DEVICE_NAMES", "windows_device_name"]
