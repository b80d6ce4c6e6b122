"""Routers and routing numbers (engine/routers.py, numbers/routing.py) against NumPy (issue 34's mutants): the
margins in float64, a transformers 4.x gate's choice and replay, a user's scores of another dtype named, the token
count under a low-precision default dtype, and routing tensors or an index on another device than the reference's."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.routers import Router, Routers, choice_margins, find_routers
from pytest_precision.numbers.routing import routing_from_sums, routing_sums, set_disagreement

EXPERTS, K = 6, 2
#: Skipped without --precision-gpu, as every test that needs CUDA.
ON_CUDA = pytest.mark.precision_gpu
#: (reference's device, variant's device): the same device, and each way across two.
DEVICE_PAIRS = [("cpu", "cpu"), pytest.param("cpu", "cuda", marks=ON_CUDA), pytest.param("cuda", "cpu", marks=ON_CUDA)]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def numpy_margins(scores: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Per token, the lowest chosen score minus the highest other one, in float64."""
    scores = scores.astype(np.float64)
    chosen = np.take_along_axis(scores, indices, axis=1).min(axis=1)
    others = scores.copy()
    np.put_along_axis(others, indices, -np.inf, axis=1)
    return np.asarray(chosen - others.max(axis=1))


def test_margins_of_float32_scores_are_taken_in_float64() -> None:
    """1 - 1e-8 rounds to 1 in float32: the margin of a near-certain choice must keep the difference."""
    scores = torch.tensor([[1.0, 1e-8, -2.0], [0.25, 0.5, 3e-9]], dtype=torch.float32)
    indices = torch.tensor([[0], [1]])
    margins = choice_margins(scores, indices)
    assert margins.dtype == torch.float64
    expected = numpy_margins(scores.numpy(), indices.numpy())
    assert expected[0] != 1.0
    np.testing.assert_array_equal(margins.numpy(), expected)


def gated_model(block_class: str, renormalises: bool | None) -> nn.Module:
    """A model holding a transformers 4.x-style MoE block (by its class name): an nn.Linear `gate`, `top_k` and
    `num_experts`, and `norm_topk_prob` unless None (Mixtral's block has none: it always renormalises)."""
    torch.manual_seed(0)
    block = type(block_class, (nn.Module,), {})()
    block.gate = nn.Linear(4, EXPERTS, bias=False)
    block.top_k, block.num_experts = K, EXPERTS
    if renormalises is not None:
        block.norm_topk_prob = renormalises
    model = nn.Module()
    model.mlp = block
    return model


def numpy_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.asarray(shifted / shifted.sum(axis=-1, keepdims=True))


@pytest.mark.parametrize(
    ("block_class", "renormalises"),
    [("Qwen3MoeSparseMoeBlock", True), ("OlmoeSparseMoeBlock", False), ("MixtralSparseMoeBlock", None)],
)
def test_a_linear_gates_choice_is_top_k_of_its_softmax_by_the_blocks_rule(
    block_class: str, renormalises: bool | None
) -> None:
    routers = find_routers(gated_model(block_class, renormalises), None)
    assert list(routers) == ["mlp.gate"]
    logits = torch.randn(2, 5, EXPERTS, generator=torch.Generator().manual_seed(1))  # (rows, positions, experts)
    choice = routers["mlp.gate"].read(logits.reshape(-1, EXPERTS))
    flat = logits.reshape(-1, EXPERTS).double().numpy()
    probabilities = numpy_softmax(flat)
    order = np.argsort(-probabilities, axis=1)[:, :K]
    np.testing.assert_array_equal(choice.indices.numpy(), order)
    weights = np.take_along_axis(probabilities, order, axis=1)
    if renormalises is not False:
        weights = weights / weights.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(choice.weights.double().numpy(), weights, rtol=1e-6)
    np.testing.assert_allclose(choice.margins.numpy(), numpy_margins(flat, order), rtol=1e-12)


def test_a_linear_gate_replays_by_masking_the_other_experts_logits() -> None:
    """6 tokens of k=2 experts: the block's softmax over the replayed logits gives R3's renormalised weights."""
    router = find_routers(gated_model("Qwen3MoeSparseMoeBlock", True), None)["mlp.gate"]
    logits = torch.randn(2, 3, EXPERTS, generator=torch.Generator().manual_seed(2))
    indices = torch.tensor([[0, 5], [1, 2], [3, 4], [2, 0], [5, 1], [4, 3]])
    replayed = router.replayed(logits, indices)
    assert replayed.shape == logits.shape
    expected = np.full((6, EXPERTS), -np.inf)
    flat = logits.reshape(6, EXPERTS).numpy()
    np.put_along_axis(expected, indices.numpy(), np.take_along_axis(flat, indices.numpy(), axis=1), axis=1)
    np.testing.assert_array_equal(replayed.reshape(6, EXPERTS).numpy(), expected)
    chosen = numpy_softmax(np.take_along_axis(flat.astype(np.float64), indices.numpy(), axis=1))
    weights = torch.softmax(replayed.reshape(6, EXPERTS).double(), dim=-1).gather(1, indices)
    np.testing.assert_allclose(weights.numpy(), chosen, rtol=1e-12)


def test_a_users_scores_of_an_integer_dtype_are_refused_naming_it() -> None:
    def read(module: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights, indices = torch.softmax(logits, -1).topk(K, dim=-1)
        return indices, weights, logits.to(torch.int64)

    gate = nn.Linear(4, EXPERTS)
    router = Router("gate", gate, Routers("gate", read))
    message = r"^router 'gate': its scores must be a float tensor \(tokens, experts\), got torch\.int64$"
    with pytest.raises(ConfigurationError, match=message):
        router.read(torch.randn(3, EXPERTS))


def routing_tensor(indices: np.ndarray, weights: np.ndarray, margins: np.ndarray) -> torch.Tensor:
    """A routing tensor (tokens, 2k + 1) of packed choices."""
    return torch.from_numpy(np.concatenate([indices.astype(np.float64), weights, margins[:, None]], axis=1))


def choices(tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    indices = np.stack([rng.permutation(EXPERTS)[:K] for _ in range(tokens)])
    weights = rng.dirichlet(np.ones(K), size=tokens)
    return indices, weights


def replaced(indices: np.ndarray, tokens: list[int]) -> np.ndarray:
    """`indices` with the first expert of each of `tokens` replaced by the lowest expert its set lacks."""
    other: np.ndarray = indices.copy()
    for token in tokens:
        other[token, 0] = min(set(range(EXPERTS)) - set(indices[token].tolist()))
    return other


def test_the_token_count_stays_exact_under_a_bfloat16_default_dtype() -> None:
    """A user's script may set torch's default dtype to bfloat16, which holds 257 as 256."""
    tokens = 257
    indices, weights = choices(tokens, seed=0)
    flipped = replaced(indices, list(range(0, tokens, 3)))
    reference = routing_tensor(indices, weights, np.linspace(0.0, 1.0, tokens))
    variant = routing_tensor(flipped, weights, np.zeros(tokens))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        stats, weight_sums, _ = routing_sums(reference, variant, EXPERTS)
    finally:
        torch.set_default_dtype(default)
    same = (np.sort(indices, axis=1) == np.sort(flipped, axis=1)).all(axis=1)
    assert stats.dtype == torch.float64 and stats[0].item() == tokens
    _, routing = routing_from_sums(stats.tolist(), weight_sums.tolist())
    assert same.sum() == tokens - 86 and routing.expert_agreement == same.sum() / tokens


@pytest.mark.parametrize(("reference_device", "variant_device"), DEVICE_PAIRS)
def test_routing_sums_take_a_variant_on_another_device(reference_device: str, variant_device: str) -> None:
    tokens = 12
    indices, weights = choices(tokens, seed=1)
    other = replaced(indices, [4, 5])
    other[:4] = indices[:4, ::-1]  # the same sets, another order
    reference = routing_tensor(indices, weights, np.full(tokens, 0.5)).to(reference_device)
    variant = routing_tensor(other, weights, np.zeros(tokens)).to(variant_device)
    stats, _, flip_margins = routing_sums(reference, variant, EXPERTS)
    assert stats.device == reference.device
    tokens_, same, _, changed, *_ = stats.tolist()
    assert (tokens_, same, changed) == (tokens, tokens - 2, 2)
    np.testing.assert_array_equal(np.isnan(flip_margins.cpu().numpy()), ~np.isin(np.arange(tokens), [4, 5]))


@pytest.mark.parametrize(("routing_device", "index_device"), DEVICE_PAIRS)
def test_set_disagreement_takes_an_index_on_another_device(routing_device: str, index_device: str) -> None:
    indices, weights = choices(8, seed=2)
    other = replaced(indices, [1, 6])
    a = routing_tensor(indices, weights, np.zeros(8)).reshape(2, 4, -1).to(routing_device)
    b = routing_tensor(other, weights, np.zeros(8)).reshape(2, 4, -1)
    index = torch.tensor([0, 1, 2, 6], device=index_device)
    assert set_disagreement(a, b, index) == 0.5  # tokens 1 and 6 of the four
    assert set_disagreement(a, b, None) == 0.25
