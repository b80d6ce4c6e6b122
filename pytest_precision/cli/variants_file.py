"""Variants given by their fields in a JSON or TOML file (`pytest-precision run --variants-file FILE`).

JSON: a list of objects, or an object {"variants": [...]}. TOML (Python 3.11+, or with tomli installed):
an array of tables `[[variants]]`. Each entry takes the fields of Variant that need no Python:

    name                 required; letters, digits and _ . + - (it names files: logprobs/<name>.npy), not a
                         device name Windows reserves (CON, NUL, COM1, ..., also as "con.x")
    dtype                "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", "float64"/"fp64"
    autocast             true: fp32 weights, the forward under torch.autocast(dtype)
    fp32_modules         list of full-match regexes of modules computed in fp32 ("<output head>": the LM head)
    matmul_precision     "highest", "high" (TF32) or "medium"
    backend              {"cuda.matmul.allow_tf32": true, ...}: torch.backends flag paths and values
    attn_implementation  "eager", "sdpa", ... (transformers models)
    arrangement          "decode", "batch_alone" or "left_padded" (forward only)
    fp8_training         "tensorwise", "rowwise" or "rowwise_with_gw_hp" (torchao float8 training)
    quantize             a torchao config: its class name, or {"config": "Int4WeightOnlyConfig", "group_size": 32}
                         (an argument may be {"config": "PerRow"}, another torchao object, or "torch.float8_e4m3fn")
    weight_storage       "float8_e4m3fn" or "float8_e5m2" (weights round-tripped, scaled per tensor)
    replay_routing       true (the reference's MoE routing) or the name of a variant listed before it
    compile              true (Inductor, each selected block compiled), a backend name ("inductor", "aot_eager",
                         "aot_eager_decomp_partition", "eager") or {"backend": ..., "mode": ..., "fullgraph": ...,
                         "dynamic": ..., "scope": "regional" or "whole", "options": {"emulate_precision_casts": true}}
    implementation       the name of a port (another implementation of the model: "torchtune_llama", or one an installed
                         package declares under the entry-point group pytest_precision.implementations)

Names are data, never paths to code: backend paths are the torch.backends settings of
engine/backend_flag_names.py, quantize configs, argument objects and "torch.<dtype>" names those of
engine/lowbit_formats.py (CONFIG_NAMES, ARGUMENT_NAMES, TORCH_DTYPE_NAMES), compile backends, modes and Inductor
options those of engine/compile_spec.py (BACKEND_NAMES, MODE_NAMES, OPTION_NAMES), implementations those of
engine/port_registry.py (the ports this package ships and the installed packages' entry points: a name selects one,
it never names a module to import).

Anything else, or a value of the wrong type, is a ConfigurationError naming the file and the entry, raised
when the file is read, before anything runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from pytest_precision.base import strict_json
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.lowbit_formats import FP8_RECIPES, STORAGE_FORMATS, QuantizeConfig
from pytest_precision.engine.variants import Variant, checked_file_name

#: The fields a variants file may give, with what each must be (for the error messages).
FILE_FIELDS: dict[str, str] = {
    "name": "a name of letters, digits and _ . + -",
    "dtype": "one of float32, bfloat16, float16, float64 (or fp32, bf16, fp16, fp64)",
    "autocast": "true or false",
    "fp32_modules": "a list of regexes of module names",
    "matmul_precision": "one of highest, high, medium",
    "backend": "an object of torch.backends flag paths to values",
    "attn_implementation": "an attention implementation name such as eager or sdpa, or null",
    "arrangement": "one of decode, batch_alone, left_padded",
    "fp8_training": "one of tensorwise, rowwise, rowwise_with_gw_hp",
    "quantize": 'a torchao config class name, or an object {"config": name, ...its keyword arguments}',
    "weight_storage": "one of float8_e4m3fn, float8_e5m2",
    "replay_routing": "true, false or the name of an earlier variant",
    "compile": 'true, false, a backend name or an object {"backend": name, "mode": ..., "options": {...}, ...}',
    "implementation": "the name of a port: torchtune_llama or one an installed package declares",
}
#: A run's name becomes a file name (logprobs/<name>.npy): no separators, no leading dot.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+\-]*")
#: Names the command uses for files of its own.
TAKEN_NAMES = frozenset({"reference"})


def _toml_module() -> Any:
    """tomllib (Python 3.11+), else tomli when installed, else None."""
    import importlib

    for name in ("tomllib", "tomli"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _read(path: Path) -> Any:
    """The file's parsed content: JSON, or TOML for a .toml file."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigurationError(f"--variants-file {path}: cannot read it: {error.strerror or error}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigurationError(f"--variants-file {path}: not UTF-8 text; write it as UTF-8 JSON or TOML") from None
    if path.suffix.lower() == ".toml":
        toml = _toml_module()
        if toml is None:
            raise ConfigurationError(
                f"--variants-file {path}: reading TOML needs Python 3.11 or the tomli package "
                "(pip install tomli); or write the file as JSON"
            )
        try:
            return toml.loads(text)
        except toml.TOMLDecodeError as error:
            raise ConfigurationError(f"--variants-file {path}: not valid TOML ({error})") from None
    try:
        return strict_json.loads(text)
    except strict_json.StrictJsonError as error:  # a key twice (a merge conflict) or 1e400: refused, not guessed
        raise ConfigurationError(f"--variants-file {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise ConfigurationError(
            f"--variants-file {path}: not valid JSON (line {error.lineno} column {error.colno}: {error.msg})"
        ) from None
    except RecursionError:
        raise ConfigurationError(f"--variants-file {path}: not valid JSON (nested too deeply)") from None


def _entries(path: Path, data: Any) -> list[Any]:
    if isinstance(data, Mapping):
        unknown = sorted(set(data) - {"variants"})
        if unknown or "variants" not in data:
            raise ConfigurationError(
                f"--variants-file {path}: expected a list of variants or an object with only 'variants' "
                f"(TOML: [[variants]] tables), found key(s) {', '.join(map(repr, sorted(data))) or 'none'}"
            )
        data = data["variants"]
    if not isinstance(data, list) or not data:
        raise ConfigurationError(
            f"--variants-file {path}: 'variants' must be a non-empty list of variants, got "
            f"{'an empty list' if isinstance(data, list) else type(data).__name__}"
        )
    return data


def _checked_backend(value: Any, where: str) -> dict[str, Any]:
    """The backend flags, each one of the listed torch.backends settings (backend_flag_names) given a value it
    takes, and present in this torch."""
    from pytest_precision.engine.backend_flag_names import checked_flag_name, checked_flag_value
    from pytest_precision.engine.backend_flags import resolve_flag

    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{where}: backend must be {FILE_FIELDS['backend']}, got {value!r}")
    flags: dict[str, Any] = {}
    for flag, setting in value.items():
        try:
            flags[flag] = checked_flag_value(checked_flag_name(flag), setting)
            resolve_flag(flag)  # only a listed path is walked
        except ConfigurationError as error:
            raise ConfigurationError(f"{where}: {error}") from None
    return flags


def _checked_compile(value: Any, where: str) -> Any:
    """A compile spec given by names only (a backend callable cannot come from a file), checked as Variant checks it."""
    from pytest_precision.engine.compile_spec import compile_spec

    if isinstance(value, Mapping) and "backend" in value and not isinstance(value["backend"], str):
        raise ConfigurationError(f"{where}: compile backend must be a backend name, got {value['backend']!r}")
    if not isinstance(value, (bool, str, Mapping)):
        raise ConfigurationError(f"{where}: compile must be {FILE_FIELDS['compile']}, got {value!r}")
    return compile_spec(value, where)


def _checked_entry(entry: Any, where: str) -> dict[str, Any]:
    """The Variant fields of one entry, each checked for its type and value."""
    from pytest_precision.base.dtypes import dtype_name
    from pytest_precision.engine.arrangements import BUILTIN_ARRANGEMENTS

    if not isinstance(entry, Mapping):
        raise ConfigurationError(f"{where}: a variant is an object of fields, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(FILE_FIELDS))
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; a variant takes {', '.join(FILE_FIELDS)}"
        )
    name = entry.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ConfigurationError(f"{where}: 'name' must be {FILE_FIELDS['name']}, got {name!r}")
    if name.lower() in TAKEN_NAMES:
        raise ConfigurationError(f"{where}: the name {name!r} is taken by the reference run's files; choose another")
    checked_file_name(name, where)
    fields: dict[str, Any] = {"name": name}

    def wrong(field: str) -> ConfigurationError:
        return ConfigurationError(f"{where}: {field} must be {FILE_FIELDS[field]}, got {entry[field]!r}")

    if "dtype" in entry:
        if not isinstance(entry["dtype"], str):
            raise wrong("dtype")
        try:
            fields["dtype"] = dtype_name(entry["dtype"])
        except ConfigurationError:
            raise wrong("dtype") from None
    if "autocast" in entry:
        if not isinstance(entry["autocast"], bool):
            raise wrong("autocast")
        fields["autocast"] = entry["autocast"]
    if "fp32_modules" in entry:
        modules = entry["fp32_modules"]
        if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
            raise wrong("fp32_modules")
        for pattern in modules:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ConfigurationError(f"{where}: fp32_modules: {pattern!r} is not a regex ({error})") from None
        fields["fp32_modules"] = tuple(modules)
    if "matmul_precision" in entry:
        if entry["matmul_precision"] not in ("highest", "high", "medium"):
            raise wrong("matmul_precision")
        fields["matmul_precision"] = entry["matmul_precision"]
    if "backend" in entry:
        fields["backend"] = _checked_backend(entry["backend"], where)
    if "attn_implementation" in entry:
        value = entry["attn_implementation"]
        if value is not None and (not isinstance(value, str) or not value):
            raise wrong("attn_implementation")
        fields["attn_implementation"] = value
    if "arrangement" in entry:
        if not isinstance(entry["arrangement"], str) or entry["arrangement"] not in BUILTIN_ARRANGEMENTS:
            raise wrong("arrangement")
        fields["arrangement"] = entry["arrangement"]
    for field, choices in (("fp8_training", FP8_RECIPES), ("weight_storage", STORAGE_FORMATS)):
        if field in entry:
            if entry[field] not in choices or not isinstance(entry[field], str):
                raise wrong(field)
            fields[field] = entry[field]
    if "replay_routing" in entry:
        if not isinstance(entry["replay_routing"], (bool, str)) or entry["replay_routing"] == "":
            raise wrong("replay_routing")
        fields["replay_routing"] = entry["replay_routing"]
    if "compile" in entry:
        fields["compile"] = _checked_compile(entry["compile"], where)
    if "implementation" in entry:
        from pytest_precision.engine.port_registry import port_names, resolve_port

        value = entry["implementation"]
        if not isinstance(value, str) or value not in port_names():
            raise ConfigurationError(
                f"{where}: implementation must be {FILE_FIELDS['implementation']} (known here: "
                f"{', '.join(port_names())}), got {value!r}"
            )
        fields["implementation"] = resolve_port(value, where)
    if "quantize" in entry:
        value = entry["quantize"]
        if isinstance(value, str) and value:
            fields["quantize"] = QuantizeConfig(value)
        elif isinstance(value, Mapping):
            fields["quantize"] = QuantizeConfig.from_mapping(value, where)
        else:
            raise wrong("quantize")
        # Every name checked against its list, then built: a wrong name, a class that is not a quantization
        # config, or an argument torchao refuses fails here, naming the file and entry.
        fields["quantize"].build(where)
    return fields


def load_variants_file(path: str | Path, earlier: Collection[str] = ()) -> list[Variant]:
    """The variants a JSON or TOML file describes (see the module docstring); names unique in the file.

    The whole file is checked before anything runs: every name it resolves, and every replay_routing name
    against the variants listed before its entry (`earlier`: those the command runs before the file's).
    """
    path = Path(path)
    variants: list[Variant] = []
    for number, entry in enumerate(_entries(path, _read(path)), start=1):
        shown_name = entry.get("name") if isinstance(entry, Mapping) else None
        where = f"--variants-file {path}, variant {number}" + (
            f" ({shown_name!r})" if isinstance(shown_name, str) else ""
        )
        fields = _checked_entry(entry, where)
        try:
            variant = Variant(**fields)
        except ConfigurationError as error:  # a combination Variant refuses (autocast with float32, ...)
            raise ConfigurationError(f"{where}: {error}") from None
        if any(v.name.lower() == variant.name.lower() for v in variants):
            # Case apart: logprobs/<name>.npy of two names differing in case is one file on macOS and Windows.
            raise ConfigurationError(f"{where}: the name {variant.name!r} is given twice in the file (case apart)")
        replayed = variant.replay_routing
        before = [*earlier, *(v.name for v in variants)]
        if isinstance(replayed, str) and replayed not in before:
            # The run records a variant's routing only when it runs before the one that replays it.
            raise ConfigurationError(
                f"{where}: replay_routing {replayed!r} names no variant listed before this one "
                f"({', '.join(map(repr, before)) or 'none'}); list {replayed!r} first, or give true for the "
                "reference's routing"
            )
        variants.append(variant)
    return variants


__all__ = ["FILE_FIELDS", "load_variants_file"]
