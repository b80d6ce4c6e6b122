"""The last build step of a compiled variant: its model compiled with torch.compile as its CompileSpec says, what
ran compiled watched, and torch's compiler state put back as it was found.

Regional compilation compiles each leaf of the module selection on its own (the way large models are compiled,
block by block): the module's `forward`, not its `__call__`, is compiled, so the capture's hooks run at the
block's boundary outside the compiled code and see exactly what the compiled block computed. Whole-graph
compilation compiles the model's forward as one graph; no hook may sit inside it, so only the output, the
log-probabilities, the loss and the parameters' gradients are measured.

Every compiled graph is handed to the backend through a `CompileWatch`, which counts compilations and their
seconds and, at run time, the compiled graphs each region executed: a region that executed none ran eager (a
graph break at its first line, a backend error suppressed by `torch._dynamo.config.suppress_errors`, a frame
dynamo skipped, the recompile limit) and the run fails instead of measuring eager under a compiled label.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError, ModelRunError, NotSupportedHere
from pytest_precision.engine.compile_spec import NUMERIC_OPTIONS, CompileSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pytest_precision.engine.variants import Variant

#: torch._dynamo.utils.compilation_time_metrics' key of a frame's whole compilation (tracing and backend).
_DYNAMO_TOTAL = "_compile.compile_inner"
#: The logger of torch's structured trace (tlparse), which logs each compilation at DEBUG level.
_TRACE_LOGGER = "torch.__trace"
#: The start of the DeprecationWarning torch.jit.script_method gives (raised by a module Inductor imports).
_SCRIPT_METHOD_DEPRECATION = "`torch.jit.script_method` is deprecated"
#: Graph-break reasons kept per run (the rest counted).
KEPT_REASONS = 5


def _call_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The frame torch.compile compiles for every region: a code object of the plugin's own, so that the cache
    entries dynamo attaches to it are the plugin's to drop after the run, not entries on the user's code."""
    return forward(*args, **kwargs)


def regions_of(module_names: Sequence[str], scope: str) -> list[str]:
    """The modules compiled on their own: the selected modules with no selected module inside them (regional), or
    the whole model, "" (whole)."""
    if scope == "whole":
        return [""]
    selected = list(module_names)
    return [name for name in selected if not any(other.startswith(name + ".") for other in selected)]


@dataclass
class CompileWatch:
    """What one run compiled and executed: filled by the backend it wraps and by each region's forward."""

    spec: CompileSpec
    regions: list[str]
    compilations: int = 0
    compile_seconds: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    executions: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)
    fx_cache: dict[str, int] = field(default_factory=dict)
    numeric_settings: dict[str, Any] = field(default_factory=dict)
    device_type: str = "cpu"
    _running: list[str] = field(default_factory=list)

    def backend(self) -> Callable[..., Any]:
        """The dynamo backend of this run: the spec's, counted and timed, its compiled graphs counted when run."""
        inner = _inner_backend(self.spec)

        def watched(graph: Any, example_inputs: Any) -> Any:
            start = time.perf_counter()
            try:
                compiled = inner(graph, example_inputs)
            except Exception as error:
                self.errors.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
                raise
            finally:
                self.compile_seconds += time.perf_counter() - start
            self.compilations += 1

            def run(*args: Any) -> Any:
                if self._running:
                    region = self._running[-1]
                    self.executions[region] = self.executions.get(region, 0) + 1
                return compiled(*args)

            # Not functools.wraps: torch 2.6's dynamo calls a `__wrapped__` function itself, skipping the count. A
            # boxed compiled function (one list of arguments, freed as used) stays boxed.
            if getattr(compiled, "_boxed_call", False):
                run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return watched

    def region_forward(
        self, name: str, compiled: Callable[..., Any], forward: Callable[..., Any]
    ) -> Callable[..., Any]:
        """The forward that replaces region `name`'s: the compiled frame over its own forward, counted."""

        def forward_compiled(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            self._running.append(name)
            try:
                return compiled(forward, *args, **kwargs)
            finally:
                self._running.pop()

        return forward_compiled

    def graphs_per_call(self) -> int:
        """The most compiled graphs one call of a region ran (1 without graph breaks; 0 when none ran)."""
        return max(
            (-(-self.executions.get(name, 0) // calls) for name, calls in self.calls.items() if calls), default=0
        )

    def eager_regions(self) -> list[str]:
        """The regions called but run without a compiled graph."""
        return [name for name in self.regions if self.calls.get(name) and not self.executions.get(name)]

    def check(self, variant: str) -> None:
        """A ModelRunError when a region ran eager (or none ran): the variant would measure eager numbers."""
        eager = self.eager_regions()
        called = [name for name in self.regions if self.calls.get(name)]
        if not eager and called:
            return
        shown = ", ".join(_label(name) for name in (eager or self.regions)[:6])
        more = f", ... {len(eager) - 6} more" if len(eager) > 6 else ""
        if self.errors:
            reason = f"the backend failed and dynamo ran the code eager (suppress_errors): {self.errors[0]}"
        elif self.break_reasons:
            reason = f"graph break: {self.break_reasons[0]}"
        elif not called:
            reason = "the model's forward never called the compiled regions"
        else:
            reason = (
                "dynamo compiled no graph for them (a frame it skips, a torch._dynamo.disable'd forward, or the "
                "recompile limit)"
            )
        raise ModelRunError(
            f"variant {variant!r} is compiled ({self.spec.describe()}) but {len(eager) or len(self.regions)} of "
            f"{len(self.regions)} compiled region(s) ran eager ({shown}{more}): {reason}. Measuring them would label "
            "eager numbers as compiled; fix the graph break (TORCH_LOGS=graph_breaks shows it) or compile with "
            "fullgraph=True to see the error"
        )

    def facts(self) -> dict[str, Any]:
        """What the run compiled, JSON-ready: part of the variant's gate (the spec, the numeric Inductor settings,
        the regions and the graph breaks)."""
        return {
            **self.spec.to_dict(),
            "numeric_settings": dict(self.numeric_settings),
            "regions": [_label(name) for name in self.regions],
            "graph_breaks": self.graph_breaks,
            "graphs_per_call": self.graphs_per_call(),
            "break_reasons": list(self.break_reasons[:KEPT_REASONS]),
            **(
                {"cpu_isa": isa[0]}
                if self.spec.backend == "inductor" and (isa := cpu_vector_isa(self.device_type))
                else {}
            ),
        }

    def cost(self) -> dict[str, Any]:
        """What compiling cost: seconds inside the backend, compilations, Inductor FX-graph cache hits and misses."""
        return {
            "compile_seconds": round(self.compile_seconds, 3),
            "compilations": self.compilations,
            "graph_executions": sum(self.executions.values()),
            **{f"fx_cache_{key}": value for key, value in sorted(self.fx_cache.items())},
        }


def add_costs(total: dict[str, Any] | None, run: dict[str, Any], run_seconds: float) -> dict[str, Any]:
    """`total` (a variant's costs so far, None at its first run) with one more run's CompileWatch.cost added, and
    that run's wall seconds (build, forward, backward, compiling included) as `run_seconds`."""
    summed = dict(total or {"runs": 0, "run_seconds": 0.0})
    summed["runs"] += 1
    summed["run_seconds"] = round(summed["run_seconds"] + run_seconds, 3)
    for key, value in run.items():
        summed[key] = round(summed.get(key, 0) + value, 3)
    return summed


def _label(region: str) -> str:
    return region or "<whole model>"


def _inner_backend(spec: CompileSpec) -> Callable[..., Any]:
    """The dynamo backend `spec` names, built as torch.compile builds it (Inductor with its mode; its options are set
    in Inductor's configuration for the run, see inductor_settings)."""
    import torch

    if callable(spec.backend):
        return spec.backend
    if spec.backend == "inductor":
        return torch._TorchCompileInductorWrapper(spec.mode, None, spec.dynamic)  # type: ignore[attr-defined,no-untyped-call]
    return torch._dynamo.lookup_backend(spec.backend)  # type: ignore[no-any-return]


def inductor_settings(spec: CompileSpec, device_type: str) -> dict[str, Any]:
    """The Inductor configuration a run of `spec` compiles under: its options, and on a CPU the vector ISA's width.

    Set in torch._inductor.config for the run (and put back after it) rather than passed as torch.compile's
    `options`, which torch 2.6 drops for settings of an Optional type (`cpp.simdlen`). The width: Inductor picks its
    CPU vector ISA from ATEN_CPU_CAPABILITY, but its FX-graph cache key leaves that out (torch 2.6 to 2.15), so a
    kernel cached under AVX-512 was served to an AVX2-pinned process and computed garbage (1e38 where 1 was due);
    an explicit `cpp.simdlen` enters the key.
    """
    if spec.backend != "inductor":
        return {}
    settings = dict(spec.options)
    isa = cpu_vector_isa(device_type)
    if isa is not None and "cpp.simdlen" not in settings:
        settings["cpp.simdlen"] = isa[1]
    return settings


def _set_inductor(settings: dict[str, Any]) -> None:
    import torch._inductor.config as inductor_config

    for name, value in settings.items():
        owner: Any = inductor_config
        *path, last = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, last, value)


def missing_options(spec: CompileSpec) -> list[str]:
    """The options of `spec` this torch's Inductor does not have."""
    import torch._inductor.config as inductor_config

    missing = []
    for name in spec.options:
        owner: Any = inductor_config
        for part in name.split("."):
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                missing.append(name)
                break
    return missing


def cpu_vector_isa(device_type: str) -> tuple[str, int] | None:
    """(name, bit width) of the vector ISA Inductor generates CPU code for here; None off the CPU or without one."""
    if device_type != "cpu":
        return None
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return (str(isa), isa.bit_width()) if isa else None


def numeric_settings(spec: CompileSpec) -> dict[str, Any]:
    """The Inductor settings that change numbers, as this spec compiles with them (its options over the global
    configuration); empty for other backends."""
    if spec.backend != "inductor":
        return {}
    import torch._inductor.config as inductor_config

    settings: dict[str, Any] = {}
    for name in NUMERIC_OPTIONS:
        value: Any = inductor_config
        for part in name.split("."):
            value = getattr(value, part, _MISSING)
        if value is not _MISSING:  # a setting this torch does not have is not reported
            settings[name] = spec.options.get(name, value)
    contract = settings.get(_CONTRACT)
    if isinstance(contract, bool):
        # torch 2.6's flag was a bool: off, or -ffp-contract=fast; later torch names the mode ("off", "on", "fast").
        settings[_CONTRACT] = "fast" if contract else "off"
    return settings


#: Whether the C++ compiler may fuse a multiply and an add into one rounding (an FMA).
_CONTRACT = "cpp.enable_floating_point_contract_flag"


_MISSING = object()


def compile_regions(model: nn.Module, spec: CompileSpec, module_names: Sequence[str], device_type: str) -> CompileWatch:
    """Compile `model`'s regions (see regions_of) in place: `model` is the run's own copy, never the user's."""
    import torch

    watch = CompileWatch(
        spec, regions_of(module_names, spec.scope), numeric_settings=numeric_settings(spec), device_type=device_type
    )
    _set_inductor(inductor_settings(spec, device_type))  # put back by compiler_state_kept
    compiled = torch.compile(_call_forward, backend=watch.backend(), fullgraph=spec.fullgraph, dynamic=spec.dynamic)
    for name in watch.regions:
        module = model.get_submodule(name) if name else model
        module.forward = watch.region_forward(name, compiled, module.forward)  # type: ignore[method-assign]
    return watch


def _recompile_limit_name() -> str:
    import torch._dynamo.config as dynamo_config

    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


@contextlib.contextmanager
def compiler_quiet() -> Iterator[None]:
    """What torch says to itself while compiling, kept out of the user's output: its structured-trace logger's DEBUG
    records (pytest's captured log would show them under every failing test), and the deprecation of
    `torch.jit.script_method` that a module Inductor imports triggers (torch's own use, not the user's code)."""
    trace_logger = logging.getLogger(_TRACE_LOGGER)
    propagates = trace_logger.propagate
    trace_logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SCRIPT_METHOD_DEPRECATION, category=DeprecationWarning)
            yield
    finally:
        trace_logger.propagate = propagates


@contextlib.contextmanager
def compiler_state_kept(regions: int, watch: Callable[[], CompileWatch | None] | None = None) -> Iterator[None]:
    """Run a compiled variant, then put torch's compiler state back as found, on error too: dynamo's and Inductor's
    configuration, dynamo's counters and compile-time metrics, and the cache entries this run added (those on code
    dynamo had not compiled before, and on the plugin's own frame); the recompile limit is raised to fit `regions`
    while inside. `watch()`, when given, gets the run's graph breaks and Inductor cache counts before they go."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    from torch._dynamo import convert_frame, eval_frame, utils

    configs = [(dynamo_config, dynamo_config.get_config_copy()), (inductor_config, inductor_config.get_config_copy())]
    counters = {key: collections.Counter(value) for key, value in utils.counters.items()}
    metrics = {key: list(value) for key, value in utils.compilation_time_metrics.items()}
    codes_before = set(convert_frame.input_codes.seen_ids)
    backends_before = set(eval_frame.cached_backends)
    limit = _recompile_limit_name()
    utils.counters.clear()
    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), regions + 8))
    own_globals = _call_forward.__globals__
    globals_before = set(own_globals)
    try:
        with compiler_quiet():
            yield
    finally:
        # Dynamo aliases each module whose code it inlines into the compiled frame's globals (`__import_...`):
        # dropped, or a module imported again under the same name (pytester, autoreload) trips dynamo's check that
        # an alias still names the module (torch 2.6).
        for name in set(own_globals) - globals_before:
            if name.startswith("__import_"):
                del own_globals[name]
        current = watch() if watch is not None else None
        if current is not None:
            breaks = utils.counters.get("graph_break", collections.Counter())
            current.graph_breaks = sum(breaks.values())
            current.break_reasons = [str(reason).splitlines()[0] for reason in breaks]
            inductor = utils.counters.get("inductor", collections.Counter())
            current.fx_cache = {
                "hits": inductor.get("fxgraph_cache_hit", 0),
                "misses": inductor.get("fxgraph_cache_miss", 0),
            }
            # Dynamo's own total (tracing, guards and the backend), where this torch records it.
            traced = sum(utils.compilation_time_metrics.get(_DYNAMO_TOTAL, [])) - sum(metrics.get(_DYNAMO_TOTAL, []))
            current.compile_seconds = max(current.compile_seconds, traced)
        own = _call_forward.__code__
        kept = []
        for reference in list(convert_frame.input_codes.seen):
            code = reference()
            if code is not None and (code is own or id(code) not in codes_before):
                torch._dynamo.reset_code(code)  # type: ignore[attr-defined]
                convert_frame.input_codes.seen_ids.discard(id(code))
            else:
                kept.append(reference)
        convert_frame.input_codes.seen[:] = kept
        for key in set(eval_frame.cached_backends) - backends_before:
            del eval_frame.cached_backends[key]
        with warnings.catch_warnings():  # reading a deprecated setting warns
            warnings.simplefilter("ignore")
            for module, saved in configs:
                for name, value in saved.items():
                    if getattr(module, name) != value:
                        setattr(module, name, value)
        utils.counters.clear()
        utils.counters.update(counters)
        utils.compilation_time_metrics.clear()
        utils.compilation_time_metrics.update(metrics)


def check_compilable(variants: Sequence[Variant], device: torch.device) -> None:
    """Before any run: every compiled variant's Inductor options exist in this torch (a ConfigurationError naming
    them), and Inductor on a CPU has a C++ compiler (else NotSupportedHere, a skip under pytest)."""
    import torch

    for variant in variants:
        spec = variant.compiled
        if spec is not None and (missing := missing_options(spec)):
            raise ConfigurationError(
                f"variant {variant.name!r}: compile option(s) {', '.join(missing)} are not settings of torch "
                f"{torch.__version__}'s Inductor; leave them out on this torch"
            )
    if device.type != "cpu":
        return
    inductor = [v.name for v in variants if v.compiled is not None and v.compiled.backend == "inductor"]
    if not inductor:
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        with compiler_quiet():
            get_cpp_compiler()
            cpu_vector_isa(device.type)  # Inductor's ISA check builds a test program: done here, before any run
    except Exception as error:
        raise NotSupportedHere(
            f"variant(s) {', '.join(map(repr, inductor))}: Inductor compiles C++ on a CPU and found no C++ compiler "
            f"({type(error).__name__}: {error}); install one (apt install g++, or set CXX), or compile with "
            "backend='aot_eager', which generates no code"
        ) from None


__all__ = [
    "CompileWatch",
    "add_costs",
    "check_compilable",
    "compile_regions",
    "compiler_state_kept",
    "numeric_settings",
    "regions_of",
]
