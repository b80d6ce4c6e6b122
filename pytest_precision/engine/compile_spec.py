"""How a compiled variant is compiled (`Variant(compile=...)`): torch.compile's arguments and the scope, as data.

A spec names everything from fixed lists, so that a variants file can hold one under the data-file rules: a
backend among BACKEND_NAMES (or, from Python only, a callable), a mode among MODE_NAMES, and Inductor options
among OPTION_NAMES with values of the listed type. Carried out by engine.compile_build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_precision.base.errors import ConfigurationError

#: torch.compile backends a spec may name: Inductor's code generation, AOTAutograd with Inductor's
#: decompositions but eager kernels ("aot_eager"; "aot_eager_decomp_partition" also partitions as Inductor
#: does), and dynamo's graph capture alone ("eager").
BACKEND_NAMES = ("inductor", "aot_eager", "aot_eager_decomp_partition", "eager")
#: torch.compile modes (Inductor only).
MODE_NAMES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: "regional": each leaf of the module selection compiled on its own, the capture at its boundary, outside the
#: compiled code (fw, bw and grad rows for every selected module); "whole": the model's forward compiled as one
#: graph, as torch.compile(model) runs it (rows for the output, log-probabilities, loss and parameter gradients).
SCOPES = ("regional", "whole")

#: Inductor options (torch._inductor.config names) a spec may set, with the type of their value. Those that
#: change what is computed, not only how fast, are NUMERIC_OPTIONS; the report shows their values for every
#: compiled run, set or not.
OPTION_NAMES: dict[str, type | tuple[type, ...]] = {
    "emulate_precision_casts": bool,
    "fallback_random": bool,
    "split_reductions": bool,
    "online_softmax": bool,
    "epilogue_fusion": bool,
    "aggressive_fusion": bool,
    "permute_fusion": bool,
    "shape_padding": bool,
    "freezing": bool,
    "max_autotune": bool,
    "max_autotune_gemm": bool,
    "coordinate_descent_tuning": bool,
    "cpp.simdlen": (int, type(None)),
    "cpp.enable_floating_point_contract_flag": str,
    "triton.codegen_upcast_to_fp32": bool,
    "triton.cudagraphs": bool,
}
#: Inductor settings that change the numbers (rounding of intermediates, random streams, reduction order,
#: fused softmax, fused multiply-add): reported for every compiled run and part of its gate.
NUMERIC_OPTIONS = (
    "emulate_precision_casts",
    "fallback_random",
    "split_reductions",
    "online_softmax",
    "cpp.enable_floating_point_contract_flag",
    "triton.codegen_upcast_to_fp32",
)
#: The keys a spec given as a dict may hold.
SPEC_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options", "scope")


@dataclass(frozen=True)
class CompileSpec:
    """torch.compile's arguments for one variant, and which part of the model is compiled.

    backend: a name of BACKEND_NAMES, or (from Python) a dynamo backend callable `(graph_module, example_inputs)`.
    mode, options: Inductor's (backend "inductor" only); options by torch._inductor.config name.
    fullgraph: a graph break is an error instead of a split graph.
    dynamic: torch.compile's `dynamic` (None: its default).
    scope: "regional" (default) or "whole" (see SCOPES).
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    scope: str = "regional"

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", dict(self.options))

    def checked(self, where: str) -> CompileSpec:
        """This spec, or a ConfigurationError headed `where` naming the field that is wrong and what it takes."""
        if isinstance(self.backend, str):
            if self.backend not in BACKEND_NAMES:
                raise ConfigurationError(
                    f"{where}: compile backend {self.backend!r} is not one the plugin runs; use one of "
                    f"{', '.join(BACKEND_NAMES)} (or, from Python, a backend callable)"
                )
        elif not callable(self.backend):
            raise ConfigurationError(f"{where}: compile backend must be a name or a callable, got {self.backend!r}")
        if self.mode is not None and self.mode not in MODE_NAMES:
            raise ConfigurationError(f"{where}: compile mode {self.mode!r}; use one of {', '.join(MODE_NAMES)}")
        if (self.mode is not None or self.options) and self.backend != "inductor":
            raise ConfigurationError(
                f"{where}: compile mode and options are Inductor's; with backend {self.backend_name!r} leave them out"
            )
        for flag in ("fullgraph",):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigurationError(f"{where}: compile {flag} must be True or False, got {getattr(self, flag)!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise ConfigurationError(f"{where}: compile dynamic must be True, False or None, got {self.dynamic!r}")
        if self.scope not in SCOPES:
            raise ConfigurationError(f"{where}: compile scope {self.scope!r}; use 'regional' or 'whole'")
        for name, value in self.options.items():
            wanted = OPTION_NAMES.get(name) if isinstance(name, str) else None
            if wanted is None:
                raise ConfigurationError(
                    f"{where}: compile option {name!r} is not one the plugin sets; options it sets: "
                    f"{', '.join(OPTION_NAMES)}"
                )
            kinds = wanted if isinstance(wanted, tuple) else (wanted,)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise ConfigurationError(f"{where}: compile option {name!r} takes {_type_text(wanted)}, got {value!r}")
        return self

    @property
    def backend_name(self) -> str:
        """The backend's name (a callable's qualified name)."""
        if isinstance(self.backend, str):
            return self.backend
        module = getattr(self.backend, "__module__", None) or ""
        name = getattr(self.backend, "__qualname__", None) or type(self.backend).__name__
        return f"{module}.{name}" if module else name

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, the backend by name, options sorted."""
        return {
            "backend": self.backend_name,
            "mode": self.mode,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "options": {name: self.options[name] for name in sorted(self.options)},
            "scope": self.scope,
        }

    def describe(self) -> str:
        """One line: scope, backend, mode and options."""
        parts = [f"{self.scope} torch.compile", f"backend {self.backend_name}"]
        parts += [f"mode {self.mode}"] if self.mode else []
        parts += ["fullgraph"] if self.fullgraph else []
        parts += [f"dynamic={self.dynamic}"] if self.dynamic is not None else []
        parts += [f"{name}={value}" for name, value in sorted(self.options.items())]
        return ", ".join(parts)

    def __hash__(self) -> int:
        return hash(
            (
                self.backend_name,
                self.mode,
                self.fullgraph,
                self.dynamic,
                tuple(sorted(self.options.items())),
                self.scope,
            )
        )


def _type_text(wanted: type | tuple[type, ...]) -> str:
    kinds = wanted if isinstance(wanted, tuple) else (wanted,)
    names = {bool: "True or False", int: "an integer", str: "a string", type(None): "None"}
    return " or ".join(names.get(kind, kind.__name__) for kind in kinds)


def compile_spec(value: object, where: str) -> CompileSpec | None:
    """A Variant's `compile`: None or False (not compiled), True (Inductor, default mode, regional), a backend
    name, a dict of SPEC_KEYS, or a CompileSpec; anything else is a ConfigurationError headed `where`."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileSpec()
    if isinstance(value, str):
        return CompileSpec(backend=value).checked(where)
    if isinstance(value, CompileSpec):
        return value.checked(where)
    if isinstance(value, Mapping):
        unknown = sorted(str(key) for key in value if key not in SPEC_KEYS)
        if unknown:
            raise ConfigurationError(
                f"{where}: compile has unknown key(s) {', '.join(unknown)}; it takes {', '.join(SPEC_KEYS)}"
            )
        options = value.get("options") or {}
        if not isinstance(options, Mapping):
            raise ConfigurationError(f"{where}: compile options must be a dict of option names to values")
        return CompileSpec(**{**value, "options": options}).checked(where)
    raise ConfigurationError(
        f"{where}: compile must be True, a backend name, a dict of torch.compile arguments or a CompileSpec, got "
        f"{type(value).__name__}"
    )
