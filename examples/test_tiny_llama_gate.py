"""The example precision gate: the bundled tiny Llama (tests/data/tiny-llama) in bf16, fp16 and with an fp32
LM head, held against the baselines committed under baselines/examples/.

    pytest examples --precision-tables            # compare, and print the error-propagation tables
    pytest examples --update-baselines            # after an intended change: refresh, review, commit
"""

from __future__ import annotations

import pytest

from conftest import load_tiny_llama, random_tokens


@pytest.fixture
def batch() -> dict[str, object]:
    ids = random_tokens(batch=2, length=64, seed=0)
    return {"input_ids": ids, "labels": ids}


def test_tiny_llama_low_precision(precision, assert_precision_within, batch):
    # The factory loads the checkpoint in each run's dtype, as from_pretrained(path, dtype=...) would.
    report = precision.run(load_tiny_llama, batch, variants=["bf16", "fp16", "bf16_fp32_head", "fp16_fp32_head"])
    # Against the baseline (rms_rel per tensor) and an absolute bound that holds on any hardware.
    assert_precision_within(report, limits={"fw": {"rms_rel": 0.05}})
    # fp16 keeps 3 more mantissa bits than bf16: its error must stay well below bf16's at the output.
    assert report.get("fp16", "lm_head").rms_rel < report.get("bf16", "lm_head").rms_rel / 4


def test_tiny_llama_autocast(precision, assert_precision_within, batch):
    report = precision.run(load_tiny_llama, batch, variants=["bf16_autocast", "fp16_autocast"])
    # Parameter gradients under CPU autocast are reductions of bf16 products over every position, blocked by the
    # CPU's vector ISA: the repository's conftest.py pins the AVX2 paths, so the default tolerance holds.
    assert_precision_within(report)
