"""A low-bit conversion is checked, not trusted: for each kind (fp8 training, quantize_, weight storage), a
conversion that raises, that leaves every chosen module as it was, or that has no module to take fails the run
naming the variant and the reason; modules a conversion skipped are not recorded as converted."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.engine import lowbit_build
from pytest_precision.engine.compare import compare
from pytest_precision.engine.lowbit_build import APPLIED_FORMATS
from pytest_precision.engine.model_build import build_run_model
from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant

pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")
import torchao.float8
import torchao.quantization

CPU = torch.device("cpu")
#: (variant, the torchao module and function it calls, as the message names it)
KINDS = [
    ("fp8_rowwise", torchao.float8, "convert_to_float8_training", "torchao's convert_to_float8_training"),
    ("int8_weight_only", torchao.quantization, "quantize_", "torchao's quantize_ with Int8WeightOnlyConfig"),
]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def inputs() -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(1))


def fail(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("kernel not built for this device")


def nothing(*args: Any, **kwargs: Any) -> None:
    """A conversion that returns without converting anything (as a swallowed error would)."""


@pytest.mark.parametrize(("name", "where", "function", "what"), KINDS)
def test_a_torchao_conversion_that_raises_fails_the_run_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, name: str, where: Any, function: str, what: str
) -> None:
    monkeypatch.setattr(where, function, fail)
    message = rf"variant '{name}': {re.escape(what)} raised RuntimeError: kernel not built for this device"
    with pytest.raises(ModelRunError, match=message):
        compare(mlp(), inputs(), ["bf16", name], backward=False)


@pytest.mark.parametrize(("name", "where", "function", "what"), KINDS)
def test_a_torchao_conversion_that_converts_nothing_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, name: str, where: Any, function: str, what: str
) -> None:
    """The run would measure bf16 weights under the fp8 / int8 label."""
    monkeypatch.setattr(where, function, nothing)
    message = rf"^variant '{name}': {re.escape(what)} converted none of the 3 module\(s\) chosen \(0, 2, 4\); the run"
    with pytest.raises(ModelRunError, match=message):
        compare(mlp(), inputs(), ["bf16", name], backward=False)


def test_weight_storage_that_raises_fails_the_run_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lowbit_build, "storage_round_trip", fail)
    message = r"variant 'fp8_e4m3_weights': storing weights as float8_e4m3fn raised RuntimeError: kernel not built"
    with pytest.raises(ModelRunError, match=message):
        compare(mlp(), inputs(), ["bf16", "fp8_e4m3_weights"], backward=False)


def test_weight_storage_of_modules_without_a_weight_fails_the_run() -> None:
    only_relu = Variant("v", dtype="bfloat16", weight_storage="float8_e5m2", lowbit_filter=lambda m, n: n in ("1", "3"))
    message = r"variant 'v': weight_storage=float8_e5m2 \(a floating-point weight each\) converted none of the 2 mod"
    with pytest.raises(ModelRunError, match=message):
        compare(mlp(), inputs(), ["bf16", only_relu], backward=False)


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"fp8_training": "rowwise"}, "fp8 training (rowwise)"),
        ({"quantize": "Int8WeightOnlyConfig"}, "quantize=Int8WeightOnlyConfig()"),
        ({"weight_storage": "float8_e4m3fn"}, "weight_storage=float8_e4m3fn"),
    ],
)
def test_a_filter_that_selects_no_module_fails_the_run_naming_the_variant(fields: dict[str, Any], what: str) -> None:
    variant = Variant("picky", dtype="bfloat16", lowbit_filter=lambda module, name: False, **fields)
    with pytest.raises(ConfigurationError, match=rf"^variant 'picky': no module of Sequential takes {re.escape(what)}"):
        compare(mlp(), inputs(), ["bf16", variant], backward=False)


def test_quantize_records_only_the_modules_it_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao skips some modules silently (int4 weight-only: a group size that does not divide the input
    features): the label counts what took the format."""
    real = torchao.quantization.quantize_

    def skipping_the_middle(model: nn.Module, config: Any, filter_fn: Any) -> None:
        real(model, config, filter_fn=lambda module, name: name != "2" and filter_fn(module, name))

    monkeypatch.setattr(torchao.quantization, "quantize_", skipping_the_middle)
    model = build_run_model(mlp(), BUILTIN_VARIANTS["int8_weight_only"], CPU)
    applied = APPLIED_FORMATS[model]
    assert applied.modules == ("0", "4") and applied.to_dict()["modules"] == 2
    assert applied.to_dict()["module_names"] == ["0", "4"]


def test_every_kind_records_its_module_names_sorted() -> None:
    for name in ("fp8_rowwise", "int8_weight_only", "fp8_e5m2_weights"):
        model = build_run_model(mlp(), BUILTIN_VARIANTS[name], CPU)
        lowbit = APPLIED_FORMATS[model].to_dict()
        assert lowbit["module_names"] == ["0", "2", "4"] and lowbit["modules"] == 3, name
