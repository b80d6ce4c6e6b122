"""xdist stress: sixteen precision tests on four workers, updated ten times in a row, then compared."""

from __future__ import annotations

import json
import os

import pytest
from plugin_testing import assert_no_traceback, project, run

SEEDS = 16
UPDATES = 10

STRESS_TEST = f"""
import pytest
from tinymodel import tiny_batch, tiny_model


@pytest.mark.parametrize("seed", range({SEEDS}))
def test_seed(precision, assert_precision_within, seed):
    assert_precision_within(precision.run(tiny_model(seed), tiny_batch(seed), variants=["bf16"]))
"""


def test_sixteen_baselines_survive_ten_parallel_updates(pytester, monkeypatch):
    pytest.importorskip("xdist")
    project(pytester, monkeypatch, test_stress=STRESS_TEST)
    folder = pytester.path / "baselines" / "test_stress"
    expected = sorted(f"test_seed_{seed}.cpu.json" for seed in range(SEEDS))

    def snapshot():
        names = sorted(p.name for p in folder.iterdir())
        assert names == expected, f"baselines lost or temporary files left: {names}"
        state = {}
        for name in names:
            path = folder / name
            data = json.loads(path.read_bytes())
            assert data["schema_version"] == 1
            assert data["test"] == f"test_stress.py::test_seed[{name.split('_')[2].split('.')[0]}]"
            state[name] = (path.read_bytes(), os.stat(path).st_mtime_ns)
        return state

    before = None
    for attempt in range(UPDATES):
        result = run(pytester, "-n", "4", "--update-baselines")
        result.assert_outcomes(passed=SEEDS)
        outcome = "written" if attempt == 0 else "unchanged"
        result.stdout.fnmatch_lines(
            [f"4 workers [[]{SEEDS} items[]]", f"precision baselines (update, baselines): {SEEDS} {outcome}"]
        )
        assert_no_traceback(result)
        after = snapshot()
        assert [p.name for p in (pytester.path / "baselines").iterdir()] == ["test_stress"]
        assert not list((pytester.path / "baselines").rglob(".*.precision-tmp"))
        if before is not None:
            assert after == before, f"update run {attempt + 1} touched a baseline whose numbers did not move"
        before = after

    result = run(pytester, "-n", "4")
    result.assert_outcomes(passed=SEEDS)
    result.stdout.fnmatch_lines([f"precision baselines (compare, baselines): {SEEDS} passed"])
    assert_no_traceback(result)
    assert snapshot() == before
