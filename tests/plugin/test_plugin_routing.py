"""Routing rows under pytest: written to baselines, gated, and a flipped router named first."""

from __future__ import annotations

import json

from plugin_testing import baseline_file, failure, output, project, run

from conftest import TRAINED_MOE_DIR, requires_transformers_routers

pytestmark = requires_transformers_routers

MOE_TESTS = f"""
import os
import types

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from pytest_precision import Variant


def load(dtype=None, device="cpu"):
    return AutoModelForCausalLM.from_pretrained({str(TRAINED_MOE_DIR)!r}, dtype=dtype or torch.float32).eval()


def biased(model):
    # A planted bug: expert 5's logit in layer 2's router raised by 0.5 (e.g. a wrong bias load).
    router = model.model.layers[2].mlp.gate

    def forward(self, hidden):
        hidden = hidden.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden, self.weight)
        logits = logits + F.one_hot(torch.tensor(5), self.num_experts).to(logits.dtype) * 0.5
        top, indices = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), indices

    router.forward = types.MethodType(forward, router)
    return model


def test_moe(precision, assert_precision_within):
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    prepare = biased if os.environ.get("PLANT_ROUTER_BIAS") else None
    variants = [Variant("bf16", dtype="bfloat16", prepare=prepare), "bf16_replay"]
    assert_precision_within(precision.run(load, {{"input_ids": ids, "labels": ids}}, variants=variants, backward=False))
"""


def test_routing_rows_are_written_gated_and_a_flipped_router_is_named_first(pytester, monkeypatch):
    project(pytester, monkeypatch, test_moe_gate=MOE_TESTS)
    monkeypatch.delenv("PLANT_ROUTER_BIAS", raising=False)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    document = json.loads(baseline_file(pytester, "test_moe_gate", "test_moe").read_text())
    rows = [r for r in document["variants"]["bf16"]["records"] if r["kind"] == "routing"]
    assert [r["name"] for r in rows] == [f"model.layers.{i}.mlp.gate" for i in range(4)]
    assert all(0.9 < r["expert_agreement"] <= 1 and "load_shift" in r and "margin_median" in r for r in rows)
    replayed = [r for r in document["variants"]["bf16_replay"]["records"] if r["kind"] == "routing"]
    assert all(r["expert_agreement"] == 1 for r in replayed)
    assert document["variants"]["bf16_replay"]["spec"]["replay_routing"] is True
    passed = run(pytester, "--precision-tables")
    passed.assert_outcomes(passed=1)
    assert "routing: tokens whose top-k experts agree with the reference's" in output(passed)
    monkeypatch.setenv("PLANT_ROUTER_BIAS", "1")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_moe")
    assert "first: bf16 model.layers.2.mlp.gate (routing)" in section[0], section[0]
    table = "\n".join(section)
    assert "model.layers.0.mlp.gate" not in table and "model.layers.1.mlp.gate" not in table
