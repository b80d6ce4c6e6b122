"""The vocabulary-sized computations done a few rows at a time: chosen-token log-probabilities and
whole-distribution agreement (KL, top-1), against independent numpy computations, in any chunking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pytest_precision.numbers.metrics as metrics_module
from pytest_precision.numbers.logprobs import chosen_logprobs, distribution_stats


def numpy_distribution(reference: np.ndarray, variant: np.ndarray, valid: np.ndarray, temperature: float):
    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z / temperature
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    p_log = log_softmax(reference[:, :-1][valid].astype(np.float64))
    q_log = log_softmax(variant[:, :-1][valid].astype(np.float64))
    kl = np.maximum((np.exp(p_log) * (p_log - q_log)).sum(axis=-1), 0.0)
    agree = (p_log.argmax(-1) == q_log.argmax(-1)).mean()
    return kl.mean(), kl.max(), agree


@pytest.mark.parametrize("chunk", [None, 40, 97])  # default; fewer elements than a row; 3 rows and a bit
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_distribution_stats_match_numpy_in_any_chunking(monkeypatch, chunk, temperature):
    generator = torch.Generator().manual_seed(3)
    reference = torch.randn(3, 9, 32, generator=generator) * 2
    variant = (reference + 0.05 * torch.randn(reference.shape, generator=generator)).to(torch.bfloat16)
    valid = torch.ones(3, 8, dtype=torch.bool)
    valid[1, :5] = False  # masked positions are left out
    valid[2, -1] = False
    if chunk is not None:
        monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", chunk)
    stats = distribution_stats(reference, variant, valid, temperature=temperature)
    kl_mean, kl_max, agree = numpy_distribution(reference.numpy(), variant.float().numpy(), valid.numpy(), temperature)
    assert kl_mean > 1e-4  # a real difference, not a degenerate zero
    assert stats.kl_mean == pytest.approx(kl_mean, rel=1e-9)
    assert stats.kl_max == pytest.approx(kl_max, rel=1e-9)
    assert stats.top1_agreement == pytest.approx(agree, rel=1e-12)
    assert stats.top1_agreement < 1  # some argmaxes moved


def test_distribution_stats_of_no_counted_position_are_none():
    logits = torch.randn(1, 4, 8)
    stats = distribution_stats(logits, logits, torch.zeros(1, 3, dtype=torch.bool))
    assert (stats.kl_mean, stats.kl_max, stats.top1_agreement) == (None, None, None)


@pytest.mark.parametrize("chunk", [None, 40, 97])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chosen_logprobs_match_numpy_and_one_whole_log_softmax(monkeypatch, chunk, temperature):
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 9, 32, generator=generator) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 32, (3, 8), generator=generator)
    if chunk is not None:
        monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", chunk)
    chosen = chosen_logprobs(logits, targets, temperature=temperature)
    assert chosen.dtype == torch.float32 and chosen.shape == (3, 8)
    # The same values, bit for bit, as one log_softmax over the whole tensor in float32.
    whole = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1).gather(-1, targets[..., None])[..., 0]
    assert torch.equal(chosen, whole)
    z = logits[:, :-1].float().numpy().astype(np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    expected = np.take_along_axis(log_p, targets.numpy()[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(chosen.numpy(), expected, rtol=1e-5, atol=1e-6)


class _LargestTensor(torch.overrides.TorchFunctionMode):
    """The largest number of elements of any new tensor an op returns inside the block (views allocate none)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor) and value._base is None:
                self.largest = max(self.largest, value.numel())
        return result


def test_the_vocabulary_passes_hold_a_chunk_not_a_logits_tensor(monkeypatch):
    # What keeps a compare's peak at most one logits tensor above its own: the KL / top-1 and log-prob passes
    # make no temporary larger than a chunk of rows (no boolean-indexed copy of the counted positions).
    generator = torch.Generator().manual_seed(5)
    reference = torch.randn(4, 65, 96, generator=generator)
    variant = reference + 0.01 * torch.randn(reference.shape, generator=generator)
    valid = torch.rand(4, 64, generator=generator) > 0.3
    targets = torch.randint(0, 96, (4, 64), generator=generator)
    monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", 4 * 96)  # 4 rows of the vocabulary
    with _LargestTensor() as watched:
        distribution_stats(reference, variant, valid)
        chosen_logprobs(reference, targets)
    assert 0 < watched.largest <= 4 * 96
