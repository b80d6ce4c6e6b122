"""Issue 34 item 2, end to end: with this repository's own drift rule (torch=2.0) and a baseline recorded on
another torch, a cosine gate still fails a forward error that grew many times (the old floor, cosine * (1 - 2.1),
was negative and passed anything)."""

from __future__ import annotations

import json

from plugin_testing import SIMPLE_TEST, baseline_file, degrade, failure, output, project, run


def test_a_drift_rule_leaves_a_cosine_gate_bounded(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines", "--precision-metrics", "cosine").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    document = json.loads(path.read_text())
    document["environment"]["torch"] = "2.0.0"
    path.write_text(json.dumps(document))
    gate = ("--precision-metrics", "cosine", "-o", "precision_drift_rtol=torch=2.0")
    run(pytester, *gate).assert_outcomes(passed=1)  # the same numbers: the rule allows drift, nothing moved

    degrade(monkeypatch)  # block 1 rounded to float8: its 1 - cosine grows far beyond 3.1x
    result = run(pytester, *gate)
    result.assert_outcomes(failed=1)
    section = "\n".join(failure(result, "test_name"))
    assert "precision regressed: " in section and "first: bf16 blocks.1 (fw)" in section
    assert "Environment drift: tolerances widened by rtol +2 (precision_drift_rtol) for torch" in output(result)
    (row,) = [line.split() for line in section.splitlines() if line.split()[:4] == ["bf16", "blocks.1", "fw", "cosine"]]
    baseline, obtained, allowed = float(row[4]), float(row[5]), float(row[7])
    # The floor is 1 - (3.1 x the baseline's 1 - cosine + 1e-5), shown with 3 digits of its distance from 1 (the
    # baseline's too, hence 1% here); the ratio is of the distances from 1.
    assert abs((1 - allowed) - ((1 - baseline) * 3.1 + 1e-5)) <= 1e-2 * (1 - allowed)
    assert obtained < allowed < baseline < 1
    assert float(row[6].removesuffix("x")) > 3.1
