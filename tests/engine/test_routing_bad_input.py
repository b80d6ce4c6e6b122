"""A router of the user's own that reads wrong things (engine/routers.py), and routing_mismatch asked wrong things:
each refused with a ConfigurationError naming the router (or the run) and the problem, never blamed on the
model's inputs; the margins of a well-read router agree with NumPy's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from pytest_precision import ConfigurationError, Routers, Variant, compare

EXPERTS, K = 8, 2


class UserMoE(nn.Module):
    """A user's own MoE of `layers` routers (nn.Linear, logits only), top-k taken by the block; `skip` leaves
    the last layer (and its router) out of the forward."""

    def __init__(self, layers: int = 1, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.routers = nn.ModuleList(nn.Linear(width, EXPERTS, bias=False) for _ in range(layers))
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(EXPERTS))
        self.head = nn.Linear(width, 1)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)  # (B, T, width)
        for router in self.routers[: len(self.routers) - 1] if self.skip else self.routers:
            weights, indices = torch.softmax(router(hidden).float(), -1).topk(K, dim=-1)  # (B, T, K)
            every = torch.stack([expert(hidden) for expert in self.experts], -2)  # (B, T, E, width)
            picked = every.gather(-2, indices[..., None].expand(*indices.shape, hidden.shape[-1]))
            hidden = hidden + (weights[..., None].to(hidden.dtype) * picked).sum(-2)
        return self.head(hidden).sum()


def read(module: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weights, indices = torch.softmax(logits.float(), -1).topk(K, dim=-1)
    return indices, weights, logits


def run(
    routers: Routers, *, tokens: int = 10, variants: list[Any] | None = None, model: nn.Module | None = None
) -> Any:
    torch.manual_seed(0)
    x = torch.randn(2, tokens // 2, 4)
    model = UserMoE() if model is None else model
    return compare(model, (x,), variants or ["bf16"], loss_fn=lambda out, _: out, routers=routers)


@pytest.mark.parametrize("experts", [0, -1, -8])
def test_an_expert_count_below_one_is_refused(experts: int) -> None:
    with pytest.raises(
        ConfigurationError, match=r"^Routers\(experts=\.\.\.\) must be the number of experts, at least 1 "
    ):
        Routers("routers\\.0", read, experts=experts)


def with_indices(change: Callable[[torch.Tensor], torch.Tensor], scores: bool = True) -> Callable[..., Any]:
    def changed(module: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        indices, weights, logits = read(module, logits)
        return (change(indices), weights, logits) if scores else (change(indices), weights)

    return changed


def first_token(value: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(indices: torch.Tensor) -> torch.Tensor:
        indices = indices.clone()
        indices[0, 0, 0] = value
        return indices

    return change


@pytest.mark.parametrize(
    "routers, message",
    [
        # Fewer experts than the router has: its scores say 8, and without scores its indices do.
        (Routers("routers\\.0", read, experts=4), r"its scores have shape \(2, 5, 8\), expected \(10, 4\).*experts=4"),
        (
            Routers("routers\\.0", with_indices(lambda i: i, scores=False), experts=4),
            r"token \d+ of 10 names expert\(s\) \[\d+, \d+\]; an expert index is 0 to 3 \(4 experts",
        ),
        # An index out of range or negative, with and without an expert count.
        (
            Routers("routers\\.0", with_indices(first_token(8))),
            r"token 0 of 10 names expert\(s\) \[8, \d+\]; .* 0 to 7",
        ),
        (
            Routers("routers\\.0", with_indices(first_token(-1))),
            r"token 0 of 10 names expert\(s\) \[-1, \d+\]; .* 0 to 7",
        ),
        (
            Routers("routers\\.0", with_indices(first_token(-1), scores=False)),
            r"token 0 of 10 names expert\(s\) \[-1, \d+\]; an expert index is >= 0 \(unknown experts",
        ),
        (
            Routers("routers\\.0", with_indices(first_token(99), scores=False), experts=8),
            r"token 0 of 10 names expert\(s\) \[99, \d+\]; an expert index is 0 to 7",
        ),
        (
            Routers("routers\\.0", with_indices(lambda i: i[..., :1].expand(i.shape))),
            r"token 0 of 10 names an expert twice \(\[(\d+), \1\]\)",
        ),
        (Routers("routers\\.0", with_indices(lambda i: i.float())), r"its indices must be integers, got torch.float32"),
        (Routers("routers\\.0", with_indices(lambda i: i[..., :0])), r"indices must be \(tokens, k\) with k >= 1"),
        # Scores of the wrong shape: transposed, of other tokens.
        (
            Routers("routers\\.0", lambda m, o: (*read(m, o)[:2], read(m, o)[2].reshape(10, 8).T)),
            r"its scores have shape \(8, 10\), expected \(10, experts\): one row per token",
        ),
        (
            Routers("routers\\.0", lambda m, o: (*read(m, o)[:2], read(m, o)[2][:1])),
            r"its scores have shape \(1, 5, 8\), expected \(10, experts\)",
        ),
    ],
)
def test_a_read_giving_wrong_indices_or_scores_is_refused_naming_the_router(routers: Routers, message: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^router 'routers\.0'") as refused:
        run(routers)
    assert len(str(refused.value).splitlines()) == 1
    assert "vocabulary" not in str(refused.value)
    assert refused.match(message)


def test_scores_transposed_on_a_square_call_are_refused_as_disagreeing_with_the_indices() -> None:
    """8 tokens and 8 experts: the transposed scores have the right shape, but the chosen experts are not their
    top-k (before, a negative margin_median was reported)."""
    transposed = Routers("routers\\.0", lambda m, o: (*read(m, o)[:2], read(m, o)[2].reshape(8, 8).T))
    with pytest.raises(ConfigurationError, match=r"^router 'routers\.0': its scores disagree with its indices: token "):
        run(transposed, tokens=8)


def test_a_replay_that_raises_is_blamed_on_the_router() -> None:
    def replay(module: nn.Module, output: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return output[indices.shape[0] + 100]  # IndexError: a bug in the user's replay

    with pytest.raises(
        ConfigurationError, match=r"^router 'routers\.0': Routers\.replay raised IndexError: "
    ) as refused:
        run(Routers("routers\\.0", read, replay=replay), variants=["bf16_replay"])
    assert "vocabulary" not in str(refused.value)


def numpy_margins(logits: np.ndarray) -> np.ndarray:
    """k-th largest logit minus the largest of the others, per token (float64)."""
    ordered = np.sort(logits, axis=-1)[:, ::-1]
    return ordered[:, K - 1] - ordered[:, K]


def test_a_user_routers_margins_are_numpys() -> None:
    torch.manual_seed(0)
    model = UserMoE()
    x = torch.randn(2, 16, 4)
    kept: list[np.ndarray] = []

    def keeping(module: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kept.append(logits.detach().to(torch.float64).reshape(-1, EXPERTS).numpy().copy())
        return read(module, logits)

    report = compare(model, (x,), ["bf16"], loss_fn=lambda out, _: out, routers=Routers("routers\\.0", keeping))
    (row,) = report.records("bf16", "routing")
    reference_logits = kept[0]  # the reference run reads first
    assert row.margin_median == pytest.approx(float(np.median(numpy_margins(reference_logits))), rel=1e-12)
    assert row.margin_median > 0


def test_routing_mismatch_refuses_a_run_that_is_not_named() -> None:
    report = run(Routers("routers\\.0", read), variants=["bf16", "fp16"])
    assert set(report.routing_mismatch("bf16", "fp16")) == {"routers.0"}
    for trainer, sampler in ((None, None), (None, "bf16"), (3, None), ("bf16", 3)):
        with pytest.raises(ConfigurationError, match=r"^routing_mismatch: ") as refused:
            report.routing_mismatch(trainer, sampler)  # type: ignore[arg-type]
        assert "variants with routing: bf16, fp16" in str(refused.value)


def test_routing_mismatch_names_a_router_one_run_never_called() -> None:
    def skipping(model: nn.Module) -> nn.Module:
        model.skip = True
        return model

    variants = ["bf16", Variant("bf16_short", dtype="bfloat16", prepare=skipping)]
    report = run(Routers(r"routers\.\d", read), variants=variants, model=UserMoE(layers=2))
    assert set(report.routing_mismatch("bf16")) == {"routers.0", "routers.1"}
    for trainer, sampler, missing, where in (
        ("bf16_short", None, "routers.1", "bf16_short"),
        ("bf16", "bf16_short", "routers.1", "bf16_short"),
        ("bf16_short", "bf16", "routers.1", "bf16_short"),
    ):
        with pytest.raises(
            ConfigurationError, match=rf"^routing_mismatch: router {missing!r} routed no token in run {where!r}"
        ):
            report.routing_mismatch(trainer, sampler)
