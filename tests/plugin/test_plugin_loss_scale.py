"""A compare run reuses the fp16 loss scale recorded in the baseline, so a gradient crossing a power of two
between two runs cannot move the scale and make the gate flap."""

from __future__ import annotations

import json

from plugin_testing import baseline_file, project, run

SCALE_TEST = """
import os

from tinymodel import tiny_batch, tiny_model


def test_scaled(precision, assert_precision_within):
    report = precision.run(tiny_model(), tiny_batch(), variants=["fp16"])
    expected = os.environ.get("EXPECTED_SCALE")
    if expected is not None:
        assert report.runs["fp16"].loss_scale == float(expected)
    assert_precision_within(report)
"""


def test_compare_runs_reuse_the_baselines_loss_scale(pytester, monkeypatch):
    project(pytester, monkeypatch, test_scale=SCALE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_scale", "test_scaled")
    document = json.loads(path.read_text())
    calibrated = document["variants"]["fp16"]["run"]["loss_scale"]
    assert calibrated > 1 and float(calibrated).is_integer()

    # The compare run uses the recorded scale, not a fresh calibration: record another power of two and the
    # run picks it up (gradients are unscaled before comparison, so the gate still passes).
    other = calibrated / 4
    document["variants"]["fp16"]["run"]["loss_scale"] = other
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    monkeypatch.setenv("EXPECTED_SCALE", str(other))
    run(pytester).assert_outcomes(passed=1)

    # --update-baselines calibrates afresh and writes the calibrated scale back.
    monkeypatch.setenv("EXPECTED_SCALE", str(calibrated))
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    assert json.loads(path.read_text())["variants"]["fp16"]["run"]["loss_scale"] == calibrated
