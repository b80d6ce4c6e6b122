"""Variant resolution: built-in names, dicts, validation and dtype aliases."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from pytest_precision.base.dtypes import dtype_name, torch_dtype
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.variants import (
    BUILTIN_VARIANTS,
    Variant,
    resolve_reference,
    resolve_variant,
    resolve_variants,
)

EXPECTED_BUILTINS = {
    "fp64": ("float64", False),
    "fp32": ("float32", False),
    "tf32": ("float32", False),
    "bf16": ("bfloat16", False),
    "fp16": ("float16", False),
    "bf16_autocast": ("bfloat16", True),
    "fp16_autocast": ("float16", True),
    "bf16_fp32_head": ("bfloat16", False),
    "fp16_fp32_head": ("float16", False),
    "bf16_reduced_reduction": ("bfloat16", False),
    "fp32_eager": ("float32", False),
    "fp32_sdpa": ("float32", False),
    "bf16_eager": ("bfloat16", False),
    "bf16_sdpa": ("bfloat16", False),
    "fsdp_bf16": ("float32", False),
    "fsdp_bf16_reduce_bf16": ("float32", False),
    "fp32_decode": ("float32", False),
    "bf16_decode": ("bfloat16", False),
    "fp16_decode": ("float16", False),
    "bf16_fp32_head_decode": ("bfloat16", False),
    "fp32_batch_alone": ("float32", False),
    "bf16_batch_alone": ("bfloat16", False),
    "fp32_left_padded": ("float32", False),
    "bf16_left_padded": ("bfloat16", False),
    "fp8_tensorwise": ("bfloat16", False),
    "fp8_rowwise": ("bfloat16", False),
    "fp8_rowwise_gw_hp": ("bfloat16", False),
    "int8_weight_only": ("bfloat16", False),
    "int8_dynamic": ("bfloat16", False),
    "fp8_weight_only": ("bfloat16", False),
    "fp8_dynamic": ("bfloat16", False),
    "fp8_e4m3_weights": ("bfloat16", False),
    "fp8_e5m2_weights": ("bfloat16", False),
    "fp32_replay": ("float32", False),
    "bf16_replay": ("bfloat16", False),
    "fp32_compiled": ("float32", False),
    "bf16_compiled": ("bfloat16", False),
    "bf16_compiled_emulated": ("bfloat16", False),
    "bf16_compiled_aot_eager": ("bfloat16", False),
}


def test_builtin_names() -> None:
    assert set(BUILTIN_VARIANTS) == set(EXPECTED_BUILTINS)


@pytest.mark.parametrize("name", sorted(EXPECTED_BUILTINS))
def test_every_builtin_resolves(name: str) -> None:
    variant = resolve_variant(name)
    assert isinstance(variant, Variant)
    assert variant.name == name
    assert (variant.dtype, variant.autocast) == EXPECTED_BUILTINS[name]
    assert variant.weight_dtype == ("float32" if variant.autocast else variant.dtype)
    assert resolve_variants([name]) == [variant]
    assert resolve_variants(name) == [variant]


def test_builtin_specifics() -> None:
    assert BUILTIN_VARIANTS["tf32"].matmul_precision == "high"
    assert BUILTIN_VARIANTS["fp32"].matmul_precision == "highest"
    assert BUILTIN_VARIANTS["bf16_fp32_head"].fp32_modules == ("<output head>",)
    assert BUILTIN_VARIANTS["bf16_reduced_reduction"].backend == {
        "cuda.matmul.allow_bf16_reduced_precision_reduction": True
    }
    assert BUILTIN_VARIANTS["bf16"].backend == {}
    for name, implementation in [
        ("fp32_eager", "eager"),
        ("fp32_sdpa", "sdpa"),
        ("bf16_eager", "eager"),
        ("bf16_sdpa", "sdpa"),
    ]:
        assert BUILTIN_VARIANTS[name].attn_implementation == implementation, name
    assert BUILTIN_VARIANTS["fp32_sdpa"].matmul_precision == "highest"
    assert BUILTIN_VARIANTS["bf16"].attn_implementation is None


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ConfigurationError) as info:
        resolve_variant("bf17")
    message = str(info.value)
    assert "'bf17'" in message
    for name in BUILTIN_VARIANTS:
        assert name in message
    with pytest.raises(ConfigurationError, match="bf17"):
        resolve_variants(["bf16", "bf17"])


def test_dict_spec() -> None:
    variant = resolve_variant({"name": "mine", "dtype": "bf16", "fp32_modules": ["lm_head"]})
    assert variant == Variant("mine", dtype="bfloat16", fp32_modules=("lm_head",))
    assert variant.fp32_modules == ("lm_head",)


def test_dict_with_unknown_field_names_it() -> None:
    with pytest.raises(ConfigurationError) as info:
        resolve_variant({"name": "mine", "dtype": "bf16", "precision": "high"})
    assert "precision" in str(info.value)
    assert "matmul_precision" in str(info.value)  # the valid fields are listed


def test_dict_without_name() -> None:
    with pytest.raises(ConfigurationError, match="name"):
        resolve_variant({"dtype": "bf16"})


def test_bad_spec_type() -> None:
    with pytest.raises(ConfigurationError, match="int"):
        resolve_variant(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("specs", [[], (), None, 3])
def test_empty_or_bad_variant_list(specs: object) -> None:
    with pytest.raises(ConfigurationError):
        resolve_variants(specs)


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ConfigurationError, match="bf16"):
        resolve_variants(["bf16", "fp16", Variant("bf16", dtype="float16")])
    with pytest.raises(ConfigurationError, match="duplicate"):
        resolve_variants(["fp16", "fp16"])


@pytest.mark.parametrize("name", ["fp32", "fp64"])
def test_reference_accepts_fp32_and_fp64(name: str) -> None:
    assert resolve_reference(name) is BUILTIN_VARIANTS[name]


@pytest.mark.parametrize(
    "name", ["bf16", "fp16", "bf16_autocast", "fp16_autocast", "bf16_fp32_head", "bf16_eager", "bf16_sdpa"]
)
def test_reference_rejects_low_precision(name: str) -> None:
    with pytest.raises(ConfigurationError, match="reference"):
        resolve_reference(name)


def test_reference_rejects_unknown() -> None:
    with pytest.raises(ConfigurationError, match="reference"):
        resolve_reference("nope")


def test_reference_rejects_tf32() -> None:
    with pytest.raises(ConfigurationError):
        resolve_reference("tf32")


@pytest.mark.parametrize(
    ("alias", "expected"),
    [
        ("bf16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        (torch.bfloat16, "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        (torch.float16, "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        (torch.float32, "float32"),
        ("fp64", "float64"),
        ("double", "float64"),
        (torch.float64, "float64"),
    ],
)
def test_dtype_aliases(alias: object, expected: str) -> None:
    assert dtype_name(alias) == expected
    assert Variant("v", dtype=alias).dtype == expected  # type: ignore[arg-type]
    assert torch_dtype(expected) == getattr(torch, expected)


@pytest.mark.parametrize("dtype", ["int8", torch.int32, "fp8", "bfloat"])
def test_unsupported_dtype(dtype: object) -> None:
    with pytest.raises(ConfigurationError, match="dtype"):
        Variant("v", dtype=dtype)  # type: ignore[arg-type]


def test_variant_validation() -> None:
    with pytest.raises(ConfigurationError, match="matmul_precision"):
        Variant("v", matmul_precision="low")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="autocast"):
        Variant("v", dtype="float32", autocast=True)


def test_variant_is_frozen() -> None:
    variant = Variant("v", dtype="bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        variant.dtype = "float16"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        variant.name = "w"  # type: ignore[misc]
    assert hash(variant) == hash(Variant("v", dtype="bfloat16"))


def test_variant_copies_its_mutable_arguments() -> None:
    backend = {"cuda.matmul.allow_bf16_reduced_precision_reduction": True}
    modules = ["lm_head"]
    variant = Variant("v", dtype="bf16", backend=backend, fp32_modules=modules)  # type: ignore[arg-type]
    backend["cuda.matmul.allow_bf16_reduced_precision_reduction"] = False
    modules.append("x")
    assert variant.backend == {"cuda.matmul.allow_bf16_reduced_precision_reduction": True}
    assert variant.fp32_modules == ("lm_head",)


def test_to_dict() -> None:
    def my_prepare(model: object) -> object:
        return model

    variant = Variant("v", dtype="bf16", fp32_modules=("a", "b"), backend={"z": 1, "a": 2}, prepare=my_prepare)
    data = variant.to_dict()
    assert data["name"] == "v" and data["dtype"] == "bfloat16"
    assert data["fp32_modules"] == ["a", "b"]
    assert list(data["backend"]) == ["a", "z"]
    assert data["prepare"].endswith("my_prepare")
    assert data["prepare"].startswith(__name__)


def test_the_fsdp_variants_keep_fp32_master_weights_and_name_their_policy() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fsdp = BUILTIN_VARIANTS["fsdp_bf16"]
    assert fsdp.weight_dtype == "float32" and fsdp.fsdp_knobs
    assert fsdp.mp_policy() == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reduce_bf16 = BUILTIN_VARIANTS["fsdp_bf16_reduce_bf16"]
    assert reduce_bf16.mp_policy() == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert BUILTIN_VARIANTS["fp32"].mp_policy() == MixedPrecisionPolicy()
    assert fsdp.to_dict()["param_dtype"] == "bfloat16" and "param_dtype" not in BUILTIN_VARIANTS["bf16"].to_dict()
    assert Variant("mine", param_dtype="fp16", output_dtype="fp32").fsdp_dtypes == ("float16", None, "float32")
    assert hash(fsdp) != hash(reduce_bf16)


def test_an_fsdp_variant_cannot_be_the_reference() -> None:
    with pytest.raises(ConfigurationError, match="reference"):
        resolve_reference("fsdp_bf16")


@pytest.mark.parametrize("name", ["CON", "nul", "Aux.bf16", "COM1", "lpt9.x", "CON ", "con .x", "prn.", "COM²"])
def test_a_windows_device_name_is_refused(name: str) -> None:
    """A variant's name names files (logprobs/<name>.npy): one that Windows opens as a device is refused, in any
    case, with an extension, with trailing spaces or dots."""
    with pytest.raises(ConfigurationError, match=r"is a device name Windows reserves .* choose another name, e\.g\. "):
        Variant(name, dtype="bf16")
    with pytest.raises(ConfigurationError, match=f"^variant {re.escape(repr(name))}: "):
        resolve_variants([{"name": name}])


@pytest.mark.parametrize("name", ["console", "con_", "com10", "x.nul", "bf16 vs fp16"])
def test_names_holding_a_device_name_are_accepted(name: str) -> None:
    assert Variant(name).name == name
