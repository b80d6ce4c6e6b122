"""Log-probs and metrics (numbers/logprobs.py, numbers/metrics.py) against float64 NumPy, for issue 34's mutants:
the positions a padding mask leaves counted, log-probs computed and returned on the logits' device whatever torch's
default device (and token ids on another device than the logits), and metrics from sums over x - shift."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from numpy_metrics import FLOAT_FIELDS, numpy_metrics

from pytest_precision.numbers.logprobs import IGNORE_INDEX, chosen_logprobs, next_token_targets
from pytest_precision.numbers.metrics import metrics_from_sums

#: Skipped without --precision-gpu, as every test that needs CUDA.
ON_CUDA = pytest.mark.precision_gpu


def numpy_valid(labels: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """valid[b, t]: target t + 1 is not IGNORE_INDEX, and both token t and token t + 1 are attended."""
    batch, length = labels.shape
    valid = np.zeros((batch, length - 1), dtype=bool)
    for b in range(batch):
        for t in range(length - 1):
            valid[b, t] = labels[b, t + 1] != IGNORE_INDEX and mask[b, t] != 0 and mask[b, t + 1] != 0
    return valid


def test_a_padding_mask_leaves_the_positions_whose_both_tokens_are_attended() -> None:
    """Left padding, right padding, and a hole in the middle, with one ignored label."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
    labels = ids.clone()
    labels[2, 4] = IGNORE_INDEX
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 1]])
    targets, valid = next_token_targets(ids, labels, mask)
    expected = numpy_valid(labels.numpy(), mask.numpy())
    assert expected.tolist() == [[False, False, True, True], [True, True, False, False], [False, False, True, False]]
    np.testing.assert_array_equal(valid.numpy(), expected)
    np.testing.assert_array_equal(targets.numpy(), np.maximum(labels.numpy()[:, 1:], 0))


def numpy_chosen_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    """log_softmax(logits[:, :-1])[targets] in float64."""
    values = logits.detach().cpu().double().numpy()[:, :-1]
    top = values.max(axis=-1, keepdims=True)
    log_softmax = values - top - np.log(np.exp(values - top).sum(axis=-1, keepdims=True))
    return np.take_along_axis(log_softmax, targets.cpu().numpy()[..., None], axis=-1)[..., 0]


@pytest.fixture
def default_device() -> Iterator[None]:
    """torch's default device put back as it was, to the attribute: on torch 2.6, set_default_device(None) leaves
    torch._GLOBAL_DEVICE_CONTEXT.device_context = None, and transformers 4.x's from_pretrained reads its .device
    whenever the attribute exists, so every later load in the process would fail."""
    context = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    had_one = context is not None and hasattr(context, "device_context")
    yield
    torch.set_default_device(None)
    if context is not None and not had_one and hasattr(context, "device_context"):
        del context.device_context


@pytest.mark.parametrize("other", ["meta", pytest.param("cuda", marks=ON_CUDA)])
@pytest.mark.usefixtures("default_device")
def test_log_probs_stay_on_the_logits_device_whatever_the_default_device(other: str) -> None:
    """torch.set_default_device(other) (a user's setting) must not move the work or the result off the CPU logits."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator)
    targets = torch.randint(0, 11, (2, 4), generator=generator)
    torch.set_default_device(other)
    chosen = chosen_logprobs(logits, targets)
    torch.set_default_device(None)
    assert chosen.device == logits.device and chosen.shape == (2, 4)
    np.testing.assert_allclose(chosen.double().numpy(), numpy_chosen_logprobs(logits, targets), rtol=1e-5, atol=1e-6)


@ON_CUDA
def test_log_probs_of_logits_on_the_gpu_and_token_ids_on_the_cpu() -> None:
    """A model whose last layer is on the GPU while its batch stayed on the CPU: computed and returned on the GPU."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=generator)
    targets = torch.randint(0, 11, (2, 4), generator=generator)
    chosen = chosen_logprobs(logits.cuda(), targets)
    assert chosen.device.type == "cuda" and chosen.shape == (2, 4)
    expected = numpy_chosen_logprobs(logits, targets)
    np.testing.assert_allclose(chosen.double().cpu().numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shift", [1.0, 0.75, -3.0])
def test_metrics_from_sums_over_x_minus_a_shift_without_the_whole_sum_of_squares(shift: float) -> None:
    """sum x^2 is derived from the shifted sums (sxx_whole not given): every metric as from the definitions."""
    rng = np.random.default_rng(7)
    x = rng.normal(0.8, 1.5, 257)
    y = x + rng.normal(0.01, 0.05, 257)
    d, shifted = y - x, x - shift
    error = metrics_from_sums(
        x.size,
        float(shifted.sum()),
        float(d.sum()),
        float((shifted * shifted).sum()),
        float((d * d).sum()),
        float((shifted * d).sum()),
        float(np.abs(d).max()),
        0,
        shift=shift,
    )
    expected = numpy_metrics(torch.from_numpy(x), torch.from_numpy(y))
    for field in FLOAT_FIELDS:
        assert getattr(error, field) == pytest.approx(expected[field], rel=1e-9, abs=1e-12), field
