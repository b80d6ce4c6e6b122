"""Mixture-of-experts routing on the bundled trained tiny MoE (a byte-level Qwen3-MoE, 4 layers x 8 experts, top-2):
which routers flip experts in bf16, how much of bf16's error the flips cause, and the trainer-vs-sampler gap that
Rollout Routing Replay (R3) closes.

Reference: the fp32 full forward. Every router gets a "routing" row per variant (expert agreement, first choice
changed, experts changed per token, load shift, the reference's margin at the flips, and the error of the routing
weights where the experts agree), gated with the rest. `bf16_replay` runs bf16 with the reference's experts;
`bf16_replaying_decode` is the trainer (bf16, one full forward) with the sampler's (`bf16_decode`) experts.

    pytest examples/test_moe_routing.py --precision-tables -s
"""

from __future__ import annotations

import pytest

from conftest import load_trained_moe, requires_transformers_routers, trained_lm_text_batch
from pytest_precision import Variant

pytestmark = requires_transformers_routers

TRAINER_REPLAYING_SAMPLER = Variant("bf16_replaying_decode", dtype="bfloat16", replay_routing="bf16_decode")


@pytest.fixture(scope="module")
def text_batch() -> dict[str, object]:
    return trained_lm_text_batch(batch=2, length=128)


def test_moe_routing(precision, assert_precision_within, text_batch):
    report = precision.run(
        load_trained_moe,
        text_batch,
        variants=["bf16", "bf16_replay", "bf16_decode", TRAINER_REPLAYING_SAMPLER],
        backward=False,
    )
    print(report.format(full=False))
    assert_precision_within(report, metrics=["rms_rel", "delta_rms", "top1_changed", "load_shift"])
    flips = [r for r in report.records("bf16", "routing") if r.expert_agreement < 1]
    assert flips, "bf16 flips some experts of the trained MoE on this text"
    # Flips are near-ties: the reference's margin where bf16 flipped is far below its median margin.
    for record in flips:
        assert record.flip_margin_median < 0.25 * record.margin_median
    # Replay gives every router the reference's experts, and removes part of bf16's log-prob error.
    assert all(r.expert_agreement == 1 for r in report.records("bf16_replay", "routing"))
    replayed = report.get("bf16_replay", "logprob", "logprob").delta_rms
    assert replayed < report.get("bf16", "logprob", "logprob").delta_rms

    # Trainer against sampler: the tokens they route differently, and the mismatch with and without R3.
    assert max(report.routing_mismatch("bf16", "bf16_decode").values()) > 0
    assert max(report.routing_mismatch("bf16_replaying_decode", "bf16_decode").values()) == 0
    mismatch = report.logprob_mismatch([("bf16", "bf16_decode"), ("bf16_replaying_decode", "bf16_decode")])
    print(mismatch.format(full=False))
    assert_precision_within(mismatch, baseline="trainer_vs_sampler_moe", metrics=["delta_rms", "delta_max_abs"])
    without = mismatch.get("bf16 vs bf16_decode", "logprob", "logprob").delta_rms
    with_replay = mismatch.get("bf16_replaying_decode vs bf16_decode", "logprob", "logprob").delta_rms
    assert with_replay < without
