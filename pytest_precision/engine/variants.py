"""Variants: how a run's model is built and which numerics it runs with, and the built-ins by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pytest_precision.base.dtypes import DTypeName, dtype_name, torch_dtype
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.file_names import windows_device_name
from pytest_precision.engine.arrangements import Arrangement, resolve_arrangement
from pytest_precision.engine.compile_spec import CompileSpec, compile_spec
from pytest_precision.engine.lowbit_formats import (
    FP8_RECIPES,
    STORAGE_FORMATS,
    QuantizeConfig,
    quantize_description,
    quantize_spec,
    storage_format,
)
from pytest_precision.engine.port_spec import Port

if TYPE_CHECKING:
    pass

MatmulPrecision = Literal["highest", "high", "medium"]
#: Regexes of the output head of common causal LMs (transformers' `lm_head`, GPT-2's `lm_head`, ...);
#: `*_fp32_head` variants also match the module returned by `get_output_embeddings()`.
HEAD_MODULE = "<output head>"
#: The FSDP2 MixedPrecisionPolicy fields a Variant can set.
FSDP_KNOBS = ("param_dtype", "reduce_dtype", "output_dtype")


def checked_file_name(name: str, where: str) -> str:
    """`name`, which names files (logprobs/<name>.npy of `pytest-precision run`), unless Windows reads it as a
    device (file_names.windows_device_name): then a ConfigurationError headed `where`, with a name to use."""
    device = windows_device_name(name)
    if device is not None:
        base, dot, rest = name.partition(".")
        other = f"{base.strip()}_{dot}{rest}"
        raise ConfigurationError(
            f"{where}: {device!r} is a device name Windows reserves (CON, PRN, AUX, NUL, COM1-9, LPT1-9; in any "
            f"case, with any extension), and a variant's name names files (logprobs/<name>.npy of pytest-precision "
            f"run); choose another name, e.g. {other!r}"
        )
    return name


@dataclass(frozen=True)
class Variant:
    """One way of running the model, compared against the reference.

    name: the label used in reports and baselines.
    dtype: the dtype parameters are cast to (floating buffers keep theirs, as transformers does, except the
        running statistics of BatchNorm/InstanceNorm layers, which take their layer's dtype as with
        `model.to(dtype)`: those layers refuse statistics of another dtype).
    autocast: keep fp32 weights and run the forward under `torch.autocast(dtype=dtype)` instead of casting.
    fp32_modules: full-match regexes of module names computed in fp32 at compute time (inputs and weights
        upcast, autocast off inside); "<output head>" names the model's output embeddings, tied or not.
    matmul_precision: fp32 matmul precision, "highest" (IEEE fp32), "high" (TF32) or "medium" (bf16).
    backend: `torch.backends` flag paths to values, set only during this variant's run.
    attn_implementation: "eager", "sdpa", ... for transformers models.
    prepare: a callable `model -> model` applied last, for anything else.
    param_dtype, reduce_dtype, output_dtype: FSDP2 mixed precision (`MixedPrecisionPolicy`) for a model
        given as pytest_precision.sharded(model, shard): parameters stay `dtype` (fp32 master weights) and
        the shard function passes `variant.mp_policy()` to fully_shard; None keeps FSDP2's default.
    isolate: also measure each selected module's isolated error, on the reference's input for that module (see
        pytest_precision.engine.isolated): extra rows of kinds fw_isolated, bw_isolated and grad_isolated.
    arrangement: compute the reference's tokens another way, as a sampler does (forward only; see
        pytest_precision.engine.arrangements): "decode", "batch_alone", "left_padded" or an Arrangement.
    fp8_training: a torchao float8 training recipe, "tensorwise", "rowwise" or "rowwise_with_gw_hp": the
        nn.Linear modules become torchao Float8Linear (emulated off CUDA of compute capability 8.9+).
    quantize: a torchao quantization config applied with torchao.quantization.quantize_ (forward only): the
        config object, its class name, or {"config": name, **kwargs}.
    weight_storage: "float8_e4m3fn" or "float8_e5m2" (or the torch dtype): nn.Linear weights round-tripped
        through that format, scaled per tensor, as an fp8 checkpoint stores them.
    lowbit_filter: `(module, name) -> bool`, the modules the three above apply to; None: every nn.Linear but
        the output head and fp32_modules (see pytest_precision.engine.lowbit_build). Needs torchao for the
        first two: pip install "pytest-precision[lowbit]".
    replay_routing: a mixture-of-experts model's routers choose the experts another run chose (Rollout Routing
        Replay): True, the reference's; a variant's name, that variant's (listed before this one). Only the top-k
        expert set per token is replayed: the routing weights come from this variant's own router logits at
        those experts, and everything else is computed as without replay (see pytest_precision.engine.routers).
    compile: run the variant's model compiled with torch.compile, built last (after every other step): True
        (Inductor, default mode, each selected block compiled on its own), a backend name, a dict of torch.compile's
        arguments (backend, mode, fullgraph, dynamic, options) and "scope" ("regional" or "whole"), or a
        CompileSpec (see pytest_precision.engine.compile_build).
    implementation: run another implementation of the reference model instead of a copy of it: a
        pytest_precision.Port (the other model, and how its modules and parameters map onto the reference's), or
        the name of an installed one (see pytest_precision.engine.port_registry). The reference's weights are loaded
        into it through the map and checked equal before anything runs; its rows are named by the reference's
        modules (see docs/concepts/ports.md). Every other field applies to the other implementation.
    """

    name: str
    dtype: DTypeName = "float32"
    autocast: bool = False
    fp32_modules: tuple[str, ...] = ()
    matmul_precision: MatmulPrecision = "highest"
    backend: Mapping[str, Any] = field(default_factory=dict)
    attn_implementation: str | None = None
    prepare: Callable[[Any], Any] | None = field(default=None, compare=False)
    param_dtype: DTypeName | None = None
    reduce_dtype: DTypeName | None = None
    output_dtype: DTypeName | None = None
    isolate: bool = False
    arrangement: Arrangement | str | None = None
    fp8_training: str | None = None
    quantize: Any = None
    weight_storage: str | None = None
    lowbit_filter: Callable[[Any, str], bool] | None = field(default=None, compare=False)
    replay_routing: bool | str = False
    compile: CompileSpec | bool | str | Mapping[str, Any] | None = None
    implementation: Port | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.name, str):
            checked_file_name(self.name, f"variant {self.name!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "arrangement", resolve_arrangement(self.arrangement, self.name))
        if not isinstance(self.isolate, bool):
            raise ConfigurationError(f"variant {self.name!r}: isolate must be True or False, got {self.isolate!r}")
        if self.arrangement is not None and (self.isolate or self.fsdp_knobs):
            raise ConfigurationError(
                f"variant {self.name!r}: an arrangement ({self.arrangement_name}) runs forward only, in one "
                "process: it cannot be isolated or sharded; use separate variants"
            )
        for knob in FSDP_KNOBS:
            value = getattr(self, knob)
            if value is not None:
                object.__setattr__(self, knob, dtype_name(value))
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))
        object.__setattr__(self, "backend", dict(self.backend))
        if self.matmul_precision not in ("highest", "high", "medium"):
            raise ConfigurationError(
                f"variant {self.name!r}: matmul_precision={self.matmul_precision!r}; use 'highest', 'high' or 'medium'"
            )
        if self.autocast and self.dtype not in ("bfloat16", "float16"):
            raise ConfigurationError(f"variant {self.name!r}: autocast needs dtype bfloat16 or float16")
        self._check_lowbit()
        self._check_replay()
        self._check_compile()
        self._check_implementation()

    def _check_implementation(self) -> None:
        if self.implementation is None:
            return
        where = f"variant {self.name!r}"
        if isinstance(self.implementation, str):
            from pytest_precision.engine.port_registry import resolve_port

            object.__setattr__(self, "implementation", resolve_port(self.implementation, where))
        if not isinstance(self.implementation, Port):
            raise ConfigurationError(
                f"{where}: implementation must be a pytest_precision.Port or the name of an installed one, got "
                f"{type(self.implementation).__name__}"
            )
        refused = [
            what
            for what, chosen in (
                ("an arrangement", self.arrangement is not None),
                ("routing replay", bool(self.replay_routing)),
                ("FSDP2 mixed precision", self.fsdp_knobs),
            )
            if chosen
        ]
        if refused:
            raise ConfigurationError(
                f"{where}: another implementation is measured in one full forward and backward of an unsharded model; "
                f"{refused[0]} is not measured for a port yet: measure it on the reference implementation"
            )

    def _check_compile(self) -> None:
        where = f"variant {self.name!r}"
        spec = compile_spec(self.compile, where)
        object.__setattr__(self, "compile", spec)
        if spec is None:
            return
        if self.arrangement is not None or self.fsdp_knobs or self.replay_routing:
            what = (
                "an arrangement"
                if self.arrangement is not None
                else ("FSDP2 mixed precision" if self.fsdp_knobs else "routing replay")
            )
            raise ConfigurationError(
                f"{where}: a compiled variant runs one full forward of an unsharded model, with no hook inside its "
                f"compiled code; {what} is not measured compiled: use a separate variant"
            )
        if self.isolate and spec.scope == "whole":
            raise ConfigurationError(
                f"{where}: isolate=True measures each compiled block on the reference's input, which needs regional "
                "compilation; use compile={'scope': 'regional', ...} (the default)"
            )

    def _check_replay(self) -> None:
        replay = self.replay_routing
        where = f"variant {self.name!r}"
        if not isinstance(replay, (bool, str)) or replay == "":
            raise ConfigurationError(
                f"{where}: replay_routing must be True (the reference's routing), False or a variant's name, got "
                f"{replay!r}"
            )
        if replay and self.arrangement is not None:
            raise ConfigurationError(
                f"{where}: replay_routing replays routing into one full forward, as a trainer runs it; an arrangement "
                f"({self.arrangement_name}) is the sampler side: record its routing and replay it into a full-forward "
                f"variant, e.g. Variant('bf16_replayed', dtype='bfloat16', replay_routing='{self.name}')"
            )
        if replay == self.name:
            raise ConfigurationError(f"{where}: replay_routing names the variant itself; name another variant")

    def _check_lowbit(self) -> None:
        where = f"variant {self.name!r}"
        object.__setattr__(self, "quantize", quantize_spec(self.quantize, where))
        object.__setattr__(self, "weight_storage", storage_format(self.weight_storage))
        if self.fp8_training is not None and self.fp8_training not in FP8_RECIPES:
            raise ConfigurationError(
                f"{where}: fp8_training={self.fp8_training!r}; torchao's recipes are {', '.join(FP8_RECIPES)}"
            )
        if self.weight_storage is not None and self.weight_storage not in STORAGE_FORMATS:
            raise ConfigurationError(
                f"{where}: weight_storage={self.weight_storage!r}; use {' or '.join(STORAGE_FORMATS)}"
            )
        chosen = [f for f in ("fp8_training", "quantize", "weight_storage") if getattr(self, f) is not None]
        if len(chosen) > 1:
            raise ConfigurationError(f"{where}: {' and '.join(chosen)} are two formats; a variant takes one")
        if self.lowbit_filter is not None and not callable(self.lowbit_filter):
            raise ConfigurationError(f"{where}: lowbit_filter must be a callable (module, name) -> bool")
        if self.lowbit_filter is not None and not chosen:
            raise ConfigurationError(
                f"{where}: lowbit_filter chooses modules for fp8_training, quantize or weight_storage; set one"
            )
        if chosen and (self.autocast or self.fsdp_knobs or self.arrangement is not None):
            raise ConfigurationError(
                f"{where}: {chosen[0]} runs on a model cast to its dtype, in one process, all its tokens at once: "
                "not with autocast, FSDP2 mixed precision or an arrangement"
            )

    @property
    def lowbit(self) -> bool:
        """Whether the variant runs a format below 16 bits (fp8 training, quantize, weight storage)."""
        return self.fp8_training is not None or self.quantize is not None or self.weight_storage is not None

    @property
    def forward_only(self) -> bool:
        """Whether the variant runs no backward, whatever the comparison asks: arrangements, quantize."""
        return self.arrangement is not None or self.quantize is not None

    def __hash__(self) -> int:
        return hash(
            (
                self.name,
                self.dtype,
                self.autocast,
                self.fp32_modules,
                self.matmul_precision,
                *self.fsdp_dtypes,
                self.isolate,
                self.arrangement_name,
                self.fp8_training,
                quantize_description(self.quantize),
                self.weight_storage,
                self.replay_routing,
                self.compile,
                None if self.port is None else self.port.label,
            )
        )

    @property
    def arrangement_name(self) -> str | None:
        """The arrangement's name (None: one full forward, as the reference)."""
        return None if self.arrangement is None else self.arrangement.name  # type: ignore[union-attr]

    @property
    def fsdp_dtypes(self) -> tuple[str | None, ...]:
        """(param_dtype, reduce_dtype, output_dtype)."""
        return tuple(getattr(self, knob) for knob in FSDP_KNOBS)

    @property
    def fsdp_knobs(self) -> bool:
        """Whether the variant sets FSDP2 mixed precision."""
        return any(value is not None for value in self.fsdp_dtypes)

    def fsdp_description(self) -> str:
        return ", ".join(f"{knob}={getattr(self, knob)}" for knob in FSDP_KNOBS if getattr(self, knob) is not None)

    def mp_policy(self) -> Any:
        """The FSDP2 `MixedPrecisionPolicy` of this variant (all None: no casting, as the fp32 reference)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        param, reduce, output = (None if value is None else torch_dtype(value) for value in self.fsdp_dtypes)
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output)

    @property
    def weight_dtype(self) -> DTypeName:
        """The dtype parameters are stored in during the run."""
        return "float32" if self.autocast else self.dtype

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (the `prepare` callable by its qualified name)."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "autocast": self.autocast,
            "fp32_modules": list(self.fp32_modules),
            "matmul_precision": self.matmul_precision,
            "backend": {k: self.backend[k] for k in sorted(self.backend)},
            "attn_implementation": self.attn_implementation,
            "prepare": None if self.prepare is None else _qualified_name(self.prepare),
            # Only when set: the files of unsharded runs keep their keys.
            **{knob: getattr(self, knob) for knob in FSDP_KNOBS if getattr(self, knob) is not None},
            **({"isolate": True} if self.isolate else {}),
            **({"arrangement": self.arrangement_name} if self.arrangement is not None else {}),
            **({"fp8_training": self.fp8_training} if self.fp8_training is not None else {}),
            **({"quantize": quantize_description(self.quantize)} if self.quantize is not None else {}),
            **({"weight_storage": self.weight_storage} if self.weight_storage is not None else {}),
            **({"lowbit_filter": _qualified_name(self.lowbit_filter)} if self.lowbit_filter is not None else {}),
            **({"replay_routing": self.replay_routing} if self.replay_routing else {}),
            **({"compile": self.compile.to_dict()} if isinstance(self.compile, CompileSpec) else {}),
            **({"implementation": self.port.label} if self.port is not None else {}),
        }

    @property
    def port(self) -> Port | None:
        """The other implementation this variant runs (None: the reference implementation)."""
        return self.implementation if isinstance(self.implementation, Port) else None

    @property
    def compiled(self) -> CompileSpec | None:
        """The variant's CompileSpec (None: eager)."""
        return self.compile if isinstance(self.compile, CompileSpec) else None


def _qualified_name(function: Callable[..., Any]) -> str:
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}.{name}" if module else name


_REDUCED_REDUCTION = "cuda.matmul.allow_bf16_reduced_precision_reduction"

BUILTIN_VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("fp64", dtype="float64"),
        Variant("fp32", dtype="float32"),
        Variant("tf32", dtype="float32", matmul_precision="high"),
        Variant("bf16", dtype="bfloat16"),
        Variant("fp16", dtype="float16"),
        Variant("bf16_autocast", dtype="bfloat16", autocast=True),
        Variant("fp16_autocast", dtype="float16", autocast=True),
        Variant("bf16_fp32_head", dtype="bfloat16", fp32_modules=(HEAD_MODULE,)),
        Variant("fp16_fp32_head", dtype="float16", fp32_modules=(HEAD_MODULE,)),
        Variant("bf16_reduced_reduction", dtype="bfloat16", backend={_REDUCED_REDUCTION: True}),
        # Attention implementations of transformers models, each against the reference's own.
        Variant("fp32_eager", dtype="float32", attn_implementation="eager"),
        Variant("fp32_sdpa", dtype="float32", attn_implementation="sdpa"),
        Variant("bf16_eager", dtype="bfloat16", attn_implementation="eager"),
        Variant("bf16_sdpa", dtype="bfloat16", attn_implementation="sdpa"),
        # FSDP2 mixed precision of a sharded model (pytest_precision.sharded): fp32 master weights, bf16
        # compute, gradients reduce-scattered in fp32 or in bf16.
        Variant("fsdp_bf16", param_dtype="bfloat16", reduce_dtype="float32"),
        Variant("fsdp_bf16_reduce_bf16", param_dtype="bfloat16", reduce_dtype="bfloat16"),
        # Arrangements (forward only): the tokens computed as a sampler does, against the full forward.
        Variant("fp32_decode", dtype="float32", arrangement="decode"),
        Variant("bf16_decode", dtype="bfloat16", arrangement="decode"),
        Variant("fp16_decode", dtype="float16", arrangement="decode"),
        Variant("bf16_fp32_head_decode", dtype="bfloat16", fp32_modules=(HEAD_MODULE,), arrangement="decode"),
        Variant("fp32_batch_alone", dtype="float32", arrangement="batch_alone"),
        Variant("bf16_batch_alone", dtype="bfloat16", arrangement="batch_alone"),
        Variant("fp32_left_padded", dtype="float32", arrangement="left_padded"),
        Variant("bf16_left_padded", dtype="bfloat16", arrangement="left_padded"),
        # Below 16 bits (pip install "pytest-precision[lowbit]" for torchao), each on a bf16 model as production
        # runs it. fp8 training (torchao.float8): emulated off CUDA of compute capability 8.9+.
        Variant("fp8_tensorwise", dtype="bfloat16", fp8_training="tensorwise"),
        Variant("fp8_rowwise", dtype="bfloat16", fp8_training="rowwise"),
        Variant("fp8_rowwise_gw_hp", dtype="bfloat16", fp8_training="rowwise_with_gw_hp"),
        # Quantized inference (torchao.quantization.quantize_, forward only).
        Variant("int8_weight_only", dtype="bfloat16", quantize=QuantizeConfig("Int8WeightOnlyConfig")),
        Variant("int8_dynamic", dtype="bfloat16", quantize=QuantizeConfig("Int8DynamicActivationInt8WeightConfig")),
        Variant("fp8_weight_only", dtype="bfloat16", quantize=QuantizeConfig("Float8WeightOnlyConfig")),
        Variant("fp8_dynamic", dtype="bfloat16", quantize=QuantizeConfig("Float8DynamicActivationFloat8WeightConfig")),
        # fp8 weight storage round trips (no torchao): for models no torchao kernel serves.
        Variant("fp8_e4m3_weights", dtype="bfloat16", weight_storage="float8_e4m3fn"),
        Variant("fp8_e5m2_weights", dtype="bfloat16", weight_storage="float8_e5m2"),
        # Mixture-of-experts routing replay (R3): the routers choose the reference's experts, so that against the
        # same variant without replay the error splits into what routing flips cause and what arithmetic causes.
        Variant("fp32_replay", dtype="float32", replay_routing=True),
        Variant("bf16_replay", dtype="bfloat16", replay_routing=True),
        # Compiled (torch.compile, each selected block compiled on its own; see docs/concepts/compiled.md): Inductor's
        # fused kernels; Inductor rounding every intermediate as eager does (emulate_precision_casts), which
        # leaves what fusion changes beyond rounding; and AOTAutograd's decompositions run by eager kernels,
        # without Inductor's code generation, which separates what decomposition changes from what fusion does.
        Variant("fp32_compiled", dtype="float32", compile=True),
        Variant("bf16_compiled", dtype="bfloat16", compile=True),
        Variant("bf16_compiled_emulated", dtype="bfloat16", compile={"options": {"emulate_precision_casts": True}}),
        Variant("bf16_compiled_aot_eager", dtype="bfloat16", compile="aot_eager"),
    )
}

_VARIANT_FIELDS = frozenset(f.name for f in dataclasses.fields(Variant))


#: How to give a variant of one's own, in the unknown-variant message of the Python API.
OWN_VARIANT_ADVICE = "pass pytest_precision.Variant(name=..., dtype=..., ...)"


def resolve_variant(
    spec: str | Variant | Mapping[str, Any], *, argument: str = "variants", own: str = OWN_VARIANT_ADVICE
) -> Variant:
    """A Variant from a built-in name, a Variant, or a dict of Variant fields. An unknown name is refused with
    the built-in names and `own`, how to give one's own variant where `argument` comes from."""
    if isinstance(spec, Variant):
        return spec
    if isinstance(spec, str):
        try:
            return BUILTIN_VARIANTS[spec]
        except KeyError:
            raise ConfigurationError(
                f"{argument}: unknown variant {spec!r}. Built-in variants: {', '.join(BUILTIN_VARIANTS)}; or {own}"
            ) from None
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - _VARIANT_FIELDS)
        if unknown:
            raise ConfigurationError(
                f"{argument}: unknown Variant field(s) {', '.join(unknown)}; "
                f"valid fields: {', '.join(sorted(_VARIANT_FIELDS))}"
            )
        if "name" not in spec:
            raise ConfigurationError(f"{argument}: a variant given as a dict needs a 'name'")
        return Variant(**spec)
    raise ConfigurationError(f"{argument}: expected a variant name, a Variant or a dict, got {type(spec).__name__}")


def resolve_variants(specs: object) -> list[Variant]:
    """Resolve the `variants=` argument: one spec or a sequence of them, names unique."""
    if isinstance(specs, (str, Variant, Mapping)):
        specs = [specs]
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ConfigurationError("variants: give a non-empty list, e.g. variants=['bf16', 'fp16']")
    variants = [resolve_variant(spec) for spec in specs]
    names = [v.name for v in variants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(f"variants: duplicate name(s) {', '.join(duplicates)}")
    return variants


def resolve_reference(spec: str | Variant | Mapping[str, Any]) -> Variant:
    """The reference run: "fp32" (IEEE fp32 matmuls, TF32 off) by default, or "fp64"."""
    reference = resolve_variant(spec, argument="reference")
    if reference.port is not None:
        raise ConfigurationError(
            f"reference: {reference.name!r} runs another implementation; the reference is the reference "
            "implementation ('fp32' or 'fp64'): compare the other implementation as a variant"
        )
    if reference.compile is not None:
        raise ConfigurationError(
            f"reference: {reference.name!r} is compiled; the reference runs eager ('fp32' or 'fp64'): compile the "
            "variants measured against it"
        )
    if (
        reference.dtype not in ("float32", "float64")
        or reference.autocast
        or reference.matmul_precision != "highest"
        or reference.fsdp_knobs
        or reference.arrangement is not None
        or reference.replay_routing
    ):
        raise ConfigurationError(
            f"reference: {reference.name!r} computes in {reference.dtype} with matmul precision "
            f"{reference.matmul_precision!r}; the reference must be 'fp32' (IEEE) or 'fp64'"
        )
    return reference
