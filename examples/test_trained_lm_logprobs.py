"""Chosen-token log-probabilities of a (tiny) trained LM: what RL post-training's importance ratio sees.

The bundled model (tests/data/tiny-trained-lm) was trained on public-domain text, so its next-token
distributions are peaked like a real model's; the inputs are held-out text it never saw.

    pytest examples/test_trained_lm_logprobs.py --precision-tables
"""

from __future__ import annotations

import pytest

from conftest import load_trained_lm, trained_lm_text_batch

VARIANTS = ["bf16", "fp16", "bf16_fp32_head", "fp16_fp32_head"]


@pytest.fixture(scope="module")
def text_batch() -> dict[str, object]:
    return trained_lm_text_batch(batch=2, length=128)


def test_trained_lm_logprobs(precision, assert_precision_within, text_batch):
    report = precision.run(load_trained_lm, text_batch, variants=VARIANTS)
    # Gate the log-prob rows on their log-ratio statistics as well as on rms_rel everywhere.
    assert_precision_within(report, metrics=["rms_rel", "delta_rms", "kl_mean"])
    # The fp32 LM head is the usual cure for trainer/sampler mismatch: it must lower the log-prob error.
    for dtype in ("bf16", "fp16"):
        head = report.get(f"{dtype}_fp32_head", "logprob", "logprob").delta_rms
        assert head < report.get(dtype, "logprob", "logprob").delta_rms
