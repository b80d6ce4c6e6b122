"""Cross-engine log-probabilities from saved vectors: what a trainer and an inference engine returned for
the same tokens (examples/data/*.npy, written by examples/data/make_engine_logprobs.py), gated on the
log-ratio delta = logpi_trainer - logpi_engine that enters the RL importance ratio.

    pytest examples/test_cross_engine_logprobs.py -s
"""

from __future__ import annotations

from pathlib import Path

from pytest_precision import compare_logprobs

DATA = Path(__file__).parent / "data"


def test_trainer_against_engine(assert_precision_within):
    report = compare_logprobs(
        DATA / "trainer_logprobs.npy",
        DATA / "engine_logprobs.npy",
        ref_a=DATA / "reference_logprobs.npy",
        ref_b=DATA / "reference_logprobs.npy",
        names=("trainer", "engine"),
    )
    print(report.format(full=False))
    assert_precision_within(report, metrics=["rms_rel", "delta_rms", "clip_fraction"])
    record = report.get("trainer", "logprob", "logprob")
    # Same model and reference on both sides: no floor, and delta is exactly e_trainer - e_engine.
    assert record.rms_floor == 0
    assert record.rms_e_diff == record.delta_rms
