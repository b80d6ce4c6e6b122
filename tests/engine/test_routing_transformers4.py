"""Routing rows on transformers 4.x, whose MoE blocks take top-k from an nn.Linear gate's logits themselves (the
suite's oldest run, transformers 4.56; skipped on transformers >= 5, where tests/engine/test_routing.py runs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib.metadata import version

import numpy as np
import pytest
import torch
from torch import nn

from conftest import random_tokens, tiny_moe
from pytest_precision import ConfigurationError, Variant, compare

pytestmark = pytest.mark.skipif(
    int(version("transformers").split(".")[0]) >= 5, reason="transformers 4.x MoE blocks (the oldest supported)"
)

#: The families whose 4.x block has an nn.Linear gate, with whether tiny_moe's block renormalises its top-k weights.
GATED = {"qwen3_moe": True, "mixtral": True, "olmoe": False, "qwen2_moe": False}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch() -> dict[str, torch.Tensor]:
    ids = random_tokens(batch=2, length=48, seed=3)
    return {"input_ids": ids, "labels": ids.clone()}


def gate_recorder(store: dict[str, np.ndarray]) -> Callable[[nn.Module], nn.Module]:
    def prepare(model: nn.Module) -> nn.Module:
        for name, module in model.named_modules():
            if name.endswith((".mlp.gate", ".block_sparse_moe.gate")):  # Mixtral 4.x: block_sparse_moe
                module.register_forward_hook(
                    lambda _m, _a, out, n=name: store.__setitem__(n, out.detach().double().numpy().copy())
                )
        return model

    return prepare


@pytest.mark.parametrize("family", sorted(GATED))
def test_routing_rows_match_top_k_of_the_gates_logits(family: str) -> None:
    reference: dict[str, np.ndarray] = {}
    variant: dict[str, np.ndarray] = {}
    report = compare(
        tiny_moe(family, seed=3),
        batch(),
        [Variant("bf16", dtype="bfloat16", prepare=gate_recorder(variant))],
        reference=Variant("fp32", prepare=gate_recorder(reference)),
        backward=False,
    )
    rows = report.records("bf16", "routing")
    assert [r.name for r in rows] == list(reference) and len(rows) == 2
    for record in rows:
        ref_idx = np.argsort(-reference[record.name], axis=-1, kind="stable")[:, :2]
        var_idx = np.argsort(-variant[record.name], axis=-1, kind="stable")[:, :2]
        ordered = np.sort(variant[record.name], axis=-1)
        tied = ordered[:, -2] == ordered[:, -3]  # a bf16 tie at the k-th place: top-k's own tie-break stands
        same = np.array([set(a) == set(b) for a, b in zip(ref_idx, var_idx, strict=True)])
        assert record.shape == (96, 2)
        assert abs(record.expert_agreement - same.mean()) <= tied.mean() + 1e-12
        logits = reference[record.name]
        top = np.sort(logits, axis=-1)
        assert record.margin_median == pytest.approx(np.median(top[:, -2] - top[:, -3]), rel=1e-5)


@pytest.mark.parametrize("family", sorted(f for f, renormalises in GATED.items() if renormalises))
def test_replaying_a_variants_own_routing_changes_nothing_but_rounding(family: str) -> None:
    """Masking every other expert's logit to -inf gives a renormalising block the same experts and the same weights up
    to float32 rounding (a softmax over the k experts, not a softmax over all renormalised), which bf16 rounding of
    the weights can carry a little further."""
    report = compare(
        tiny_moe(family, seed=1), batch(), ["bf16", Variant("bf16_again", dtype="bfloat16", replay_routing="bf16")]
    )
    own, again = report.records("bf16"), report.records("bf16_again")
    assert [(r.name, r.kind) for r in own] == [(r.name, r.kind) for r in again]
    for a, b in zip(own, again, strict=True):
        if a.kind == "routing":  # the same experts; a first choice may differ where two bf16 weights now tie
            assert (a.expert_agreement, a.load_shift) == (b.expert_agreement, b.load_shift)
            assert b.top1_changed == pytest.approx(a.top1_changed, abs=2 / a.shape[0])
        # The loss's own error is ~1e-5, which rounding moves by its size; an expert's gradient sums a few tokens.
        if a.kind != "loss":
            rel = 0.02 if a.kind in ("fw", "logprob", "routing") else 0.1
            assert b.rms_rel == pytest.approx(a.rms_rel, rel=rel, abs=1e-9), (a.name, a.kind)
    fp32 = compare(tiny_moe(family, seed=1), batch(), ["fp32_replay"])
    # fp32 replaying the reference: its experts, and its weights up to float32 rounding.
    assert all(r.expert_agreement == 1 for r in fp32.records("fp32_replay", "routing"))
    assert max(r.rms_rel or 0.0 for r in fp32.records("fp32_replay")) < 1e-5


@pytest.mark.parametrize("family", sorted(f for f, renormalises in GATED.items() if not renormalises))
def test_replay_is_refused_where_the_block_does_not_renormalise(family: str) -> None:
    with pytest.raises(ConfigurationError, match=r"without renormalising \(norm_topk_prob=False\).*transformers >= 5"):
        compare(tiny_moe(family, seed=1), batch(), ["bf16_replay"])


def test_a_deepseek_v3_router_of_transformers_4_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigurationError, match=r"does not return \(router_logits, top_k_weights, top_k_index\)"):
        compare(tiny_moe("deepseek_v3", seed=0), batch(), ["bf16"])
    report = compare(tiny_moe("deepseek_v3", seed=0), batch(), ["bf16"], routers=False)
    assert report.records("bf16", "routing") == []
