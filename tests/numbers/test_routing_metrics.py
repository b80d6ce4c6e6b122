"""The routing metrics of numbers/routing.py against an independent float64 NumPy computation on known inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pytest_precision.numbers.metrics import to_host
from pytest_precision.numbers.routing import routing_from_sums, routing_sums, set_disagreement


def routing_tensor(indices: np.ndarray, weights: np.ndarray, margins: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.concatenate([indices, weights, margins[:, None]], axis=1), dtype=torch.float64)


def by_hand(ref_idx, ref_w, margins, var_idx, var_w, experts):
    """Every metric, one token at a time, in plain NumPy float64."""
    n, k = ref_idx.shape
    same, first, changed, flips, x, y = [], [], [], [], [], []
    for t in range(n):
        agree = set(ref_idx[t]) == set(var_idx[t])
        same.append(agree)
        first.append(ref_idx[t][np.argmax(ref_w[t])] != var_idx[t][np.argmax(var_w[t])])
        changed.append(len(set(ref_idx[t]) - set(var_idx[t])))
        if agree:
            for e in ref_idx[t]:
                x.append(ref_w[t][list(ref_idx[t]).index(e)])
                y.append(var_w[t][list(var_idx[t]).index(e)])
        else:
            flips.append(margins[t])
    ref_load = np.bincount(ref_idx.reshape(-1), minlength=experts) / (n * k)
    var_load = np.bincount(var_idx.reshape(-1), minlength=experts) / (n * k)
    x, y = np.asarray(x), np.asarray(y)
    return {
        "expert_agreement": np.mean(same),
        "top1_changed": np.mean(first),
        "experts_changed": np.mean(changed),
        "load_shift": 0.5 * np.abs(ref_load - var_load).sum(),
        "flip_margin_median": np.median(flips) if flips else None,
        "flip_margin_max": np.max(flips) if flips else None,
        "margin_median": np.median(margins),
        "rms_rel": np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x**2)) if len(x) else None,
        "max_abs": np.max(np.abs(y - x)) if len(x) else None,
        "count": len(x),
    }


def measured(ref: torch.Tensor, var: torch.Tensor, experts: int | None):
    stats, weights, flips = to_host(list(routing_sums(ref, var, experts)))
    error, routing = routing_from_sums(stats, weights)
    return error, routing, [f for f in flips if not math.isnan(f)]


@pytest.mark.parametrize("tokens, experts, k, seed", [(1, 4, 1, 0), (37, 8, 2, 1), (500, 16, 4, 2), (64, 6, 3, 3)])
@pytest.mark.parametrize("experts_known", [True, False])
def test_routing_metrics_match_numpy(tokens, experts, k, seed, experts_known):
    rng = np.random.default_rng(seed)
    ref_idx = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
    # About half the tokens keep the reference's set (in another order), the others swap one or more experts.
    var_idx = ref_idx.copy()
    for t in range(tokens):
        if rng.random() < 0.5:
            var_idx[t] = rng.permutation(var_idx[t])
        else:
            var_idx[t] = rng.permutation(experts)[:k]
    ref_w = rng.dirichlet(np.ones(k), size=tokens)
    # The variant's weight of expert e: the reference's weight of e (where it chose e) plus noise.
    var_w = np.empty_like(ref_w)
    for t in range(tokens):
        for j, e in enumerate(var_idx[t]):
            where = np.flatnonzero(ref_idx[t] == e)
            base = ref_w[t][where[0]] if where.size else rng.random() / k
            var_w[t, j] = base * (1 + 0.01 * rng.standard_normal())
    margins = rng.exponential(0.3, size=tokens)
    expected = by_hand(ref_idx, ref_w, margins, var_idx, var_w, experts)
    error, routing, flips = measured(
        routing_tensor(ref_idx, ref_w, margins),
        routing_tensor(var_idx, var_w, margins),
        experts if experts_known else None,
    )
    for metric in (
        "expert_agreement",
        "top1_changed",
        "experts_changed",
        "flip_margin_median",
        "flip_margin_max",
        "margin_median",
    ):
        value = getattr(routing, metric)
        assert (value is None) == (expected[metric] is None), metric
        if value is not None:
            assert value == pytest.approx(expected[metric], rel=1e-12, abs=1e-15), metric
    if experts_known or ref_idx.max() == var_idx.max() == experts - 1:
        assert routing.load_shift == pytest.approx(expected["load_shift"], rel=1e-12, abs=1e-15)
    assert error.count == expected["count"]
    if expected["count"]:
        assert error.rms_rel == pytest.approx(expected["rms_rel"], rel=1e-9)
        assert error.max_abs == pytest.approx(expected["max_abs"], rel=1e-9)
    assert sorted(flips) == pytest.approx(
        sorted(m for m, r, v in zip(margins, ref_idx, var_idx, strict=True) if set(r) != set(v))
    )


def test_a_worked_example():
    # Token 0: same set {1, 2} in another order, weights swapped with it; token 1: expert 3 replaced by 0 (margin
    # 0.01), first choice kept; token 2: both experts changed (margin 0.5), first choice changed.
    ref = routing_tensor(
        np.array([[1, 2], [2, 3], [0, 1]]), np.array([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]]), np.array([0.2, 0.01, 0.5])
    )
    var = routing_tensor(
        np.array([[2, 1], [2, 0], [3, 2]]), np.array([[0.25, 0.75], [0.6, 0.4], [0.8, 0.2]]), np.array([9.0, 9.0, 9.0])
    )
    error, routing, flips = measured(ref, var, 4)
    assert routing.expert_agreement == pytest.approx(1 / 3)
    assert routing.top1_changed == pytest.approx(1 / 3)
    assert routing.experts_changed == pytest.approx((0 + 1 + 2) / 3)
    # Loads: reference {0:1, 1:2, 2:2, 3:1}, variant {0:1, 1:1, 2:3, 3:1} over 6 assignments: TV = 0.5 * 2/6.
    assert routing.load_shift == pytest.approx(1 / 6)
    assert routing.flip_margin_median == pytest.approx(0.255)
    assert routing.flip_margin_max == pytest.approx(0.5)
    assert routing.margin_median == pytest.approx(0.2)  # the reference's margins only
    assert sorted(flips) == pytest.approx([0.01, 0.5])
    # Weights compared by expert on token 0 only: expert 1 0.7 -> 0.75, expert 2 0.3 -> 0.25.
    assert error.count == 2
    assert error.max_abs == pytest.approx(0.05)
    assert error.rms_rel == pytest.approx(0.05 / math.sqrt((0.49 + 0.09) / 2))


def test_no_flips_and_no_tokens():
    ref = routing_tensor(np.array([[0, 1]]), np.array([[0.5, 0.5]]), np.array([0.3]))
    error, routing, flips = measured(ref, ref.clone(), 2)
    assert routing.expert_agreement == 1 and routing.experts_changed == 0 and routing.load_shift == 0
    assert routing.flip_margin_median is None and routing.flip_margin_max is None and flips == []
    assert error.rms_abs == 0
    empty = ref[:0]
    error, routing, _ = measured(empty, empty.clone(), 2)
    assert routing.expert_agreement is None and routing.load_shift is None and error.count == 0


def test_unknown_margins_leave_margin_metrics_undefined():
    ref = routing_tensor(np.array([[0, 1], [1, 2]]), np.array([[0.5, 0.5]] * 2), np.array([math.nan, math.nan]))
    var = routing_tensor(np.array([[0, 2], [1, 2]]), np.array([[0.5, 0.5]] * 2), np.array([math.nan, math.nan]))
    _, routing, flips = measured(ref, var, 3)
    assert routing.expert_agreement == 0.5
    assert routing.flip_margin_median is None and routing.flip_margin_max is None and routing.margin_median is None
    assert flips == []


def test_a_nan_weight_is_counted_not_compared():
    ref = routing_tensor(np.array([[0, 1], [1, 2]]), np.array([[0.6, 0.4]] * 2), np.array([0.1, 0.2]))
    var = routing_tensor(np.array([[0, 1], [1, 2]]), np.array([[math.nan, 0.4], [0.6, 0.4]]), np.array([0.0, 0.0]))
    error, routing, _ = measured(ref, var, 3)
    assert routing.expert_agreement == 1
    assert error.nonfinite == 1 and error.count == 3
    # On a token whose experts changed too: counted, though its weights are not compared.
    flipped = routing_tensor(np.array([[0, 2], [1, 2]]), np.array([[math.inf, 0.4], [0.6, 0.4]]), np.zeros(2))
    error, routing, _ = measured(ref, flipped, 3)
    assert routing.expert_agreement == 0.5 and error.nonfinite == 1 and error.count == 2


def test_set_disagreement_counts_only_the_given_positions():
    a = routing_tensor(np.array([[0, 1], [1, 2], [2, 3]]), np.ones((3, 2)), np.zeros(3)).reshape(1, 3, 5)
    b = routing_tensor(np.array([[1, 0], [1, 3], [2, 3]]), np.ones((3, 2)), np.zeros(3)).reshape(1, 3, 5)
    assert set_disagreement(a, b, None) == pytest.approx(1 / 3)
    assert set_disagreement(a, b, torch.tensor([0, 2])) == 0
    assert set_disagreement(a, b, torch.tensor([1])) == 1
