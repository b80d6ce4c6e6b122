"""compare(token_stats_second_half=True): the token statistics over the tokens llama.cpp's `--kl-divergence`
scores (those predicted from the second half of each row), the same figures as a batch whose labels leave
the first half out, and the row's other metrics over every counted token."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from conftest import load_trained_lm, trained_lm_text_batch
from pytest_precision import compare
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import TOKEN_STAT_METRICS, Record

#: The distribution statistics computed beside TokenStats, which the option restricts too.
DISTRIBUTION = ("kl_mean", "kl_max", "top1_agreement")


def logprob_row(inputs: dict[str, Any], **options: Any) -> Record:
    report = compare(load_trained_lm, inputs, ["bf16"], backward=False, **options)
    return report.records("bf16", "logprob")[0]


def test_second_half_is_the_tokens_after_the_middle_of_each_row() -> None:
    inputs = trained_lm_text_batch(batch=2, length=48)
    half = logprob_row(inputs, token_stats_second_half=True)
    whole = logprob_row(inputs)
    # Tokens 1 .. 24 of a 48-token row are predicted from positions 0 .. 23, before llama.cpp's first = 48 / 2.
    masked = dict(inputs, labels=inputs["labels"].clone())
    masked["labels"][:, : 48 // 2 + 1] = -100
    expected = logprob_row(masked)
    for metric in (*TOKEN_STAT_METRICS, *DISTRIBUTION):
        assert half.metric(metric) == pytest.approx(expected.metric(metric), rel=1e-9, abs=1e-15), metric
    assert half.ppl_reference != pytest.approx(whole.ppl_reference, rel=1e-6)
    # The row's own error metrics stay over every counted token (2 x 47).
    assert (half.count, half.rms_rel) == (whole.count, whole.rms_rel) == (94, whole.rms_rel)
    assert dataclasses.replace(half, **{m: None for m in (*TOKEN_STAT_METRICS, *DISTRIBUTION)}) == dataclasses.replace(
        whole, **{m: None for m in (*TOKEN_STAT_METRICS, *DISTRIBUTION)}
    )


def test_second_half_takes_true_or_false() -> None:
    with pytest.raises(ConfigurationError, match="token_stats_second_half must be True or False, got 'yes'"):
        compare(load_trained_lm, trained_lm_text_batch(batch=1, length=16), ["bf16"], token_stats_second_half="yes")  # type: ignore[arg-type]
