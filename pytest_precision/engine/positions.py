"""Which positions of a batch count, worked out once per batch so that no run asks the device again.

A (batch, seq) tensor is measured at the positions that count (attention mask and labels != -100); the
chosen-token log-probabilities at the (batch, seq - 1) positions whose next token counts. Both are kept as
flat indices: selecting rows with `index_select` has a size known on the host, where boolean indexing would
make the device report how many elements it kept, once per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_precision.engine.batch import Batch
from pytest_precision.numbers.logprobs import next_token_targets

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Positions:
    """The counted positions of one batch, on the run's device.

    shape / index: the (batch, seq) shape of the position mask and the flat indices of its counted positions
        (index None: every position counts, or there is no mask);
    targets / valid: (batch, seq - 1) next-token targets and whether each counts (None: not a token batch);
    valid_index: flat indices of the counted (batch, seq - 1) positions;
    logits_index: flat indices, in (batch, seq) rows of the logits, of the positions that predict a counted
        token (the last position of each sequence predicts none);
    targets_max: the largest target id (-1 without targets), to tell vocabulary logits from other ones;
    token_count: tokens that count (see Batch.token_count).
    """

    shape: tuple[int, ...] | None
    index: torch.Tensor | None
    targets: torch.Tensor | None
    valid: torch.Tensor | None
    valid_index: torch.Tensor | None
    logits_index: torch.Tensor | None
    targets_max: int
    token_count: int | None


def batch_positions(batch: Batch, device: torch.device) -> Positions:
    """Work out a batch's counted positions (a few host syncs, once per batch, on the inputs' own device)."""
    import torch

    mask = batch.mask(device)
    shape: tuple[int, ...] | None = None
    index = None
    if mask is not None:
        shape = tuple(mask.shape)
        counted = mask.reshape(-1).nonzero().reshape(-1)
        if counted.numel() != mask.numel():
            index = counted
    input_ids = batch.kwargs.get("input_ids")
    labels = batch.kwargs.get("labels")
    ids = input_ids if input_ids is not None else labels
    targets = valid = valid_index = logits_index = None
    targets_max = -1
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        attention = batch.kwargs.get("attention_mask")
        targets, valid = next_token_targets(
            ids.to(device),
            labels.to(device) if isinstance(labels, torch.Tensor) and labels.dim() == 2 else None,
            attention.to(device) if isinstance(attention, torch.Tensor) and attention.dim() == 2 else None,
        )
        valid_index = valid.reshape(-1).nonzero().reshape(-1)
        _, positions = valid.shape
        # Position (b, t) of the (batch, seq - 1) grid is row b * (positions + 1) + t of the (batch, seq) logits.
        logits_index = valid_index + valid_index // max(positions, 1)
        targets_max = int(targets.max()) if targets.numel() else -1
    return Positions(
        shape=shape,
        index=index,
        targets=targets,
        valid=valid,
        valid_index=valid_index,
        logits_index=logits_index,
        targets_max=targets_max,
        token_count=batch.token_count() if mask is None else (mask.numel() if index is None else index.numel()),
    )


def select_positions(tensor: torch.Tensor, shape: tuple[int, ...] | None, index: torch.Tensor | None) -> torch.Tensor:
    """The counted positions of a (batch, seq, ...) tensor of that `shape` as (counted, ...); other tensors,
    and every tensor when all positions count (`index` None), whole."""
    if index is None or shape is None or tensor.dim() < len(shape) or tuple(tensor.shape[: len(shape)]) != shape:
        return tensor
    rows = tensor.reshape(-1, *tensor.shape[len(shape) :])
    return rows.index_select(0, index.to(tensor.device))
