"""Ports by name, for variants files and `Variant(implementation="name")`: those installed packages declare under the
entry-point group `pytest_precision.implementations`, this one among them (torchtune_llama, see pyproject.toml).

A name only ever selects from that fixed set: a file naming an implementation never names a module or an attribute
to import, and the entry point, declared by an installed package, decides what is loaded.
"""

from __future__ import annotations

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.port_spec import Port

#: The entry-point group of installed ports: ``name = "package.module:attribute"``, the attribute a Port or a
#: callable returning one.
ENTRY_POINT_GROUP = "pytest_precision.implementations"


def _installed() -> dict[str, object]:
    from importlib.metadata import entry_points

    return {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUP)}


def port_names() -> list[str]:
    """Every name resolve_port knows, sorted."""
    return sorted(_installed())


def resolve_port(name: str, where: str) -> Port:
    """The Port called `name`, or a ConfigurationError headed `where` listing the names there are."""
    entry = _installed().get(name)
    if entry is None:
        raise ConfigurationError(
            f"{where}: implementation {name!r} is not a port this environment knows (known: "
            f"{', '.join(port_names())}); a package declares its own under the entry-point group "
            f"{ENTRY_POINT_GROUP!r}, "
            "or pass a pytest_precision.Port from Python"
        )
    try:
        loaded = entry.load()  # type: ignore[attr-defined]
    except Exception as error:
        raise ConfigurationError(
            f"{where}: implementation {name!r} ({entry.value}) failed to load: "  # type: ignore[attr-defined]
            f"{type(error).__name__}: {error}"
        ) from error
    port = loaded if isinstance(loaded, Port) else loaded() if callable(loaded) else loaded
    return _checked(port, name, where)


def _checked(port: object, name: str, where: str) -> Port:
    if not isinstance(port, Port):
        raise ConfigurationError(f"{where}: implementation {name!r} gave {type(port).__name__}, not a Port")
    return port
