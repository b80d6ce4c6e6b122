"""A custom variant: your own kernel or patch, built with `prepare`, gated like a built-in.

Here the "kernel" is an RMSNorm computed in bf16 with its reduction in bf16 as well (a common shortcut of
fused kernels), against the model's own norm, which upcasts to fp32 inside. The gate shows what the shortcut
costs, layer by layer, and fails if a later change makes it worse.

    pytest examples/test_custom_variant.py --precision-tables
"""

from __future__ import annotations

import torch
from torch import nn

from conftest import load_trained_lm, trained_lm_text_batch
from pytest_precision import Variant


class LowPrecisionRMSNorm(nn.Module):
    """RMSNorm without the fp32 upcast: the mean of squares is accumulated in the input's dtype."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.eps))


def bf16_norm_kernel(model: nn.Module) -> nn.Module:
    """Swap every RMSNorm of the run's model (a copy: the user's model is never touched)."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RMSNorm"):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LowPrecisionRMSNorm(module.weight, module.variance_epsilon))
    return model


FUSED_NORM = Variant("bf16_fused_norm", dtype="bfloat16", prepare=bf16_norm_kernel)


def test_custom_norm_kernel(precision, assert_precision_within):
    report = precision.run(load_trained_lm, trained_lm_text_batch(length=64), variants=["bf16", FUSED_NORM])
    assert_precision_within(report)
    # The shortcut must cost something measurable at the output, but stay within 5x of plain bf16.
    plain = report.get("bf16", "lm_head").rms_rel
    fused = report.get("bf16_fused_norm", "lm_head").rms_rel
    assert plain < fused < 5 * plain
