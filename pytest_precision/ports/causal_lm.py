"""Calling a causal LM that returns bare logits the way transformers' causal LMs are called: the loss from `labels`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError

if TYPE_CHECKING:
    import torch
    from torch import nn


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: the mean cross-entropy of logits[:, t] against labels[:, t + 1], computed in fp32,
    positions labelled -100 left out."""
    import torch.nn.functional as F

    shifted = logits[:, :-1].float()
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def causal_lm_forward(model: nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
    """Call a causal LM returning logits (torchtune, torchtitan, a hand-written model) on the reference's inputs, a dict
    with `input_ids` (and `labels`): ``{"logits": ..., "loss": ...}`` as a transformers model returns them (the loss
    only with labels). Port(forward=causal_lm_forward)."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise ConfigurationError(
            "causal_lm_forward: the inputs must be a dict with 'input_ids' (and 'labels'); write the port's own "
            "forward(model, inputs) for other inputs"
        )
    output = model(inputs["input_ids"])
    logits = output if not isinstance(output, (tuple, list)) else output[0]
    result = {"logits": logits}
    labels = inputs.get("labels")
    if labels is not None:
        result["loss"] = causal_lm_loss(logits, labels)
    return result
