"""compare_logprobs through the gate: log-probabilities of a trainer and an engine, saved to files, against a
baseline like any other report."""

from __future__ import annotations

import json

import numpy  # noqa: F401  (kept imported across pytester runs, which restore sys.modules)
import safetensors.torch  # noqa: F401
from plugin_testing import assert_no_traceback, baseline_file, failure, output, project, run, table_rows

import pytest_precision.numbers.cross_engine  # noqa: F401

CROSS_ENGINE_TEST = """
import os

import numpy as np
import torch
from safetensors.torch import save_file

from pytest_precision.reports.report import compare_logprobs


def test_engines(tmp_path, assert_precision_within):
    rng = np.random.default_rng(0)
    engine = -rng.exponential(1.5, size=(4, 64))
    trainer = engine + float(os.environ.get("TRAINER_NOISE", "0.01")) * rng.standard_normal(engine.shape)
    mask = np.ones(engine.shape, dtype=bool)
    mask[3, 40:] = False  # padding
    np.save(tmp_path / "trainer.npy", trainer)
    save_file({"logprobs": torch.from_numpy(engine)}, tmp_path / "engine.safetensors")
    report = compare_logprobs(
        tmp_path / "trainer.npy", str(tmp_path / "engine.safetensors"), mask=mask, names=("trainer", "vllm")
    )
    report.format()
    assert_precision_within(report, metrics=["rms_rel", "delta_rms"])
"""


def test_logprob_report_is_gated_like_any_other(pytester, monkeypatch):
    project(pytester, monkeypatch, test_engines=CROSS_ENGINE_TEST)
    monkeypatch.delenv("TRAINER_NOISE", raising=False)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_engines", "test_engines")
    document = json.loads(path.read_text(encoding="utf-8"))
    assert document["reference"]["spec"] == {"name": "vllm", "source": "external"}
    assert document["reference"]["run"]["token_count"] == 4 * 64 - 24
    assert document["variant_order"] == ["trainer"]
    (row,) = document["variants"]["trainer"]["records"]
    assert (row["name"], row["kind"], row["shape"], row["count"]) == ("logprob", "logprob", [4, 64], 232)
    assert {"delta_rms", "clip_fraction", "seq_delta_std"} <= set(row)
    written = path.read_bytes()

    result = run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["precision baselines (compare, baselines): 1 passed"])

    monkeypatch.setenv("TRAINER_NOISE", "0.03")  # the trainer got noisier: 3x the error
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_engines")
    assert section[0] == (
        "precision regressed: 1 / 1 tensors (100.0%) in 1 variant(s); first: trainer logprob (logprob)"
    ), output(result)
    rows = table_rows(section)
    assert [row[:4] for row in rows] == [
        ["trainer", "logprob", "logprob", "rms_rel"],
        ["trainer", "logprob", "logprob", "delta_rms"],
    ]
    assert all(float(row[6][:-1]) > 2 for row in rows)  # the ratio column: about 3x
    result.stdout.fnmatch_lines(["precision baselines (compare, baselines): 1 failed"])
    assert_no_traceback(result)
    assert path.read_bytes() == written
