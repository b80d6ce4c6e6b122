"""Compiled models: the bundled tiny Llama compiled block by block (torch.compile, regional), held against the
baseline committed under baselines/examples/. Inductor's bf16 fuses each block's elementwise work and keeps the
fused intermediates in fp32; aot_eager runs the same decomposed graph with eager kernels and no fusion. On a CPU
Inductor needs a C++ compiler (without one, the Inductor variant is skipped with the reason).

    pytest examples/test_compiled_gate.py --precision-tables
"""

from __future__ import annotations

import pytest

from conftest import load_tiny_llama, random_tokens


@pytest.fixture
def batch() -> dict[str, object]:
    ids = random_tokens(batch=2, length=64, seed=0)
    return {"input_ids": ids, "labels": ids}


def test_tiny_llama_compiled(precision, assert_precision_within, batch):
    report = precision.run(load_tiny_llama, batch, variants=["bf16", "bf16_compiled", "bf16_compiled_aot_eager"])
    # Each variant against its baseline, and what each compiled (regions, graph breaks, Inductor's numeric
    # settings): a new graph break or another setting fails as "compilation changed".
    assert_precision_within(report)
    assert report.runs["bf16_compiled"].compiled["graph_breaks"] == 0
    # The compiled program is what was measured: Inductor's fused bf16 is not eager bf16.
    assert report.get("bf16_compiled", "lm_head").rms_rel != report.get("bf16", "lm_head").rms_rel
