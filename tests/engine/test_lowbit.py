"""Formats below 16 bits: torchao fp8 training (emulated here), torchao quantize_ (forward only) and fp8 weight
storage round trips, built as production builds them and measured like any variant."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import platform
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import random_tokens, tiny_llama
from pytest_precision.base.errors import ConfigurationError, ModelRunError, NotSupportedHere
from pytest_precision.base.torchao_notices import TorchaoNotices
from pytest_precision.engine.backend_flags import snapshot_backend_state
from pytest_precision.engine.compare import compare
from pytest_precision.engine.lowbit_build import (
    int8_matmul_exact,
    lowbit_modules,
    storage_round_trip,
    torchao_settings_kept,
)
from pytest_precision.engine.lowbit_formats import QuantizeConfig
from pytest_precision.engine.model_build import build_run_model
from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant

torchao = pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")

FP8_TRAINING = ["fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp"]
QUANTIZED = ["int8_weight_only", "int8_dynamic", "fp8_weight_only"]
STORED = ["fp8_e4m3_weights", "fp8_e5m2_weights"]
#: The tiny Llama's nn.Linear modules but the head: 7 per block (q, k, v, o, gate, up, down), 4 blocks.
CONVERTED = 28
CPU = torch.device("cpu")


def batch() -> dict[str, torch.Tensor]:
    ids = random_tokens()
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def report(llama: nn.Module) -> Any:
    return compare(llama, batch(), ["bf16", *FP8_TRAINING, *QUANTIZED, *STORED], weight_cast=True)


# --- the built-ins run here, as production builds them ----------------------------------------------------------


@pytest.mark.parametrize("name", FP8_TRAINING + QUANTIZED + STORED)
def test_every_cpu_lowbit_builtin_gives_finite_rows(report: Any, llama: nn.Module, name: str) -> None:
    assert [r.name for r in report.records(name, "fw")][-1] == "lm_head"
    for record in report.records(name):
        assert record.count > 0 and record.nonfinite == 0, (record.name, record.kind)
        assert record.rms_rel is not None and math.isfinite(record.rms_rel), (record.name, record.kind)
    forward_only = name in QUANTIZED
    assert bool(report.records(name, "bw")) == (not forward_only)
    assert len(report.records(name, "grad")) == (0 if forward_only else len(list(llama.parameters())))
    assert len(report.records(name, "loss")) == 1  # quantized inference still has its loss
    assert report.missing[name] == []
    lowbit = report.runs[name].lowbit
    assert lowbit["modules"] == CONVERTED
    expected = "emulated" if name in FP8_TRAINING else "native" if forward_only else "plain casts"
    if name == "int8_dynamic" and not int8_matmul_exact():
        expected = "native, inexact int8 matmuls (oneDNN without VNNI: torch._int_mm saturates)"
    assert lowbit["kernels"] == expected  # no fp8 matmuls on a CPU: torchao's emulation
    assert lowbit["torchao"] == (None if name in STORED else torchao.__version__)


def test_the_formats_order_as_their_bits_say(report: Any) -> None:
    """At the output: bf16 (8 bits of mantissa) < int8 weights (per row) < fp8 e4m3 (3 bits) < fp8 e5m2 (2 bits);
    fp8 training casts activations too, so it is further than fp8 weights alone."""
    head = {name: report.get(name, "lm_head").rms_rel for name in report.variants}
    assert head["bf16"] < head["int8_weight_only"] < head["fp8_weight_only"] < head["fp8_rowwise"]
    assert head["fp8_e4m3_weights"] < head["fp8_e5m2_weights"]
    assert head["int8_weight_only"] <= head["int8_dynamic"]  # dynamic adds the activations' rounding
    assert 0.01 < head["fp8_rowwise"] < 0.2  # the scale torchao's emulation gives (~5% on a 256-wide MLP)


def test_fp8_training_recipes_differ_where_their_design_says(report: Any) -> None:
    """rowwise and rowwise_with_gw_hp cast the forward alike (rowwise scales of the input and weight; torchao <
    0.10 rounds only rowwise's scales to powers of two, which moves the forward by a little); gw_hp keeps the
    weight gradient's gemm in high precision, so its parameter gradients are closer to the reference."""
    from torchao.float8 import Float8LinearConfig

    same_scales = (
        Float8LinearConfig.from_recipe_name("rowwise").round_scales_to_power_of_2
        == Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp").round_scales_to_power_of_2
    )
    for kind in ("fw", "logprob"):
        for a, b in zip(report.records("fp8_rowwise", kind), report.records("fp8_rowwise_gw_hp", kind), strict=True):
            if same_scales:
                assert a.rms_rel == b.rms_rel, (kind, a.name)
            else:
                assert a.rms_rel == pytest.approx(b.rms_rel, rel=0.3), (kind, a.name)
    rowwise = [r.rms_rel for r in report.records("fp8_rowwise", "grad")]
    high = [r.rms_rel for r in report.records("fp8_rowwise_gw_hp", "grad")]
    assert rowwise != high
    assert np.median(high) < np.median(rowwise)


def test_quantized_weights_rows_show_the_dequantized_weight(llama: nn.Module, report: Any) -> None:
    """The weight_cast row of a quantized variant is the dequantized weight against the fp32 one (computed here
    in float64 from the built model), well above bf16's rounding; the head stays bf16."""
    model = build_run_model(llama, BUILTIN_VARIANTS["int8_weight_only"], CPU)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert type(weight) is not nn.Parameter  # a torchao tensor subclass
    dequantized = weight.dequantize().double().numpy()
    reference = llama.model.layers[0].mlp.up_proj.weight.detach().double().numpy()
    expected = np.sqrt(np.mean((dequantized - reference) ** 2) / np.mean(reference**2))
    measured = report.get("int8_weight_only", "model.layers.0.mlp.up_proj.weight", "weight_cast").rms_rel
    assert measured == pytest.approx(expected, rel=1e-4)
    bf16 = report.get("bf16", "model.layers.0.mlp.up_proj.weight", "weight_cast").rms_rel
    assert measured > 2 * bf16
    assert report.get("int8_weight_only", "lm_head.weight", "weight_cast").rms_rel == pytest.approx(
        report.get("bf16", "lm_head.weight", "weight_cast").rms_rel
    )


def test_fp8_training_swaps_the_linear_modules_but_the_head(llama: nn.Module) -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = build_run_model(llama, BUILTIN_VARIANTS["fp8_rowwise"], CPU)
    swapped = sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))
    assert len(swapped) == CONVERTED and "lm_head" not in swapped
    assert type(model.lm_head) is nn.Linear
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # bf16 master weights, cast per matmul
    assert not any(isinstance(m, Float8Linear) for m in llama.modules())  # the user's model is untouched


def test_fp32_modules_and_the_filter_choose_the_modules(llama: nn.Module) -> None:
    variant = Variant("v", dtype="bfloat16", fp8_training="rowwise", fp32_modules=("model.layers.0",))
    model = build_run_model(llama, variant, CPU)
    from torchao.float8.float8_linear import Float8Linear

    swapped = [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
    assert len(swapped) == CONVERTED - 7 and not [n for n in swapped if n.startswith("model.layers.0.")]
    only_mlp = Variant("w", dtype="bfloat16", quantize="Int8WeightOnlyConfig", lowbit_filter=lambda m, n: "mlp." in n)
    chosen = lowbit_modules(llama, only_mlp, ["lm_head"], multiples_of_16=False)
    assert len(chosen) == 16 and all(".mlp." in n for n in chosen)  # the filter sees every module (act_fn too)
    assert lowbit_modules(
        llama, dataclasses.replace(only_mlp, quantize=None, fp8_training="rowwise"), [], multiples_of_16=True
    ) == [n for n in chosen if not n.endswith("act_fn")]  # fp8 training swaps nn.Linear modules only


def test_fp8_training_keeps_the_dimensions_fp8_kernels_take() -> None:
    """torchao's hardware rule: a Linear whose dimensions are not multiples of 16 stays bf16."""
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 32))
    assert lowbit_modules(model, BUILTIN_VARIANTS["fp8_rowwise"], [], multiples_of_16=True) == ["0"]
    assert lowbit_modules(model, BUILTIN_VARIANTS["int8_weight_only"], [], multiples_of_16=False) == ["0", "2", "4"]


def test_a_model_without_any_module_to_convert_is_refused() -> None:
    model = nn.Sequential(nn.Linear(10, 10))
    with pytest.raises(ConfigurationError, match=r"variant 'fp8_rowwise': no module of Sequential takes fp8 training"):
        compare(model, torch.randn(4, 10), ["fp8_rowwise"], backward=False)


def test_fp8_dynamic_needs_a_gpu_with_fp8_matmuls(llama: nn.Module) -> None:
    with pytest.raises(NotSupportedHere, match=r"Float8DynamicActivationFloat8WeightConfig runs fp8 matmuls.*8\.9"):
        compare(llama, batch(), ["fp8_dynamic"])


def test_isolated_fp8_training_and_quantized_inference(llama: nn.Module) -> None:
    """isolate=True measures where the error is born, as for bf16: fp8 training forward and backward, quantized
    inference forward only (no bw_isolated or grad_isolated rows)."""
    report = compare(llama, batch(), ["fp8_rowwise", "int8_weight_only"], isolate=True)
    for name in ("fp8_rowwise", "int8_weight_only"):
        isolated = report.records(name, "fw_isolated")
        assert [r.name for r in isolated][1:5] == [f"model.layers.{i}" for i in range(4)]
        last = report.get(name, "model.layers.3", "fw")
        assert report.get(name, "model.layers.3", "fw_isolated").rms_rel < last.rms_rel
    assert report.records("fp8_rowwise", "bw_isolated") and report.records("fp8_rowwise", "grad_isolated")
    assert report.records("int8_weight_only", "bw_isolated") == []
    assert report.records("int8_weight_only", "grad_isolated") == []
    assert report.missing["int8_weight_only"] == []


# --- fp8 storage: an independent float64 round trip ------------------------------------------------------------


def numpy_fp8(values: np.ndarray, mantissa_bits: int, min_exponent: int, largest: float) -> np.ndarray:
    """Round to the nearest fp8 value (ties to even) in float64: `mantissa_bits` explicit bits, subnormals below
    2**min_exponent, saturating never (the inputs are scaled inside the range)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(values), 2.0**min_exponent)))
    quantum = 2.0 ** (exponent - mantissa_bits)
    rounded = np.round(values / quantum) * quantum  # numpy rounds half to even
    assert np.all(np.abs(rounded) <= largest)
    return rounded


@pytest.mark.parametrize(
    ("dtype", "mantissa_bits", "min_exponent", "largest"),
    [(torch.float8_e4m3fn, 3, -6, 448.0), (torch.float8_e5m2, 2, -14, 57344.0)],
)
def test_storage_round_trip_matches_float64(
    dtype: torch.dtype, mantissa_bits: int, min_exponent: int, largest: float
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=generator) * 0.02
    weight[0, 0] = 0.0
    weight[1, :4] = torch.tensor([1e-7, -3e-6, 2e-5, 0.05])  # subnormals after scaling, and the amax
    got = storage_round_trip(weight, dtype).double().numpy()
    values = weight.double().numpy()
    scale = np.float32(largest) / np.float32(np.abs(values).max())  # one fp32 scale, as the round trip keeps it
    expected = numpy_fp8((values.astype(np.float32) * scale).astype(np.float64), mantissa_bits, min_exponent, largest)
    np.testing.assert_allclose(got, expected / np.float64(scale), rtol=1e-6, atol=0)
    assert storage_round_trip(torch.zeros(3, 3), dtype).abs().sum() == 0  # no scale from an all-zero weight


def test_storage_round_trip_is_what_the_weight_rows_show(llama: nn.Module, report: Any) -> None:
    reference = llama.model.layers[1].self_attn.q_proj.weight.detach()
    stored = storage_round_trip(reference.bfloat16(), torch.float8_e4m3fn).double()
    expected = float(((stored - reference.double()).pow(2).mean() / reference.double().pow(2).mean()).sqrt())
    got = report.get("fp8_e4m3_weights", "model.layers.1.self_attn.q_proj.weight", "weight_cast").rms_rel
    assert got == pytest.approx(expected, rel=1e-4)


# --- the world as it was -----------------------------------------------------------------------------------------


def test_a_lowbit_run_leaves_matmul_precision_and_inductor_config_as_found(llama: nn.Module) -> None:
    import torch._inductor.config as inductor

    before, inductor_before = snapshot_backend_state(), inductor.get_config_copy()
    parameters = {name: p.detach().clone() for name, p in llama.named_parameters()}
    compare(llama, batch(), ["fp8_rowwise", "int8_dynamic"])
    assert snapshot_backend_state() == before
    assert inductor.get_config_copy() == inductor_before
    for name, parameter in llama.named_parameters():
        assert type(parameter) is nn.Parameter and torch.equal(parameter, parameters[name]), name


def test_torchao_settings_are_restored_whatever_it_sets() -> None:
    import torch._inductor.config as inductor

    precision, tuning = torch.get_float32_matmul_precision(), inductor.coordinate_descent_tuning
    with pytest.raises(RuntimeError), torchao_settings_kept():
        torch.set_float32_matmul_precision("medium")  # what torchao < 0.13's quantize_ did ("high")
        inductor.coordinate_descent_tuning = not tuning
        raise RuntimeError("a conversion that fails half way")
    assert torch.get_float32_matmul_precision() == precision
    assert inductor.coordinate_descent_tuning == tuning


# --- how a variant names a format ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"fp8_training": "blockwise"}, "fp8_training='blockwise'; torchao's recipes are tensorwise, rowwise"),
        ({"weight_storage": "float8_e8m0fnu"}, "weight_storage='float8_e8m0fnu'; use float8_e4m3fn or float8_e5m2"),
        (
            {"fp8_training": "rowwise", "weight_storage": "float8_e5m2"},
            "fp8_training and weight_storage are two formats",
        ),
        ({"lowbit_filter": lambda m, n: True}, "lowbit_filter chooses modules for fp8_training, quantize or"),
        ({"fp8_training": "rowwise", "autocast": True}, "not with autocast, FSDP2 mixed precision or an arrangement"),
        ({"quantize": 8}, "quantize must be a torchao config"),
        ({"quantize": {"group_size": 32}}, "quantize as a table needs 'config'"),
    ],
)
def test_a_wrong_format_is_refused_naming_the_variant(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=r"variant 'v': ") as error:
        Variant("v", dtype="bfloat16", **fields)
    assert message in str(error.value)


def test_quantize_by_name_and_arguments_builds_the_torchao_config() -> None:
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, PerRow

    fp8 = QuantizeConfig.from_mapping({"config": "Float8WeightOnlyConfig", "weight_dtype": "torch.float8_e5m2"}, "x")
    built = fp8.build("x")
    assert isinstance(built, Float8WeightOnlyConfig) and built.weight_dtype == torch.float8_e5m2
    assert fp8.describe() == "Float8WeightOnlyConfig(weight_dtype='torch.float8_e5m2')"
    nested = {"config": "Float8DynamicActivationFloat8WeightConfig", "granularity": {"config": "PerRow"}}
    granularity = QuantizeConfig.from_mapping(nested, "x").build("x").granularity
    assert all(
        isinstance(g, PerRow) for g in (granularity if isinstance(granularity, (list, tuple)) else [granularity])
    )
    assert QuantizeConfig("Int8WeightOnlyConfig").build("x") == Int8WeightOnlyConfig()
    with pytest.raises(ConfigurationError, match=r"here: quantize: torchao has no config 'Int3Config'.*Int8WeightOnly"):
        QuantizeConfig("Int3Config").build("here")
    with pytest.raises(ConfigurationError, match=r"here: quantize: Int8WeightOnlyConfig\(bits=3\) was refused: "):
        QuantizeConfig.from_mapping({"config": "Int8WeightOnlyConfig", "bits": 3}, "here").build("here")


def test_a_torchao_config_object_is_a_variant(llama: nn.Module) -> None:
    from torchao.quantization import Int8WeightOnlyConfig

    variant = Variant("int8_obj", dtype="bfloat16", quantize=Int8WeightOnlyConfig())
    report = compare(llama, batch(), [variant, "int8_weight_only"], backward=False)
    assert report.runs["int8_obj"].variant["quantize"].startswith("Int8WeightOnlyConfig(")
    for a, b in zip(report.records("int8_obj"), report.records("int8_weight_only"), strict=True):
        assert a.rms_rel == b.rms_rel, a.name


def test_without_torchao_the_error_names_the_extra(llama: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError
    for name in ("fp8_rowwise", "int8_weight_only"):
        with pytest.raises(ConfigurationError, match=r'needs torchao.*pip install "pytest-precision\[lowbit\]"'):
            compare(llama, batch(), [name], backward=False)
    compare(llama, batch(), ["fp8_e4m3_weights"], backward=False)  # storage casts need no torchao


# --- torchao's notices on a CPU build of torch -------------------------------------------------------------------


def test_torchao_library_notices_are_dropped_on_a_cpu_torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    notices = TorchaoNotices()

    def record(name: str, message: str, *args: Any) -> logging.LogRecord:
        return logging.LogRecord(name, logging.WARNING, __file__, 1, message, args or None, None)

    failed = record("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not notices.filter(failed)
    assert notices.filter(record("torchao", "Skipping import of cpp extensions due to incompatible torch version"))
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build: a library that fails to load is news
    assert notices.filter(failed)

    class TorchaoEnum:
        __module__ = "torchao.float8.config"

    class UserEnum:
        __module__ = "my_project"

    deprecated = "%s is an Enum subclass ... Calling register_constant() on Enum subclasses is deprecated and will"
    assert not notices.filter(record("torch.utils._pytree", deprecated, TorchaoEnum))
    assert notices.filter(record("torch.utils._pytree", deprecated, UserEnum))


def test_importing_transformers_beside_torchao_prints_nothing_after_the_plugin() -> None:
    code = "import pytest_precision, transformers; from transformers import LlamaForCausalLM"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    if torch.version.cuda is None:
        assert "Failed to load" not in result.stderr
    assert "register_constant() on Enum subclasses" not in result.stderr


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="oneDNN's ISA limit is x86's")
def test_the_int8_matmul_probe_agrees_with_an_exact_product_on_other_operands() -> None:
    """Limited to AVX2, an Intel CPU with VNNI runs oneDNN's int8 gemm, which sums product pairs in saturating int16;
    an AMD CPU without VNNI runs an exact one: whichever this CPU runs, the probe says what a larger, independent
    full-range product (checked in int64 NumPy) shows (this repository's conftest pins AVX2)."""
    code = (
        "import numpy as np, torch\n"
        "from pytest_precision.engine.lowbit_build import int8_matmul_exact\n"
        "g = torch.Generator().manual_seed(7)\n"
        "a = torch.randint(-128, 128, (64, 256), dtype=torch.int8, generator=g)\n"
        "b = torch.randint(-128, 128, (256, 64), dtype=torch.int8, generator=g)\n"
        "exact = np.array_equal(torch._int_mm(a, b).numpy(), a.numpy().astype(np.int64) @ b.numpy().astype(np.int64))\n"
        "print(int8_matmul_exact(), exact)"
    )
    environment = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=True)
    probe, exact = result.stdout.split()[-2:]
    assert probe == exact


# --- hostile input ----------------------------------------------------------------------------------------------


def test_a_storage_format_may_be_the_torch_dtype() -> None:
    variant = Variant("v", dtype="bfloat16", weight_storage=torch.float8_e4m3fn)
    assert variant.weight_storage == "float8_e4m3fn"
    assert variant == Variant("v", dtype="bfloat16", weight_storage="float8_e4m3fn")


def test_a_filter_that_raises_names_the_variant_and_the_module(llama: nn.Module) -> None:
    def broken(module: nn.Module, name: str) -> bool:
        raise KeyError(name)

    variant = Variant("v", dtype="bfloat16", quantize="Int8WeightOnlyConfig", lowbit_filter=broken)
    with pytest.raises(ModelRunError, match=r"variant 'v': lowbit_filter raised KeyError on module 'model'"):
        compare(llama, batch(), [variant], backward=False)


def test_a_quantize_object_that_is_no_torchao_config_is_refused(llama: nn.Module) -> None:
    variant = Variant("v", dtype="bfloat16", quantize=object())
    with pytest.raises(ConfigurationError, match=r"variant 'v': quantize must be a torchao config.*got <object obj"):
        compare(llama, batch(), [variant], backward=False)


def test_a_sharded_model_is_refused_for_formats_below_16_bits(llama: nn.Module) -> None:
    from pytest_precision.distributed.sharding import sharded

    with pytest.raises(ConfigurationError, match=r"variant 'fp8_rowwise': formats below 16 bits are measured on unsh"):
        build_run_model(sharded(llama, lambda model, variant: model), BUILTIN_VARIANTS["fp8_rowwise"], CPU)


def test_nan_in_the_model_is_found_in_the_reference_before_any_low_bit_run() -> None:
    model = tiny_llama(layers=2)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ModelRunError, match=r"the fp32 reference is not finite: NaN/Inf first appear in model\.layers"):
        compare(model, batch(), ["fp8_rowwise"])


def test_what_cannot_run_here_is_refused_before_the_reference_runs(llama: nn.Module, monkeypatch) -> None:
    """A missing torchao, a config torchao lacks or fp8 matmuls on a CPU fail the comparison before any run."""
    import pytest_precision.engine.compare as compare_module

    def no_reference(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the reference ran")

    monkeypatch.setattr(compare_module, "build_reference", no_reference)
    with pytest.raises(NotSupportedHere, match="fp8 matmuls"):
        compare(llama, batch(), ["bf16", "fp8_dynamic"])
    with pytest.raises(ConfigurationError, match="torchao has no config 'NoSuchConfig'"):
        compare(llama, batch(), ["bf16", Variant("v", dtype="bfloat16", quantize="NoSuchConfig")])
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ConfigurationError, match=r"variant 'fp8_rowwise' \(fp8 training\) needs torchao"):
        compare(llama, batch(), ["fp8_rowwise"])


def test_quantize_tables_and_their_values_round_trip() -> None:
    """A variants file's values: lists stay lists (inside a hashable spec), "torch.<name>" becomes the attribute,
    a nested table becomes the torchao object; a table without a class name, or a config name that is not
    text, is refused."""
    from pytest_precision.engine.lowbit_formats import _frozen, _thawed

    frozen = _frozen([1, [2, "torch.float8_e5m2"], {"config": "PerRow"}])
    hash(frozen)
    thawed = _thawed(frozen, "x")
    assert thawed[:2] == [1, [2, torch.float8_e5m2]]
    assert type(thawed[2]).__name__ == "PerRow"
    spec = QuantizeConfig.from_mapping({"config": "Float8WeightOnlyConfig", "b": [1, 2], "a": "x"}, "here")
    assert spec.describe() == "Float8WeightOnlyConfig(a='x', b=(1, 2))"
    for bad in ({"config": 5}, {"config": ""}, {"group_size": 32}):
        with pytest.raises(ConfigurationError, match=r"here: quantize as a table needs 'config'"):
            QuantizeConfig.from_mapping(bad, "here")
    no_class = {"config": "Float8WeightOnlyConfig", "granularity": {"dim": 1}}
    with pytest.raises(ConfigurationError, match=r"here: a table among quantize's arguments needs 'config'"):
        QuantizeConfig.from_mapping(no_class, "here").build("here")
    with pytest.raises(ConfigurationError, match=r"here: quantize: 'float9' is not a torch dtype"):
        _thawed("torch.float9", "here")
    for nested in ([1, "torch.float9"], [{"config": "NoSuchGranularity"}]):  # `where` reaches nested values
        with pytest.raises(ConfigurationError, match=r"^here: "):
            _thawed(_frozen(nested), "here")


def test_fp8_matmuls_are_native_from_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_precision.engine import lowbit_build

    cuda = torch.device("cuda", 1)
    asked: list[Any] = []
    for capability, native in (((8, 6), False), ((8, 9), True), ((9, 0), True), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: asked.append(d) or c)
        assert lowbit_build.fp8_native(cuda) is native, capability
    assert asked == [cuda] * 4
    assert lowbit_build.fp8_native(torch.device("cpu")) is False


def test_on_fp8_hardware_the_recipe_runs_torchaos_kernels_not_its_emulation(
    llama: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchao.float8.float8_linear import Float8Linear

    from pytest_precision.engine import lowbit_build

    monkeypatch.setattr(lowbit_build, "fp8_native", lambda device: True)
    model = build_run_model(llama, BUILTIN_VARIANTS["fp8_rowwise"], CPU)  # built only: a CPU has no fp8 matmuls
    converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert converted and all(not m.config.emulate for m in converted)
    assert lowbit_build.APPLIED_FORMATS[model].kernels == "native"


def test_the_filter_is_asked_with_the_module_and_modules_past_a_refused_one_are_asked_too() -> None:
    model = nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 48), nn.Linear(48, 16))
    variant = Variant(
        "v", dtype="bfloat16", quantize="Int8WeightOnlyConfig", lowbit_filter=lambda m, n: m.out_features > 20
    )
    with pytest.raises(ModelRunError, match=r"module '1': 'ReLU' object has no attribute"):  # given the module
        lowbit_modules(model, variant, [], multiples_of_16=False)
    linear_only = dataclasses.replace(
        variant, lowbit_filter=lambda m, n: isinstance(m, nn.Linear) and m.out_features > 20
    )
    assert lowbit_modules(model, linear_only, [], multiples_of_16=False) == ["0", "2"]
    assert lowbit_modules(model, BUILTIN_VARIANTS["fp8_rowwise"], [], multiples_of_16=True) == ["2", "3"]


def test_a_conversion_torchao_refuses_is_a_model_run_error(llama: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchao.float8

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("no fp8 here")

    monkeypatch.setattr(torchao.float8, "convert_to_float8_training", refuse)
    message = r"variant 'fp8_rowwise': torchao's convert_to_float8_training raised ValueError: no fp8 here"
    with pytest.raises(ModelRunError, match=message):
        build_run_model(llama, BUILTIN_VARIANTS["fp8_rowwise"], CPU)


def test_the_report_header_says_what_each_format_ran(report: Any) -> None:
    header = report.format(full=False).split("\n\n")[0].splitlines()
    version = torchao.__version__
    int8_dynamic = "native"
    if not int8_matmul_exact():
        int8_dynamic = "native, inexact int8 matmuls (oneDNN without VNNI: torch._int_mm saturates)"
    assert header[1:] == [
        f"  fp8_tensorwise: fp8 training, tensorwise recipe, emulated, torchao {version}, 28 module(s)",
        f"  fp8_rowwise: fp8 training, rowwise recipe, emulated, torchao {version}, 28 module(s)",
        f"  fp8_rowwise_gw_hp: fp8 training, rowwise_with_gw_hp recipe, emulated, torchao {version}, 28 module(s)",
        f"  int8_weight_only: quantized inference, Int8WeightOnlyConfig(), native, torchao {version}, 28 module(s)",
        "  int8_dynamic: quantized inference, Int8DynamicActivationInt8WeightConfig(), "
        f"{int8_dynamic}, torchao {version}, 28 module(s)",
        f"  fp8_weight_only: quantized inference, Float8WeightOnlyConfig(), native, torchao {version}, 28 module(s)",
        "  fp8_e4m3_weights: fp8 weight storage, float8_e4m3fn scaled per tensor, plain casts, 28 module(s)",
        "  fp8_e5m2_weights: fp8 weight storage, float8_e5m2 scaled per tensor, plain casts, 28 module(s)",
    ]  # bf16, first, has no line


@pytest.mark.parametrize(
    ("name", "what"),
    [("int8_weight_only", "quantize=Int8WeightOnlyConfig()"), ("fp8_e4m3_weights", "weight_storage=float8_e4m3fn")],
)
def test_no_module_to_quantize_or_store_is_refused(name: str, what: str) -> None:
    model = nn.Sequential(nn.Embedding(10, 8))
    with pytest.raises(ConfigurationError, match=rf"variant '{name}': no module of Sequential takes {re.escape(what)}"):
        build_run_model(model, BUILTIN_VARIANTS[name], CPU)


@pytest.mark.parametrize("name", ["int8_weight_only", "fp8_e4m3_weights"])
def test_quantize_and_storage_take_any_linear_shape(name: str) -> None:
    """Only fp8 training needs dimensions that are multiples of 16."""
    from pytest_precision.engine.lowbit_build import APPLIED_FORMATS

    model = build_run_model(nn.Sequential(nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 8)), BUILTIN_VARIANTS[name], CPU)
    assert APPLIED_FORMATS[model].modules == ("0", "2")


def test_storage_skips_chosen_modules_without_a_weight() -> None:
    variant = Variant("v", dtype="bfloat16", weight_storage="float8_e5m2", lowbit_filter=lambda m, n: True)
    reference = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    model = build_run_model(reference, variant, CPU)
    assert torch.equal(model[0].weight, storage_round_trip(reference[0].weight.detach().bfloat16(), torch.float8_e5m2))


def test_an_empty_quantize_name_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"variant 'v': quantize must be a torchao config.*got ''"):
        Variant("v", dtype="bfloat16", quantize="")


def test_an_unknown_config_lists_torchaos_configs_only() -> None:
    with pytest.raises(ConfigurationError) as error:
        QuantizeConfig("Int3Config").build("here")
    configs = str(error.value).partition("its configs: ")[2].split(", ")
    assert "Int8WeightOnlyConfig" in configs and all(c.endswith("Config") and not c.startswith("_") for c in configs)
    nested = QuantizeConfig.from_mapping(
        {"config": "Int8WeightOnlyConfig", "granularity": {"config": "PerGroup", "group_size": 32}}, "x"
    )
    assert nested.describe() == "Int8WeightOnlyConfig(granularity=PerGroup(group_size=32))"


def test_fp8_matmuls_on_an_older_gpu_name_its_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_precision.engine.lowbit_build import runnable_quantize_config

    asked: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or (8, 6))
    with pytest.raises(NotSupportedHere, match=r"this run is on cuda of compute capability 8\.6\)"):
        runnable_quantize_config(BUILTIN_VARIANTS["fp8_dynamic"], torch.device("cuda", 3))
    assert asked and all(device == torch.device("cuda", 3) for device in asked)


def test_a_wrapped_quantized_weight_is_dequantized_through_the_weight_it_wraps() -> None:
    """torchao < 0.13 wraps int8-dynamic weights (LinearActivationQuantizedTensor) around the quantized weight,
    and the wrapper has no dequantize of its own."""
    from pytest_precision.engine.lowbit_build import dequantized

    class Quantized(torch.Tensor):
        def dequantize(self) -> torch.Tensor:  # type: ignore[override]
            return torch.full(self.shape, 2.0)

    class Wrapper(torch.Tensor):
        original_weight_tensor: torch.Tensor

    inner = torch.Tensor._make_subclass(Quantized, torch.zeros(2, 3))
    outer = torch.Tensor._make_subclass(Wrapper, torch.zeros(2, 3))
    outer.original_weight_tensor = inner
    assert torch.equal(dequantized(outer), torch.full((2, 3), 2.0))
    assert torch.equal(dequantized(inner), torch.full((2, 3), 2.0))
    plain = nn.Parameter(torch.ones(2))
    assert torch.equal(dequantized(plain), plain.detach()) and not dequantized(plain).requires_grad


def test_a_filter_may_take_the_head_and_fp32_modules_stay_out(llama: nn.Module) -> None:
    from pytest_precision.engine.lowbit_build import APPLIED_FORMATS

    every_linear = Variant(
        "v", dtype="bfloat16", quantize="Int8WeightOnlyConfig", lowbit_filter=lambda m, n: isinstance(m, nn.Linear)
    )
    model = build_run_model(llama, every_linear, CPU)
    assert "lm_head" in APPLIED_FORMATS[model].modules and type(model.lm_head.weight) is not nn.Parameter
    kept = dataclasses.replace(every_linear, fp32_modules=("lm_head",))
    assert "lm_head" not in APPLIED_FORMATS[build_run_model(llama, kept, CPU)].modules


def test_a_prepare_callable_after_the_format_keeps_the_report_line(llama: nn.Module) -> None:
    from pytest_precision.engine.lowbit_build import APPLIED_FORMATS

    wrapped = Variant("v", dtype="bfloat16", weight_storage="float8_e4m3fn", prepare=lambda model: copy.copy(model))
    model = build_run_model(llama, wrapped, CPU)
    assert APPLIED_FORMATS[model].kernels == "plain casts"
