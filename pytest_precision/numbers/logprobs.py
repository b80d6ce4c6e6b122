"""Chosen-token log-probabilities of causal LMs and the statistics RL post-training cares about.

logpi[t] = log_softmax(logits[t] / temperature)[ids[t + 1]]: the log-probability of the next token, the
vector an inference engine returns as prompt log-probs (vLLM's `prompt_logprobs[1:]`). Labels, when given,
are unshifted as in transformers and shifted the same way; positions whose target is -100 or masked out
are ignored.

For a variant against its reference, delta = logpi_variant - logpi_reference is the log of the importance
ratio exp(logpi_train - logpi_sample) that a precision mismatch introduces; the clip fraction is the share of
tokens whose ratio leaves PPO's band [1 - eps, 1 + eps].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
DEFAULT_CLIP_EPS = 0.2


def next_token_targets(
    input_ids: torch.Tensor, labels: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, valid), both (batch, seq - 1): the token each position predicts, and whether it counts."""
    source = labels if labels is not None else input_ids
    targets = source[:, 1:]
    valid = targets != IGNORE_INDEX
    if attention_mask is not None:
        valid = valid & (attention_mask[:, 1:] != 0) & (attention_mask[:, :-1] != 0)
    return targets.clamp_min(0), valid


def chosen_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """(batch, seq - 1) log-probabilities of `targets` under logits[:, :-1], computed in `dtype` (float32).

    A few rows at a time (see metrics.chunk_elements): each row's log-softmax is independent of the others,
    so the values are those of one whole-tensor log_softmax, without its vocabulary-sized temporaries."""
    import torch

    from pytest_precision.numbers.metrics import chunk_elements

    dtype = dtype or torch.float32
    batch, positions, vocab = logits.shape[0], logits.shape[1] - 1, logits.shape[-1]
    rows = logits.reshape(-1, vocab)  # a view of the model's (contiguous) logits
    flat_targets = targets.reshape(batch * positions, 1).to(logits.device)
    chosen = torch.empty(batch * positions, dtype=dtype, device=logits.device)
    step = max(1, chunk_elements(logits.device) // max(vocab, 1))
    for start in range(0, batch * positions, step):
        # flat position p of logits[:, :-1] is row p + p // positions of the whole logits
        index = torch.arange(start, min(start + step, batch * positions), device=logits.device)
        work = rows.index_select(0, index + index // max(positions, 1)).to(dtype)
        if temperature != 1:
            work /= temperature
        chosen[start : start + step] = torch.log_softmax(work, dim=-1).gather(-1, flat_targets[start : start + step])[
            :, 0
        ]
    return chosen.reshape(batch, positions)


@dataclass(frozen=True)
class LogRatioStats:
    """Statistics of delta = logpi_variant - logpi_reference over the counted tokens."""

    delta_mean: float | None
    delta_rms: float | None
    delta_max_abs: float | None
    clip_fraction: float | None
    seq_delta_mean: float | None
    seq_delta_std: float | None
    seq_delta_rms: float | None
    seq_delta_max: float | None


#: Values of `log_ratio_sums`: additive over disjoint sets of sequences (data-parallel ranks), but for the
#: maxima at LOG_RATIO_MAXIMA.
LOG_RATIO_SUMS = 9
LOG_RATIO_MAXIMA = (3, 8)


def log_ratio_sums(delta: torch.Tensor, valid: torch.Tensor, *, clip_eps: float = DEFAULT_CLIP_EPS) -> torch.Tensor:
    """LOG_RATIO_SUMS of `delta` (batch, positions) where `valid`, on the device (no host sync): counted tokens,
    sum of delta, of delta^2, max |delta|, clipped tokens; sequences with a counted token, sum of their mean
    delta, of its square, max |mean|. See log_ratio_from_sums."""
    import torch

    d = torch.where(valid, delta.to(torch.float64), 0.0)
    count = valid.sum(dtype=torch.float64)
    low, high = math.log1p(-clip_eps), math.log1p(clip_eps)
    clipped = ((d < low) | (d > high)) & valid
    per_sequence_count = valid.sum(dim=1, dtype=torch.float64)
    has_tokens = per_sequence_count > 0
    sequence_means = torch.where(has_tokens, d.sum(dim=1) / per_sequence_count.clamp_min(1.0), 0.0)
    zero = count.new_zeros(())
    return torch.stack(
        [
            count,
            d.sum(),
            d.square().sum(),
            d.abs().max() if d.numel() else zero,
            clipped.sum(dtype=torch.float64),
            has_tokens.sum(dtype=torch.float64),
            sequence_means.sum(),
            sequence_means.square().sum(),
            sequence_means.abs().max() if sequence_means.numel() else zero,
        ]
    )


def log_ratio_from_sums(values: Sequence[float]) -> LogRatioStats:
    """LogRatioStats from a host copy of log_ratio_sums (all None when no token counts): token mean, rms, max
    |.| and clipped share; then the mean, population std, rms and max |.| of the per-sequence mean deltas."""
    count, total, squares, largest, clipped, sequences, means, mean_squares, largest_mean = values
    if count == 0:
        return LogRatioStats(None, None, None, None, None, None, None, None)
    mean_of_means = means / sequences
    variance = max(0.0, mean_squares / sequences - mean_of_means * mean_of_means)
    return LogRatioStats(
        total / count,
        math.sqrt(squares / count),
        largest,
        clipped / count,
        mean_of_means,
        math.sqrt(variance),
        math.sqrt(mean_squares / sequences),
        largest_mean,
    )


def log_ratio_stats(delta: torch.Tensor, valid: torch.Tensor, *, clip_eps: float = DEFAULT_CLIP_EPS) -> LogRatioStats:
    """Token-level and per-sequence statistics of `delta` (batch, positions) where `valid` (one host sync)."""
    from pytest_precision.numbers.metrics import to_host

    [values] = to_host([log_ratio_sums(delta, valid, clip_eps=clip_eps)])
    return log_ratio_from_sums(values)


@dataclass(frozen=True)
class DistributionStats:
    """Whole-distribution agreement per counted position: KL(p_ref || p_variant) and top-1 agreement."""

    kl_mean: float | None
    kl_max: float | None
    top1_agreement: float | None


def distribution_rows(
    reference_logits: torch.Tensor, variant_logits: torch.Tensor, rows: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """(2, len(rows)) float64 on the device (no host sync): per logits row in `rows` (flat indices into the
    (batch * seq) rows), KL(p_ref || p_var) and 1.0 where the two argmaxes agree (else 0.0).

    Rows are processed a few at a time (see metrics.chunk_elements) with in-place float64 temporaries, so the
    pass holds no more than a chunk of vocabulary-wide values beyond the two logits tensors; what it keeps is
    two numbers per row (the per-token vectors that percentiles need: 16 bytes a token).
    """
    import torch

    from pytest_precision.numbers.metrics import chunk_elements

    vocab = reference_logits.shape[-1]
    ref = reference_logits.reshape(-1, vocab)
    var = variant_logits.reshape(-1, vocab)
    device = ref.device
    rows = rows.to(device)
    result = torch.zeros((2, rows.numel()), dtype=torch.float64, device=device)
    step = max(1, chunk_elements(device) // max(vocab, 1))
    for start in range(0, rows.numel(), step):
        chunk = rows[start : start + step]
        log_p = ref.index_select(0, chunk).to(torch.float64)
        log_q = var.index_select(0, chunk.to(var.device)).to(device=device, dtype=torch.float64)
        if temperature != 1:
            log_p /= temperature
            log_q /= temperature
        result[1, start : start + step] = (log_p.argmax(dim=-1) == log_q.argmax(dim=-1)).to(torch.float64)
        log_p = torch.log_softmax(log_p, dim=-1)
        log_q = torch.log_softmax(log_q, dim=-1)
        difference = log_q.neg_().add_(log_p)  # log p - log q, in log_q's storage
        result[0, start : start + step] = log_p.exp_().mul_(difference).sum(dim=-1).clamp_min_(0.0)
    return result


def distribution_sums(
    reference_logits: torch.Tensor, variant_logits: torch.Tensor, rows: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """[sum of KL(p_ref || p_var), max KL, positions whose argmax agrees] over the logits rows `rows` (see
    distribution_rows), in float64, on the device (no host sync)."""
    import torch

    per_row = distribution_rows(reference_logits, variant_logits, rows, temperature=temperature)
    zero = per_row.new_zeros(())
    kl_max = per_row[0].max() if per_row.shape[1] else zero
    return torch.stack([per_row[0].sum(), kl_max, per_row[1].sum()])


def distribution_from_sums(values: Sequence[float], rows: int) -> DistributionStats:
    """DistributionStats over `rows` positions from a host copy of distribution_sums."""
    if rows == 0:
        return DistributionStats(None, None, None)
    total, peak, agreeing = values
    return DistributionStats(total / rows, peak, agreeing / rows)


def distribution_stats(
    reference_logits: torch.Tensor,
    variant_logits: torch.Tensor,
    valid: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> DistributionStats:
    """KL(p_ref || p_var) mean and max, and the share of positions whose argmax agrees, in float64, over the
    positions t of (batch, seq) logits where `valid` (batch, seq - 1) says token t + 1 counts (two host syncs)."""
    from pytest_precision.numbers.metrics import to_host

    positions = valid.shape[1]
    valid_index = valid.reshape(-1).nonzero().reshape(-1)
    rows = valid_index + valid_index // max(positions, 1)
    sums = distribution_sums(reference_logits, variant_logits, rows, temperature=temperature)
    [values] = to_host([sums])
    return distribution_from_sums(values, int(rows.numel()))
