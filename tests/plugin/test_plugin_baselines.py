"""Baseline files as a user meets them: missing, written, unchanged, compared, corrupt, and where they go."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from plugin_testing import (
    SIMPLE_TEST,
    assert_no_traceback,
    baseline_file,
    failure,
    gate_tests,
    output,
    project,
    record_rows,
    records,
    run,
    table_rows,
)


def test_missing_baseline_fails_and_writes_nothing(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    assert failure(result, "test_name")[:3] == [
        "no precision baseline for test_gate.py::test_name",
        "expected: baselines/test_gate/test_name.cpu.json",
        "Create it with: pytest test_gate.py::test_name --update-baselines   (then review and commit it)",
    ]
    result.stdout.fnmatch_lines(["precision baselines (compare, baselines): 1 missing"])
    assert_no_traceback(result)
    assert not (pytester.path / "baselines").exists()


def test_update_writes_a_reviewable_file_then_leaves_it_alone(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    path = baseline_file(pytester, "test_gate", "test_name")

    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 written"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["test_name.cpu.json"]  # no temporary file left

    text = path.read_text(encoding="utf-8")
    data = json.loads(text)
    assert text.endswith("}\n")
    assert not text.endswith("\n\n")
    assert data["schema_version"] == 1
    assert data["test"] == "test_gate.py::test_name"
    assert data["environment"]["torch"] == torch.__version__
    assert data["variant_order"] == ["bf16"]

    def assert_sorted(value):
        if isinstance(value, dict):
            assert list(value) == sorted(value)
            for item in value.values():
                assert_sorted(item)
        elif isinstance(value, list):
            for item in value:
                assert_sorted(item)

    json.loads(text, object_pairs_hook=lambda pairs: assert_sorted(dict(pairs)) or dict(pairs))
    # One record per line: the embedding, 3 blocks and norm in forward, the chosen-token log-probabilities,
    # loss, backward (the logits' gradient first) and grads.
    lines = {line.strip().rstrip(",") for line in text.splitlines()}
    written = list(records(data))
    assert len(written) == 23
    for _, record in written:
        assert json.dumps(record, sort_keys=True) in lines
    assert record_rows(path)[:8] == [
        ("embed", "fw"),
        ("blocks.0", "fw"),
        ("blocks.1", "fw"),
        ("blocks.2", "fw"),
        ("norm", "fw"),
        ("logprob", "logprob"),
        ("loss", "loss"),
        ("logits", "bw"),
    ]
    # The log-probability statistics are written on the logprob line only, not as nulls on every other line.
    with_delta = [record["kind"] for _, record in written if "delta_mean" in record]
    assert with_delta == ["logprob"]
    assert data["variants"]["bf16"]["run"]["loss_scale"] is None  # only fp16 runs scale the loss

    before = path.read_bytes(), os.stat(path).st_mtime_ns
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 unchanged"])
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before

    result = run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["precision baselines (compare, baselines): 1 passed"])


def test_update_rewrites_a_baseline_whose_numbers_moved(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    before = path.read_text(encoding="utf-8")
    monkeypatch.setenv("TINY_DEGRADE", "1")
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 updated"])
    assert path.read_text(encoding="utf-8") != before
    run(pytester).assert_outcomes(passed=1)


def test_two_checks_in_one_test_need_their_own_baseline_stems(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_two="""
        from tinymodel import run


        def test_same_stem(precision, assert_precision_within):
            report = run(precision)
            assert_precision_within(report)
            assert_precision_within(report)


        def test_own_stems(precision, assert_precision_within):
            assert_precision_within(run(precision), baseline="gate_bf16")
            assert_precision_within(run(precision, variants=["fp16"]), baseline="gate_fp16")
        """,
    )
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    assert (
        "ConfigurationError: assert_precision_within called twice in test_two.py::test_same_stem with "
        "baseline stem 'test_same_stem'; give each call its own baseline='...'"
    ) in failure(result, "test_same_stem")
    assert sorted(p.name for p in (pytester.path / "baselines" / "test_two").iterdir()) == [
        "gate_bf16.cpu.json",
        "gate_fp16.cpu.json",
        "test_same_stem.cpu.json",
    ]
    assert record_rows(baseline_file(pytester, "test_two", "gate_fp16"), "fp16")[0] == ("embed", "fw")
    result = run(pytester, "-k", "own_stems")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["precision baselines (compare, baselines): 2 passed"])


@pytest.mark.parametrize(
    ("ini", "args", "directory"),
    [
        ("", ["--precision-baseline-dir", "golden/cpu"], "golden/cpu"),
        ("precision_baseline_dir = from_ini", [], "from_ini"),
        ("precision_baseline_dir = from_ini", ["--precision-baseline-dir=from_cli"], "from_cli"),
    ],
    ids=["command-line", "ini", "command-line-beats-ini"],
)
def test_baseline_dir_option_and_ini(pytester, monkeypatch, ini, args, directory):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = run(pytester, "--update-baselines", *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            f"precision: torch *, baselines {pytester.path / directory} (update)",
            f"precision baselines (update, {directory}): 1 written",
        ]
    )
    assert [p.relative_to(pytester.path).as_posix() for p in pytester.path.rglob("*.json")] == [
        f"{directory}/test_gate/test_name.cpu.json"
    ]
    result = run(pytester, *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"precision baselines (compare, {directory}): 1 passed"])


def test_update_baselines_has_no_ini_twin(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.makeini("[pytest]\nupdate_baselines = true\n")
    result = run(pytester)
    result.assert_outcomes(failed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "precision: torch *, device cpu, *(compare)",
            "*PytestConfigWarning: Unknown config option: update_baselines",
            "precision baselines (compare, baselines): 1 missing",
        ]
    )
    assert failure(result, "test_name")[0] == "no precision baseline for test_gate.py::test_name"
    assert not (pytester.path / "baselines").exists()


CORRUPT_TESTS = gate_tests("test_empty", "test_truncated", "test_other_schema", "test_not_an_object")


def test_corrupt_baselines_name_the_file_and_the_fix(pytester, monkeypatch):
    project(pytester, monkeypatch, test_corrupt=CORRUPT_TESTS)
    run(pytester, "--update-baselines").assert_outcomes(passed=4)

    def path(name):
        return baseline_file(pytester, "test_corrupt", name)

    path("test_empty").write_text("", encoding="utf-8")
    text = path("test_truncated").read_text(encoding="utf-8")
    path("test_truncated").write_text(text[: len(text) // 2], encoding="utf-8")
    data = json.loads(path("test_other_schema").read_text(encoding="utf-8"))
    data["schema_version"] = 2
    path("test_other_schema").write_text(json.dumps(data), encoding="utf-8")
    path("test_not_an_object").write_text("[]\n", encoding="utf-8")

    result = run(pytester)
    result.assert_outcomes(failed=4)
    assert_no_traceback(result)
    expected = {
        "test_empty": "is empty.",
        "test_truncated": "is not valid JSON (line ",
        "test_other_schema": "has schema_version 2; this pytest-precision reads version 1.",
        "test_not_an_object": "holds a JSON list, not an object.",
    }
    for name, problem in expected.items():
        (message,) = [line for line in failure(result, name) if line.startswith("BaselineError: ")]
        assert message.startswith("BaselineError: precision baseline ")
        assert f"baselines/test_corrupt/{name}.cpu.json {problem}" in message
        assert message.endswith(f"Re-create it with: pytest test_corrupt.py::{name} --update-baselines")
    assert "it may be truncated or have a merge conflict" in output(result)

    # --update-baselines repairs them all.
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 4 updated"])


@pytest.mark.parametrize(
    ("written", "compared", "row", "headline_end"),
    [
        (
            "bf16",
            "bf16,fp16",
            ["fp16", "*", "*", "new", "variant", "not", "in", "the", "baseline"],
            "first: variant fp16 is new (not in the baseline)",
        ),
        (
            "bf16,fp16",
            "bf16",
            ["fp16", "*", "*", "missing", "variant", "not", "in", "this", "run"],
            "first: variant fp16 is missing from this run",
        ),
    ],
    ids=["new-variant", "missing-variant"],
)
def test_baseline_of_other_variants(pytester, monkeypatch, written, compared, row, headline_end):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    monkeypatch.setenv("TINY_VARIANTS", written)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    monkeypatch.setenv("TINY_VARIANTS", compared)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_name")
    assert table_rows(section) == [row]
    assert section[0].startswith("precision regressed: ")
    assert section[0].endswith(headline_end)
    assert "Baseline: baselines/test_gate/test_name.cpu.json" in section
    assert "If the change is intended, refresh it: pytest test_gate.py::test_name --update-baselines" in section


def test_baseline_names_of_parametrized_and_class_tests(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_names="""
        import pytest
        from tinymodel import run


        @pytest.mark.parametrize("variant", ["bf16", "fp16"])
        def test_x(precision, assert_precision_within, variant):
            assert_precision_within(run(precision, variants=[variant]))


        class TestA:
            def test_y(self, precision, assert_precision_within):
                assert_precision_within(run(precision))
        """,
    )
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=3)
    assert sorted(p.name for p in (pytester.path / "baselines" / "test_names").iterdir()) == [
        "TestA.test_y.cpu.json",
        "test_x_bf16.cpu.json",
        "test_x_fp16.cpu.json",
    ]
    data = json.loads(baseline_file(pytester, "test_names", "test_x_fp16").read_text(encoding="utf-8"))
    assert data["test"] == "test_names.py::test_x[fp16]"
    assert data["variant_order"] == ["fp16"]
    run(pytester).assert_outcomes(passed=3)

    baseline_file(pytester, "test_names", "TestA.test_y").unlink()
    result = run(pytester)
    result.assert_outcomes(passed=2, failed=1)
    assert failure(result, "TestA.test_y")[:3] == [
        "no precision baseline for test_names.py::TestA::test_y",
        "expected: baselines/test_names/TestA.test_y.cpu.json",
        "Create it with: pytest test_names.py::TestA::test_y --update-baselines   (then review and commit it)",
    ]


def test_baseline_of_a_test_in_a_subfolder(pytester, monkeypatch):
    project(pytester, monkeypatch)
    pytester.mkpydir("models")
    (pytester.path / "models" / "test_deep.py").write_text(SIMPLE_TEST, encoding="utf-8")
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1)
    assert [p.relative_to(pytester.path).as_posix() for p in pytester.path.rglob("*.json")] == [
        "baselines/models/test_deep/test_name.cpu.json"
    ]
    run(pytester).assert_outcomes(passed=1)


def test_refresh_command_works_from_a_subfolder(pytester, monkeypatch):
    project(pytester, monkeypatch)
    pytester.makeini("[pytest]\n")
    pytester.mkpydir("models")
    (pytester.path / "models" / "test_deep.py").write_text(SIMPLE_TEST, encoding="utf-8")
    monkeypatch.chdir(pytester.path / "models")
    result = run(pytester, "test_deep.py")
    result.assert_outcomes(failed=1)
    (command,) = [line for line in failure(result, "test_name") if line.startswith("Create it with: pytest ")]
    args = command.removeprefix("Create it with: pytest ").split("   (")[0].split()
    run(pytester, *args).assert_outcomes(passed=1)
    assert baseline_file(pytester, "models/test_deep", "test_name").exists()


def test_two_tests_cannot_share_a_baseline_file(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_shared="""
        from tinymodel import run


        def test_one(precision, assert_precision_within):
            assert_precision_within(run(precision), baseline="shared")


        def test_two(precision, assert_precision_within):
            assert_precision_within(run(precision), baseline="shared")
        """,
    )
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    assert failure(result, "test_two")[0] == (
        "ConfigurationError: test_shared.py::test_two and test_shared.py::test_one would share the baseline file "
        "baselines/test_shared/shared.cpu.json; give one of them its own baseline='...' (test names that differ "
        "only in characters a file name cannot hold sanitise to the same file)"
    )


def test_update_refuses_nonfinite_values(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_overflow="""
        import torch
        from torch import nn

        from pytest_precision import Variant


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                return x


        def overflow_block_1(model):
            model.layers[1].weight.data.fill_(6e4)  # outputs past fp16's 65504: inf, then nan downstream
            return model


        def test_overflow(precision, assert_precision_within):
            torch.manual_seed(0)
            variant = Variant("fp16", dtype="fp16", prepare=overflow_block_1)
            report = precision.run(Net(), torch.randn(4, 8), variants=[variant], backward=False)
            assert_precision_within(report)
        """,
    )
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(failed=1)
    section = failure(result, "test_overflow")
    assert section[0] == (
        "not writing baselines/test_overflow/test_overflow.cpu.json: 2 tensor(s) hold NaN/Inf where the reference "
        "is finite (first in execution order first):"
    )
    assert section[1].split()[:3] == ["fp16", "layers.1", "(fw):"]
    assert section[2].split()[:3] == ["fp16", "layers.2", "(fw):"]
    assert not baseline_file(pytester, "test_overflow", "test_overflow").exists()
