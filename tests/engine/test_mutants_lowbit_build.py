"""What engine/lowbit_build.py reports (issue 34's mutants): a conversion that converted none of more than three
chosen modules shows the first three and the count; the kernels label of quantized inference says int8 matmuls
are inexact only for int8 dynamic activation configs, and only on a CPU whose int8 matmul is inexact."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from pytest_precision.base.errors import ModelRunError
from pytest_precision.engine import lowbit_build
from pytest_precision.engine.lowbit_build import APPLIED_FORMATS
from pytest_precision.engine.model_build import build_run_model
from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant

CPU = torch.device("cpu")


def mlp(layers: int, width: int = 8) -> nn.Module:
    """`layers` nn.Linear modules (0, 2, 4, ...) with a ReLU (1, 3, 5, ...) after each."""
    torch.manual_seed(0)
    return nn.Sequential(*(module for _ in range(layers) for module in (nn.Linear(width, width), nn.ReLU())))


@pytest.mark.parametrize(
    ("layers", "shown"), [(3, "1, 3, 5"), (4, "1, 3, 5, ... (4 in all)"), (5, "1, 3, 5, ... (5 in all)")]
)
def test_a_conversion_of_no_module_shows_three_chosen_and_the_count_of_more(layers: int, shown: str) -> None:
    """A filter that chooses only the ReLUs (no weight to store): nothing takes the format."""
    relus = Variant("v", dtype="bfloat16", weight_storage="float8_e5m2", lowbit_filter=lambda m, n: int(n) % 2 == 1)
    message = (
        rf"^variant 'v': weight_storage=float8_e5m2 \(a floating-point weight each\) converted none of the {layers} "
        rf"module\(s\) chosen \({re.escape(shown)}\); the run would measure unconverted weights"
    )
    with pytest.raises(ModelRunError, match=message):
        build_run_model(mlp(layers), relus, CPU)


INEXACT = "native, inexact int8 matmuls (oneDNN without VNNI: torch._int_mm saturates)"


@pytest.mark.parametrize(
    ("name", "exact", "kernels"),
    [
        ("int8_dynamic", False, INEXACT),
        ("int8_dynamic", True, "native"),
        ("int8_weight_only", False, "native"),  # no int8 matmul: its weights are dequantized
        ("int8_weight_only", True, "native"),
    ],
    ids=["dynamic-inexact-cpu", "dynamic-exact-cpu", "weight-only-inexact-cpu", "weight-only-exact-cpu"],
)
def test_only_int8_dynamic_activation_on_an_inexact_cpu_is_labelled_inexact(
    monkeypatch: pytest.MonkeyPatch, name: str, exact: bool, kernels: str
) -> None:
    pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")
    monkeypatch.setattr(lowbit_build, "int8_matmul_exact", lambda: exact)
    # 64 wide: torchao 0.9's int8 dynamic quantization leaves 8-feature layers as they are (0.18 converts them).
    model = build_run_model(mlp(2, width=64), BUILTIN_VARIANTS[name], CPU)
    assert APPLIED_FORMATS[model].kernels == kernels
