"""`pytest-precision diff` on tiny hand-made baselines and session reports, run in-process with the gate on the
command line (so pytest is not asked): pairing of tests, what each section and the summary say, `--against`
a git ref, the gate a session report recorded, and asking pytest for the project's gate."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import Record, RunInfo, TensorError
from pytest_precision.cli.main import main
from pytest_precision.gate.baseline import baseline_path, baseline_stem, document, json_ready, render
from pytest_precision.gate.baseline_diff import diff_files
from pytest_precision.gate.diff_gate import DiffOptions
from pytest_precision.gate.pytest_gate import _refusal, ask_pytest
from pytest_precision.gate.tolerance import Tolerance
from pytest_precision.gate.tolerance_rules import ToleranceRules
from pytest_precision.reports.report import PrecisionReport

#: The whole gate on the command line: diff does not start pytest to resolve it.
GATE = ["--metric", "rms_rel", "--rtol", "0.1", "--atol", "1e-5"]
NOT_ASKED = "pytest config: not asked (--metric, --rtol and --atol given)"
TEST_A, TEST_B = "tests/test_a.py::test_one", "tests/test_b.py::test_two"
#: {variant: {tensor name: rms_rel}}; None: undefined.
Tensors = Mapping[str, Mapping[str, float | None]]


def report(tensors: Tensors) -> PrecisionReport:
    """A report of forward tensors of shape (2, 3) with these rms_rel values (max_rel 3x them)."""
    run = RunInfo(
        variant={"name": "fp16", "dtype": "float16"},
        parameter_dtypes={"float16": 2},
        buffer_dtypes={},
        input_shapes={"x": [2, 3]},
        token_count=None,
        backend={"settings": {}},
    )
    made = PrecisionReport(reference=dataclasses.replace(run, variant={"name": "fp32"}), device="cpu")
    for variant, values in tensors.items():
        records = []
        for name, rms_rel in values.items():
            max_rel = None if rms_rel is None else 3 * rms_rel
            error = TensorError(6, 1.0, rms_rel, rms_rel, max_rel, max_rel, 0.0, 0.0, 0.99, 1.0, 0.01, 0.99, 40.0, 0)
            records.append(Record.from_error(name, "fw", (2, 3), error))
        made.add(variant, dataclasses.replace(run, variant={"name": variant}), records, [])
    return made


def write_baseline(root: Path, test_id: str, tensors: Tensors) -> Path:
    """The baseline of `test_id` under folder `root`, where the plugin writes it."""
    path = baseline_path(root, test_id.split("::")[0], baseline_stem(test_id), "cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(document(report(tensors), test_id, {})), encoding="utf-8")
    return path


def write_session(path: Path, tests: Mapping[str, Tensors], gate: Mapping[str, Any] | None = None) -> Path:
    """A --precision-report session report of `tests`, each recording `gate` when given."""
    entries = {}
    for test_id, tensors in tests.items():
        data = report(tensors).to_dict()
        entries[test_id] = {"baseline": "x.json", "reference": data["reference"], "variants": data["variants"]}
        if gate is not None:
            entries[test_id]["gate"] = dict(gate)
    content = {"schema_version": 1, "baseline_dir": "baselines", "tests": entries}
    path.write_text(json.dumps(json_ready(content)), encoding="utf-8")
    return path


def diff(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, list[str], str]:
    """(exit code, stdout lines, stderr) of `pytest-precision diff ARGS`; never a traceback."""
    code = main(["diff", *map(str, args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out.splitlines(), err


# ---------------------------------------------------------------- two folders


def test_a_metric_that_leaves_zero_error_is_a_change_not_unchanged(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An rms_rel from exactly 0 to 1e-9 (within atol) has no ratio but did move: the test is "changed"."""
    write_baseline(tmp_path / "old", TEST_A, {"fp16": {"x": 0.0}})
    write_baseline(tmp_path / "new", TEST_A, {"fp16": {"x": 1e-9}})
    code, lines, _ = diff(capsys, tmp_path / "old", tmp_path / "new", *GATE)
    assert code == 0
    assert lines[0] == f"OLD {tmp_path / 'old'} (1 baselines) -> NEW {tmp_path / 'new'} (1 baselines)"
    assert lines[1] == f"== {TEST_A} [cpu]: 0 of 1 tensor metrics worse beyond rtol 0.1"
    assert lines[-2] == "1 test compared: 0 worse, 1 changed (not worse), 0 unchanged; 0 added, 0 removed"
    assert lines[-1].endswith(f"; {NOT_ASKED}")
    # Unmoved, the same test is one line.
    code, lines, _ = diff(capsys, tmp_path / "old", tmp_path / "old", *GATE)
    assert code == 0 and lines[1:3] == [
        f"== {TEST_A} [cpu]: unchanged (1 tensor metrics)",
        "1 test compared: 0 worse, 0 changed (not worse), 1 unchanged; 0 added, 0 removed",
    ]


def test_a_folder_diff_lists_added_baselines_and_ignored_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    write_baseline(old, TEST_A, {"fp16": {"x": 0.01}})
    write_baseline(new, TEST_A, {"fp16": {"x": 0.01}})
    write_baseline(new, TEST_B, {"fp16": {"x": 0.01}})
    (new / "settings.json").write_text('{"a": 1}')
    code, lines, _ = diff(capsys, old, new, *GATE)
    assert code == 0
    assert "== added: tests/test_b/test_two.cpu.json (tests/test_b.py::test_two): a new baseline" in lines
    assert "note: 1 JSON file ignored, not pytest-precision baselines: settings.json" in lines
    assert lines[-2] == "1 test compared: 0 worse, 0 changed (not worse), 1 unchanged; 1 added, 0 removed"


# ---------------------------------------------------------------- one test's section


def test_a_section_shows_undefined_metrics_new_variants_and_its_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """y's rms_rel became undefined (a lost check: fails), x moved 1.1x (within rtol), bf16 is new."""
    old = write_baseline(tmp_path, "t.py::a", {"fp16": {"x": 0.01, "y": 0.02}})
    new = tmp_path / "new.cpu.json"
    new.write_text(render(document(report({"fp16": {"x": 0.011, "y": None}, "bf16": {"x": 0.01}}), "t.py::a", {})))
    code, lines, _ = diff(capsys, old, new, *GATE)
    assert code == 1
    assert lines[:3] == [
        "== t.py::a: 0 of 2 tensor metrics worse beyond rtol 0.1; 1 check lost or newly non-finite",
        "  fp16 y (fw): rms_rel became undefined",
        "  variants only in new: bf16",
    ]
    assert lines[3].split() == ["variant", "tensor", "kind", "metric", "old", "new", "ratio"]
    rows = {line.split()[1]: line.split() for line in lines[4:6]}
    assert rows["y"][4:] == ["0.02", "-", "-", "UNDEFINED"]  # largest change first
    assert rows["x"][4:] == ["0.01", "0.011", "1.1x"]  # moved, still defined: no mark
    assert lines[4].split()[1] == "y"


# ---------------------------------------------------------------- pairing the tests of two files


def test_no_test_in_both_files_names_a_few_of_each(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old = write_baseline(tmp_path, "t.py::a", {"fp16": {"x": 0.01}})
    tests = {f"t.py::{name}": {"fp16": {"x": 0.01}} for name in "bcde"}
    new = write_session(tmp_path / "session.json", tests)
    code, _, err = diff(capsys, old, new, *GATE)
    assert code == 2
    assert f"no test is in both {old} (t.py::a) and {new} (t.py::b, t.py::c, t.py::d, ...); diff the baseline" in err


def test_session_reports_pair_tests_by_id_new_dropped_and_worse(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """OLD holds c and d; NEW a and b (new), c (2x worse): every test has its line, and d is a dropped gate."""
    same, worse = {"fp16": {"x": 0.01}}, {"fp16": {"x": 0.02}}
    old = write_session(tmp_path / "old.json", {"t.py::c": same, "t.py::d": same})
    new = write_session(tmp_path / "new.json", {"t.py::a": same, "t.py::b": same, "t.py::c": worse})
    code, lines, _ = diff(capsys, old, new, *GATE)
    assert code == 1
    heads = [line for line in lines if line.startswith("==")]
    assert heads == [
        f"== t.py::a: not in {old} (a new test)",
        f"== t.py::b: not in {old} (a new test)",
        "== t.py::c: 1 of 1 tensor metrics worse beyond rtol 0.1",
        f"== t.py::d: dropped, in {old} but not in {new}",
    ]
    # Without the worse test, the dropped one alone still fails; with d back, the new tests alone pass.
    new = write_session(tmp_path / "new.json", {"t.py::a": same, "t.py::b": same, "t.py::c": same})
    assert diff(capsys, old, new, *GATE)[0] == 1
    new = write_session(tmp_path / "new.json", {"t.py::a": same, "t.py::c": same, "t.py::d": same})
    assert diff(capsys, old, new, *GATE)[0] == 0


def test_one_test_against_a_session_report_compares_the_test_of_its_id(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """NEW's b (rms_rel 0.01) against OLD's b (0.01), not against OLD's first test a (0.001)."""
    old = write_session(tmp_path / "old.json", {"t.py::a": {"fp16": {"x": 0.001}}, "t.py::b": {"fp16": {"x": 0.01}}})
    new = write_baseline(tmp_path, "t.py::b", {"fp16": {"x": 0.01}})
    code, lines, _ = diff(capsys, old, new, *GATE)
    assert code == 0
    head = "== t.py::b: 0 of 1 tensor metrics worse beyond rtol 0.1"
    assert lines[0] == head and [line for line in lines if line.startswith("==")] == [head]


def test_a_file_that_is_not_utf8_is_named_with_the_byte(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "old.cpu.json"
    bad.write_bytes(b'{"test": "\xff"}')
    new = write_baseline(tmp_path, "t.py::a", {"fp16": {"x": 0.01}})
    code, _, err = diff(capsys, bad, new, *GATE)
    assert code == 2
    assert f"{bad} is not UTF-8 text (byte 10), not a baseline or session report (JSON text)" in err


# ---------------------------------------------------------------- the gate a session report recorded


def test_a_recorded_gate_names_its_metrics_in_the_section(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    gate = {**ToleranceRules().to_dict(), "metrics": ["rms_rel", "max_rel"]}
    old = write_session(tmp_path / "old.json", {"t.py::a": {"fp16": {"x": 0.01}}}, gate)
    new = write_session(tmp_path / "new.json", {"t.py::a": {"fp16": {"x": 0.01}}}, gate)
    options = DiffOptions(["rms_rel"], ToleranceRules(), 30)
    assert diff_files(old, new, options) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "== t.py::a: 0 of 2 tensor metrics worse beyond rtol 0.1 on rms_rel, max_rel (the gate its session report "
        "recorded)"
    )


def test_rtol_on_the_command_line_outranks_the_recorded_tolerances(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--rtol 50 given (atol not): the recorded gate's rtol 0.1 does not apply, so 10x worse passes."""
    gate = ToleranceRules().to_dict()
    old = write_session(tmp_path / "old.json", {"t.py::a": {"fp16": {"x": 0.01}}}, gate)
    new = write_session(tmp_path / "new.json", {"t.py::a": {"fp16": {"x": 0.1}}}, gate)
    loose = ToleranceRules(base=Tolerance(rtol=50.0, atol=1e-5))
    assert diff_files(old, new, DiffOptions(["rms_rel"], loose, 30, rtol_from="--rtol")) == 0
    assert "worse beyond rtol 50" in capsys.readouterr().out
    # Neither given: the recorded rtol 0.1 serves, and 10x worse fails.
    assert diff_files(old, new, DiffOptions(["rms_rel"], loose, 30)) == 1


def test_a_metric_no_file_holds_says_where_it_is_measured(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old = write_baseline(tmp_path, "t.py::a", {"fp16": {"x": 0.01}})
    code, _, err = diff(capsys, old, old, "--metric", "rho", "--rtol", "0.1", "--atol", "0")
    assert code == 2
    assert "--metric: no tensor of the compared files holds rho (log-probability metrics are on logprob rows" in err
    assert "cross-engine ones (rho, rms_e_*) in cross-engine reports); compare a metric they hold" in err


# ---------------------------------------------------------------- --against a git ref


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, capture_output=True, check=True)


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git checkout (the current directory) whose branch main holds the baseline of TEST_A and a committed
    symlink to it; git without the user's configuration."""
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "Test")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "test@example.com")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    path = write_baseline(repo / "baselines", TEST_A, {"fp16": {"x": 0.01}})
    (path.parent / "link.cpu.json").symlink_to(path.name)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "baselines")
    monkeypatch.chdir(repo)
    return repo


def test_against_a_ref_leaves_committed_symlinks_out(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    code, lines, _ = diff(capsys, "--against", "main", "baselines", *GATE)
    assert code == 0
    assert lines[0] == "OLD main:baselines (1 baselines) -> NEW baselines (1 baselines)"
    assert lines[1] == f"== {TEST_A} [cpu]: unchanged (1 tensor metrics)"
    write_baseline(repo / "baselines", TEST_A, {"fp16": {"x": 0.02}})
    code, lines, _ = diff(capsys, "--against", "main", "baselines", *GATE)
    assert code == 1 and lines[1] == f"== {TEST_A} [cpu]: 1 of 1 tensor metrics worse beyond rtol 0.1"


def test_against_a_ref_one_file(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    path = write_baseline(repo / "baselines", TEST_A, {"fp16": {"x": 0.02}}).relative_to(repo)
    code, lines, _ = diff(capsys, "--against", "main", path, *GATE)
    assert code == 1
    assert lines[0] == f"== {TEST_A}: 1 of 1 tensor metrics worse beyond rtol 0.1"
    assert lines[2].split()[4:] == ["0.01", "0.02", "2x", "WORSE"]


def test_against_an_unknown_ref_or_a_missing_path(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    code, _, err = diff(capsys, "--against", "mian", *GATE)
    assert code == 2 and "--against mian: no such branch, tag or commit in " in err
    code, _, err = diff(capsys, "--against", "main", "nowhere", *GATE)
    assert (
        code == 2
        and (
            "nowhere does not exist; give the baseline folder (default: baselines, relative to the current directory) "
            "or a baseline file"
        )
        in err
    )


# ---------------------------------------------------------------- asking pytest for the project's gate


def test_pytest_without_the_plugin_is_a_refusal_naming_the_scratch_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest that does not load the plugin rejects the flag; the file it was to write lay in a scratch folder of
    its own in the temporary folder, removed since."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.raises(ConfigurationError) as refusal:
        ask_pytest([tmp_path])
    message = str(refusal.value)
    assert message.startswith(
        f"pytest refuses the project's configuration, so its gate is unknown (`python -m pytest` in {tmp_path}"
    )
    assert "pytest here does not load pytest-precision, so no precision gate applies" in message
    found = re.search(r"unrecognized arguments: --precision-resolved-gate=(\S+/gate\.json)\)", message)
    assert found, message
    target = Path(found[1])
    assert target.parent.parent == Path(tempfile.gettempdir())
    assert target.parent.name.startswith("pytest-precision-gate-")
    assert not target.parent.exists()


def test_the_projects_drift_rules_are_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    (tmp_path / "pytest.ini").write_text("[pytest]\nprecision_drift_rtol = torch=2.0 cuda=0.5\n")
    gate = ask_pytest([tmp_path])
    assert gate.drift_rtol == {"torch": 2.0, "cuda": 0.5}
    assert gate.config == "pytest.ini"


def test_a_long_refusal_is_cut_at_600_characters() -> None:
    done = subprocess.CompletedProcess(["python"], 4, stdout="", stderr="ERROR: " + "x" * 700 + "\n")
    message = _refusal("python -m pytest", done)
    assert message.endswith(", exit 4): " + "x" * 600 + " ...")
