"""`pytest-precision diff` on folders of baselines and against a git ref: pairing by path, added and removed
baselines, files that are not baselines, corrupt files, and git checkouts, refs and subdirectories."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_precision.base.atomic_files import write_atomically
from pytest_precision.cli.main import main
from pytest_precision.gate.baseline import baseline_path, baseline_stem, document, render, report_from_document

ROOT = Path(__file__).parents[2]
SOURCE = ROOT / "baselines/examples/test_tiny_llama_gate/test_tiny_llama_low_precision.cpu.json"
TEST_A = "tests/test_a.py::test_one"
TEST_B = "tests/test_b.py::test_two"
#: The first fp16 forward record of SOURCE, the one a test makes worse.
WORSE_TENSOR = ("model.layers.2", "fw")


def write_baseline(
    root: Path,
    test_id: str,
    *,
    factor: float = 1.0,
    stem: str | None = None,
    device: str = "cpu",
    max_rel: float = 1.0,
) -> Path:
    """A baseline of `test_id` under `root`, written by the plugin's own writer (document, render,
    write_atomically) from SOURCE's numbers; `factor` scales fp16's rms_rel of WORSE_TENSOR, `max_rel` every
    record's max_rel."""
    data = json.loads(SOURCE.read_text())
    content = document(report_from_document(data, SOURCE), test_id, data["environment"])
    for record in content["variants"]["fp16"]["records"]:
        if (record["name"], record["kind"]) == WORSE_TENSOR:
            record["rms_rel"] *= factor
    for _, record in records(content):
        if record.get("max_rel") is not None:
            record["max_rel"] *= max_rel
    path = baseline_path(root, test_id.split("::")[0], stem or baseline_stem(test_id), device)
    write_atomically(path, render(content))
    return path


def records(content: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for variant, entry in content["variants"].items():
        for record in entry["records"]:
            yield variant, record


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); an error is one line on stderr, never a traceback. The gate line that ends
    the output of a diff that ran is left out (see `gated`)."""
    code, out, err, _ = gated(capsys, *args)
    return code, out, err


def gated(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str, str]:
    """(exit code, stdout without its last line, stderr, that last line: what was gated and where from)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("pytest-precision diff: "), err
        return code, out, err, ""
    *lines, gate = out.splitlines()
    assert gate.startswith("gate: metrics "), out
    return code, "".join(f"{line}\n" for line in lines), err, gate


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    """OLD and NEW folders holding the same two baselines."""
    old, new = tmp_path / "old", tmp_path / "new"
    for root in (old, new):
        write_baseline(root, TEST_A)
        write_baseline(root, TEST_B)
    return old, new


# ---------------------------------------------------------------- two folders


def test_identical_folders_pass_with_one_line_per_test(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    code, out, _ = cli(capsys, "diff", old, new)
    assert code == 0
    assert out.splitlines() == [
        f"OLD {old} (2 baselines) -> NEW {new} (2 baselines)",
        f"== {TEST_A} [cpu]: unchanged (220 tensor metrics)",
        f"== {TEST_B} [cpu]: unchanged (220 tensor metrics)",
        "2 tests compared: 0 worse, 0 changed (not worse), 2 unchanged; 0 added, 0 removed",
    ]


def test_a_tensor_worse_beyond_rtol_fails_and_names_its_test(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    write_baseline(new, TEST_B, factor=2.0)
    code, out, _ = cli(capsys, "diff", old, new, "--limit", "2")
    assert code == 1
    lines = out.splitlines()
    assert f"== {TEST_A} [cpu]: unchanged (220 tensor metrics)" in lines
    header = lines.index(f"== {TEST_B} [cpu]: 1 of 220 tensor metrics worse beyond rtol 0.1")
    worst = lines[header + 2].split()
    assert worst[:4] == ["fp16", *WORSE_TENSOR, "rms_rel"] and worst[-2:] == ["2x", "WORSE"]
    assert lines[header + 4] == "  ... 218 more (--limit)"
    assert lines[-1] == "2 tests compared: 1 worse, 0 changed (not worse), 1 unchanged; 0 added, 0 removed"
    # --rtol applies to folders as to files.
    code, out, _ = cli(capsys, "diff", old, new, "--rtol", "1.5")
    assert code == 0 and out.splitlines()[-1].startswith("2 tests compared: 0 worse, 1 changed (not worse)")


def test_tolerances_per_metric(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    """--rtol takes METRIC=RTOL entries as the plugin's options do: rms_rel loose, max_rel at the default."""
    old, new = trees
    write_baseline(new, TEST_B, factor=2.0)  # fp16 model.layers.2 rms_rel 2x
    both = ["--metric", "rms_rel", "--metric", "max_rel"]
    code, out, _ = cli(capsys, "diff", old, new, *both, "--rtol", "rms_rel=1.5")
    assert code == 0, out
    assert f"== {TEST_B} [cpu]: 0 of 440 tensor metrics worse beyond rtol 0.1 (rms_rel 1.5)" in out.splitlines()
    code, out, _ = cli(capsys, "diff", old, new, *both, "--rtol", "1.5 rms_rel=0.5")
    assert code == 1 and f"== {TEST_B} [cpu]: 1 of 440 tensor metrics worse beyond rtol 1.5 (rms_rel 0.5)" in out
    for bad in ("max_rell=1", "rms_rel=inf", "rms_rel=-1"):
        with pytest.raises(SystemExit):
            main(["diff", str(old), str(new), "--rtol", bad])
        assert "argument --rtol: " in capsys.readouterr().err


def test_a_lost_check_fails_and_new_tensors_are_a_change(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    for test_id, change in ((TEST_A, "drop"), (TEST_B, "add")):
        path = write_baseline(new, test_id)
        content = json.loads(path.read_text())
        if change == "drop":
            del content["variants"]["bf16"]
            content["variant_order"].remove("bf16")
        else:
            extra = dict(content["variants"]["fp16"]["records"][0], name="model.extra")
            content["variants"]["fp16"]["records"].append(extra)
        write_atomically(path, render(content))
    code, out, _ = cli(capsys, "diff", old, new)
    assert code == 1
    assert f"== {TEST_A} [cpu]: 0 of 165 tensor metrics worse beyond rtol 0.1; 1 check lost or newly non-finite" in out
    assert "\n  dropped variant bf16\n" in out
    assert f"== {TEST_B} [cpu]: 0 of 220 tensor metrics worse beyond rtol 0.1\n" in out
    assert out.splitlines()[-1] == "2 tests compared: 1 worse, 1 changed (not worse), 0 unchanged; 0 added, 0 removed"


def test_baselines_pair_by_path_not_by_file_name(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    # The same file name (test_one.cpu.json) under two test files; only the second one gets worse.
    for root, factor in ((old, 1.0), (new, 3.0)):
        write_baseline(root, "tests/x/test_m.py::test_one")
        write_baseline(root, "tests/y/test_m.py::test_one", factor=factor)
    code, out, _ = cli(capsys, "diff", old, new)
    assert code == 1
    assert "== tests/x/test_m.py::test_one [cpu]: unchanged (220 tensor metrics)" in out
    assert "== tests/y/test_m.py::test_one [cpu]: 1 of 220 tensor metrics worse beyond rtol 0.1" in out


def test_two_baselines_of_one_test_are_told_apart(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    for root in trees:
        write_baseline(root, TEST_A, stem="custom_name")
        write_baseline(root, TEST_A, device="cuda-sm90")
    code, out, _ = cli(capsys, "diff", old, new)
    assert code == 0
    assert f"== {TEST_A} [baseline=custom_name, cpu]: unchanged" in out
    assert f"== {TEST_A} [cuda-sm90]: unchanged" in out
    assert out.splitlines()[-1].startswith("4 tests compared: 0 worse")


def test_a_removed_baseline_fails_and_is_listed(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    removed = new / "tests/test_b/test_two.cpu.json"
    removed.unlink()
    code, out, _ = cli(capsys, "diff", old, new)
    assert code == 1
    assert f"== removed: tests/test_b/test_two.cpu.json ({TEST_B}): in OLD, not in NEW; its gate is gone" in out
    assert out.splitlines()[-1] == ("1 test compared: 0 worse, 0 changed (not worse), 1 unchanged; 0 added, 1 removed")


def test_an_added_baseline_passes_and_is_listed(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    write_baseline(new, "tests/test_c.py::test_three")
    code, out, _ = cli(capsys, "diff", old, new)
    assert code == 0
    assert "== added: tests/test_c/test_three.cpu.json (tests/test_c.py::test_three): a new baseline" in out
    assert out.splitlines()[-1].endswith("; 1 added, 0 removed")
    # Swapped, the same file is a removed baseline.
    assert cli(capsys, "diff", new, old)[0] == 1


def test_json_that_is_not_a_baseline_is_ignored_and_counted(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    (old / "settings.json").write_text('{"a": 1}')
    (old / "tests/test_a/broken_but_not_a_baseline.json").write_text("{ not json")
    # A baseline's name, but another tool's content (no schema_version, no test id): not the plugin's.
    (old / "tests/test_a/other.cpu.json").write_text(json.dumps({"variants": {}, "tool": "other"}))
    (new / "notes.txt").write_text("not JSON at all")
    code, out, _ = cli(capsys, "diff", old, new)
    assert code == 0  # other.cpu.json only in OLD is not a removed baseline
    assert out.splitlines()[-2] == (
        "note: 3 JSON files ignored, not pytest-precision baselines: settings.json, "
        "tests/test_a/broken_but_not_a_baseline.json, tests/test_a/other.cpu.json"
    )
    assert "removed" not in out.replace("0 removed", "")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"schema_version": 1, "test": ', "is not valid JSON (line 1"),
        ("<<<<<<< HEAD\n{}\n=======\n{}\n>>>>>>> main\n", "is not valid JSON (line 1"),
        ("\x00\x01binary", "is a binary file"),
    ],
)
@pytest.mark.parametrize("side", ["old", "new"])
def test_a_corrupt_baseline_in_either_folder_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], trees: Any, side: str, content: str, message: str
) -> None:
    old, new = trees
    root = old if side == "old" else new
    corrupt = root / "tests/test_b/test_two.cpu.json"
    corrupt.write_text(content)
    code, out, err = cli(capsys, "diff", old, new)
    assert code == 2 and err.startswith(f"pytest-precision diff: {corrupt} {message}"), err
    assert out == ""  # every file is read before a section is printed


def test_a_baseline_with_a_malformed_record_exits_2_naming_it(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    added = write_baseline(new, "tests/test_c.py::test_three")
    data = json.loads(added.read_text())
    data["variants"]["fp16"]["records"][0]["rms_rel"] = "small"
    added.write_text(json.dumps(data))
    code, _, err = cli(capsys, "diff", old, new)
    assert code == 2 and err.startswith(f"pytest-precision diff: {added} is not a valid precision baseline"), err


def test_a_folder_and_a_file_or_missing_arguments_are_refused(
    capsys: pytest.CaptureFixture[str], trees: Any, tmp_path: Path
) -> None:
    old, new = trees
    file = new / "tests/test_a/test_one.cpu.json"
    code, _, err = cli(capsys, "diff", old, file)
    assert code == 2 and f"{old} is a folder and {file} is not: give two baseline files, or two folders" in err
    code, _, err = cli(capsys, "diff", file, old)
    assert code == 2 and f"{old} is a folder and {file} is not" in err
    code, _, err = cli(capsys, "diff", old)
    assert code == 2 and "give OLD and NEW (two baseline files, or two folders of baselines), or --against" in err
    code, _, err = cli(capsys, "diff", "--against", "main", old, new)
    assert code == 2 and "give one PATH (default baselines), not OLD and NEW" in err
    (tmp_path / "empty1").mkdir()
    (tmp_path / "empty2").mkdir()
    code, _, err = cli(capsys, "diff", tmp_path / "empty1", tmp_path / "empty2")
    assert code == 2 and "holds a pytest-precision baseline" in err


def test_help_says_a_removed_baseline_fails(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["diff", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "pytest-precision diff --against REF [PATH]" in text
    assert "a baseline that disappeared is a gate that was dropped" in text


# ---------------------------------------------------------------- --against a git ref


@pytest.fixture
def git_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """git without the user's or the system's configuration, never looking above tmp_path."""
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "Test")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "test@example.com")


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout


@pytest.fixture
def repo(tmp_path: Path, git_env: None, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git repository whose branch main holds two committed baselines (and a tests folder); the current
    directory is its top."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write_baseline(repo / "baselines", TEST_A)
    write_baseline(repo / "baselines", TEST_B)
    (repo / "tests").mkdir()
    (repo / "tests/test_a.py").write_text("")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "baselines")
    git(repo, "checkout", "-q", "-b", "feature")
    monkeypatch.chdir(repo)
    return repo


def test_against_an_unchanged_ref_passes(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    code, out, _ = cli(capsys, "diff", "--against", "main", "baselines")
    assert code == 0
    assert out.splitlines()[0] == "OLD main:baselines (2 baselines) -> NEW baselines (2 baselines)"
    assert out.splitlines()[-1] == "2 tests compared: 0 worse, 0 changed (not worse), 2 unchanged; 0 added, 0 removed"
    assert cli(capsys, "diff", "--against", "main")[0] == 0  # PATH defaults to baselines


def test_against_a_ref_a_worse_working_tree_fails(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    write_baseline(repo / "baselines", TEST_A, factor=2.0)  # changed, not committed
    code, out, _ = cli(capsys, "diff", "--against", "main", "baselines")
    assert code == 1
    assert f"== {TEST_A} [cpu]: 1 of 220 tensor metrics worse beyond rtol 0.1" in out
    assert f"== {TEST_B} [cpu]: unchanged (220 tensor metrics)" in out
    # Committed on the branch, the same change still fails against main, and passes against the branch.
    git(repo, "commit", "-q", "-am", "worse")
    assert cli(capsys, "diff", "--against", "main")[0] == 1
    assert cli(capsys, "diff", "--against", "feature")[0] == 0
    assert cli(capsys, "diff", "--against", "HEAD~1")[0] == 1


def test_against_a_ref_from_a_subdirectory(capsys: pytest.CaptureFixture[str], repo: Path, monkeypatch: Any) -> None:
    write_baseline(repo / "baselines", TEST_B, factor=2.0)
    monkeypatch.chdir(repo / "tests")
    code, out, _ = cli(capsys, "diff", "--against", "main", "../baselines")
    assert code == 1 and f"== {TEST_B} [cpu]: 1 of 220 tensor metrics worse beyond rtol 0.1" in out
    assert out.splitlines()[0] == "OLD main:baselines (2 baselines) -> NEW ../baselines (2 baselines)"
    code, out, _ = cli(capsys, "diff", "--against", "main", "../baselines/tests/test_a")
    assert code == 0 and out.splitlines()[-1].startswith("1 test compared: 0 worse")
    code, _, err = cli(capsys, "diff", "--against", "main")  # no baselines folder here
    assert code == 2 and "baselines does not exist; give the baseline folder (default: baselines" in err


def test_against_a_ref_deleted_and_new_baselines(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    (repo / "baselines/tests/test_b/test_two.cpu.json").unlink()
    # A new baseline, not committed and even ignored by git, is what the user is about to commit: it counts.
    (repo / ".gitignore").write_text("baselines/tests/test_c/\n")
    write_baseline(repo / "baselines", "tests/test_c.py::test_three")
    assert git(repo, "status", "--porcelain", "--ignored", "baselines").count("!! baselines/tests/test_c/") == 1
    code, out, _ = cli(capsys, "diff", "--against", "main")
    assert code == 1
    assert f"== removed: tests/test_b/test_two.cpu.json ({TEST_B}): in OLD, not in NEW; its gate is gone" in out
    assert "== added: tests/test_c/test_three.cpu.json (tests/test_c.py::test_three): a new baseline" in out
    assert out.splitlines()[-1].endswith("; 1 added, 1 removed")


def test_against_a_ref_one_file(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    path = write_baseline(repo / "baselines", TEST_A, factor=2.0).relative_to(repo)
    code, out, _ = cli(capsys, "diff", "--against", "main", path)
    assert code == 1
    assert out.splitlines()[0] == f"== {TEST_A}: 1 of 220 tensor metrics worse beyond rtol 0.1"


def test_against_a_ref_holding_a_corrupt_baseline_names_it(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    (repo / "baselines/tests/test_b/test_two.cpu.json").write_text("<<<<<<< HEAD\n")
    git(repo, "commit", "-q", "-am", "a merge conflict")
    git(repo, "checkout", "-q", "main", "--", "baselines")
    code, _, err = cli(capsys, "diff", "--against", "feature")
    assert code == 2
    assert err.startswith("pytest-precision diff: feature:baselines/tests/test_b/test_two.cpu.json is not valid JSON")


def test_against_an_unknown_ref_or_an_untracked_path(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    code, _, err = cli(capsys, "diff", "--against", "mian")
    assert code == 2 and "--against mian: no such branch, tag or commit in " in err and "git fetch origin mian" in err
    code, _, err = cli(capsys, "diff", "--against=--output=x")
    assert code == 2 and "no such branch, tag or commit" in err
    write_baseline(repo / "other", TEST_A)
    code, _, err = cli(capsys, "diff", "--against", "main", "other")
    assert code == 2 and "--against main: nothing under other is committed at main" in err


def test_against_outside_a_git_checkout(
    capsys: pytest.CaptureFixture[str], trees: Any, git_env: None, monkeypatch: Any
) -> None:
    old, _ = trees
    monkeypatch.chdir(old.parent)
    code, _, err = cli(capsys, "diff", "--against", "main", "old")
    assert code == 2 and f"--against needs a git checkout, and {old.parent} is not in one" in err
    assert "pytest-precision diff OLD_DIR NEW_DIR" in err


# ---------------------------------------------------------------- what diff gates: the project's config file


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder (the current directory) holding OLD and NEW baseline folders: in NEW, every max_rel
    of TEST_A is 10x worse, its rms_rel as in OLD."""
    root = tmp_path / "project"
    for side, factor in (("old", 1.0), ("new", 10.0)):
        write_baseline(root / side, TEST_A, max_rel=factor)
        write_baseline(root / side, TEST_B)
    monkeypatch.chdir(root)
    return root


#: (file, content) setting precision_metrics = rms_rel max_rel, in each place pytest reads it from.
METRICS_IN = [
    ("pytest.ini", "[pytest]\nprecision_metrics = rms_rel max_rel\n"),
    (".pytest.ini", "[pytest]\nprecision_metrics = rms_rel,max_rel\n"),
    ("pyproject.toml", '[tool.pytest.ini_options]\nprecision_metrics = "rms_rel max_rel"\n'),
    ("tox.ini", "[tox]\nenvlist = py\n\n[pytest]\nprecision_metrics =\n    rms_rel\n    max_rel\n"),
    ("setup.cfg", "[metadata]\nname = x\n\n[tool:pytest]\nprecision_metrics = rms_rel max_rel\n"),
]
if int(pytest.__version__.split(".")[0]) >= 9:  # pytest 9's own TOML file and pyproject's native table
    METRICS_IN += [
        ("pytest.toml", '[pytest]\nprecision_metrics = "rms_rel max_rel"\n'),
        ("pyproject.toml", '[tool.pytest]\nprecision_metrics = "rms_rel max_rel"\n'),
    ]


@pytest.mark.parametrize(("name", "content"), METRICS_IN, ids=[f"{n}-{i}" for i, (n, _) in enumerate(METRICS_IN)])
def test_the_projects_ini_metrics_are_gated_and_the_command_line_overrides_them(
    capsys: pytest.CaptureFixture[str], project: Path, name: str, content: str
) -> None:
    code, out, _, gate = gated(capsys, "diff", "old", "new")
    assert code == 0 and gate.startswith("gate: metrics rms_rel (built-in)")  # max_rel goes unseen
    (project / name).write_text(content)
    code, out, _, gate = gated(capsys, "diff", "old", "new")
    assert code == 1, out
    assert f"== {TEST_A} [cpu]: 220 of 440 tensor metrics worse beyond rtol 0.1" in out
    assert f"== {TEST_B} [cpu]: unchanged (440 tensor metrics)" in out
    assert gate == (
        f"gate: metrics rms_rel, max_rel ({name} precision_metrics); rtol 0.1 (built-in); atol 1e-05 (built-in); "
        f"pytest config: {name}"
    )
    code, _, _, gate = gated(capsys, "diff", "old", "new", "--metric", "rms_rel")
    assert code == 0 and gate.startswith("gate: metrics rms_rel (--metric); ")


def test_the_projects_ini_tolerances_apply_and_the_command_line_overrides_them(
    capsys: pytest.CaptureFixture[str], project: Path
) -> None:
    (project / "pytest.ini").write_text(
        "[pytest]\nprecision_metrics = rms_rel max_rel\nprecision_rtol = 0.2 max_rel=10\nprecision_atol = max_rel=1\n"
    )
    code, _, _, gate = gated(capsys, "diff", "old", "new")
    assert code == 0
    assert gate == (
        "gate: metrics rms_rel, max_rel (pytest.ini precision_metrics); rtol 0.2 (max_rel 10) (pytest.ini "
        "precision_rtol); atol 1e-05 (max_rel 1) (pytest.ini precision_atol); pytest config: pytest.ini"
    )
    # --rtol replaces the ini's rtol whole, as the plugin's option does; the ini's atol stays.
    code, out, _, gate = gated(capsys, "diff", "old", "new", "--rtol", "max_rel=5")
    assert code == 0 and "atol 1e-05 (max_rel 1) (pytest.ini precision_atol)" in gate  # max_rel atol 1 still hides it
    code, out, _, gate = gated(capsys, "diff", "old", "new", "--rtol", "max_rel=5", "--atol", "1e-5")
    assert code == 1 and f"== {TEST_A} [cpu]: 220 of 440 tensor metrics worse beyond rtol 0.1 (max_rel 5)" in out
    assert "; rtol 0.1 (max_rel 5) (--rtol); atol 1e-05 (--atol); " in gate


def test_addopts_wins_over_the_ini_key_as_on_the_command_line(
    capsys: pytest.CaptureFixture[str], project: Path
) -> None:
    (project / "pytest.ini").write_text(
        "[pytest]\naddopts = -p no:cacheprovider --precision-metrics=rms_rel,max_rel\nprecision_metrics = rms_rel\n"
    )
    code, _, _, gate = gated(capsys, "diff", "old", "new")
    assert code == 1 and "(pytest.ini addopts --precision-metrics)" in gate


def test_the_gate_is_what_pytest_resolves_addopts_environment_and_passed_on_options_included(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: the ini says precision_rtol = 0.5, its addopts -o 0.01 (which pytest 9 applies, pytest
    8.0 does not); NEW's rms_rel of one tensor is 1.3x OLD's. diff gates as the installed pytest does."""
    monkeypatch.chdir(tmp_path)
    write_baseline(tmp_path / "old", TEST_A)
    write_baseline(tmp_path / "new", TEST_A, factor=1.3)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -o precision_rtol=0.01\nprecision_rtol = 0.5\n")
    code, _, _, gate = gated(capsys, "diff", "old", "new")
    if int(pytest.__version__.split(".")[0]) >= 9:
        assert code == 1 and "; rtol 0.01 (pytest.ini addopts -o precision_rtol); " in gate
    else:
        assert code == 0 and "; rtol 0.5 (pytest.ini precision_rtol); " in gate
    # diff's -o and -c go to pytest; PYTEST_ADDOPTS is pytest's own.
    code, _, _, gate = gated(capsys, "diff", "old", "new", "-o", "precision_rtol=0.02")
    assert code == 1 and "; rtol 0.02 (command line -o precision_rtol); " in gate
    (tmp_path / "ci.ini").write_text("[pytest]\nprecision_rtol = 0.03\n")
    code, _, _, gate = gated(capsys, "diff", "old", "new", "-c", "ci.ini")
    assert code == 1 and gate.endswith(
        "; rtol 0.03 (ci.ini precision_rtol); atol 1e-05 (built-in); pytest config: ci.ini"
    )
    monkeypatch.setenv("PYTEST_ADDOPTS", "--precision-rtol=0.4")
    code, _, _, gate = gated(capsys, "diff", "old", "new")
    assert code == 0 and "; rtol 0.4 (PYTEST_ADDOPTS --precision-rtol); " in gate
    # With --metric, --rtol and --atol all given, pytest is not asked (nor its conftest.py files imported).
    monkeypatch.setenv("PYTEST_ADDOPTS", "--no-such-option")
    code, _, err = cli(capsys, "diff", "old", "new", "--metric", "rms_rel", "--rtol", "0.5")
    assert code == 2 and "unrecognized arguments: --no-such-option" in err
    code, _, _, gate = gated(capsys, "diff", "old", "new", "--metric", "rms_rel", "--rtol", "0.5", "--atol", "0")
    assert code == 0 and gate.endswith("pytest config: not asked (--metric, --rtol and --atol given)")


def test_a_configuration_pytest_refuses_exits_2_with_pytests_message(
    capsys: pytest.CaptureFixture[str], project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (project / "setup.cfg").write_text("[pytest]\nprecision_metrics = rms_rel max_rel\n")
    code, _, err = cli(capsys, "diff", "old", "new")
    assert code == 2 and err.startswith("pytest-precision diff: pytest refuses the project's configuration")
    assert err.endswith(
        ": [pytest] section in setup.cfg files is no longer supported, change to [tool:pytest] instead.\n"
    )
    (project / "setup.cfg").unlink()
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # pytest here runs without the plugin
    code, _, err = cli(capsys, "diff", "old", "new")
    assert code == 2 and "pytest here does not load pytest-precision, so no precision gate applies" in err


def test_diff_against_a_ref_gates_what_the_projects_ini_gates(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    (repo / "pyproject.toml").write_text('[tool.pytest.ini_options]\nprecision_metrics = "rms_rel max_rel"\n')
    write_baseline(repo / "baselines", TEST_A, max_rel=10.0)  # not committed: what the pull request changes
    code, out, _, gate = gated(capsys, "diff", "--against", "main")
    assert code == 1 and f"== {TEST_A} [cpu]: 220 of 440 tensor metrics worse beyond rtol 0.1" in out
    assert gate.endswith("pytest config: pyproject.toml")
    # From a subdirectory, the config file is found from PATH upward, as pytest finds it.
    (repo / "tests/sub").mkdir()
    os.chdir(repo / "tests/sub")
    code, _, _, gate = gated(capsys, "diff", "--against", "main", "../../baselines")
    assert code == 1 and gate.endswith(f"pytest config: {repo / 'pyproject.toml'}")


def test_the_config_file_is_the_one_pytest_would_read(capsys: pytest.CaptureFixture[str], project: Path) -> None:
    # In one folder pytest.ini comes first, even without the setting; a tox.ini without [pytest] is no config.
    (project / "pyproject.toml").write_text('[tool.pytest.ini_options]\nprecision_metrics = "rms_rel max_rel"\n')
    (project / "pytest.ini").write_text("[pytest]\n")
    assert gated(capsys, "diff", "old", "new")[0] == 0
    (project / "pytest.ini").unlink()
    (project / "tox.ini").write_text("[tox]\nenvlist = py\n")
    code, _, _, gate = gated(capsys, "diff", "old", "new")
    assert code == 1 and gate.endswith("pytest config: pyproject.toml")
    # A config file nearer the paths wins over one further up; a file above the common folder counts.
    (project / "old/pytest.ini").write_text("[pytest]\nprecision_metrics = rms_rel\n")
    assert gated(capsys, "diff", "old", "new")[0] == 1  # the common folder is project/
    (project / "new/pytest.ini").write_text("[pytest]\nprecision_metrics = rms_rel\n")
    assert gated(capsys, "diff", "new/tests/test_a/test_one.cpu.json", "new/tests/test_a/test_one.cpu.json")[3] == (
        "gate: metrics rms_rel (new/pytest.ini precision_metrics); rtol 0.1 (built-in); atol 1e-05 (built-in); "
        "pytest config: new/pytest.ini"
    )


def test_a_scratch_copy_elsewhere_still_gets_the_projects_config(
    capsys: pytest.CaptureFixture[str], project: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`git show main:x.json > /tmp/old.json; diff /tmp/old.json x.json`: their common folder holds no config;
    as pytest does, each path's own folder is then searched upward."""
    (project / "pytest.ini").write_text("[pytest]\nprecision_metrics = rms_rel max_rel\n")
    scratch = tmp_path_factory.mktemp("scratch") / "old.json"
    scratch.write_bytes((project / "old/tests/test_a/test_one.cpu.json").read_bytes())
    code, _, _, gate = gated(capsys, "diff", scratch, "new/tests/test_a/test_one.cpu.json")
    assert code == 1 and gate.endswith("pytest config: pytest.ini")


@pytest.mark.parametrize(
    ("ini", "message"),
    [
        ("precision_metrics = rms_rel max_rell", "precision_metrics: metrics: unknown metric 'max_rell'"),
        ("precision_metrics =", "ini precision_metrics (in {}/pytest.ini or -o) is empty (an unset variable?)"),
        ("precision_rtol = max_rel=0.1 max_rel=50", "precision_rtol: max_rel is given twice"),
        ("precision_atol = lots", "precision_atol must be a number, got 'lots'"),
    ],
)
def test_a_bad_gate_setting_in_the_config_file_exits_2_with_pytests_message(
    capsys: pytest.CaptureFixture[str], project: Path, ini: str, message: str
) -> None:
    (project / "pytest.ini").write_text(f"[pytest]\n{ini}\n")
    code, _, err = cli(capsys, "diff", "old", "new")
    assert code == 2 and err.startswith(
        f"pytest-precision diff: pytest refuses the project's configuration, so its gate is unknown (`python -m "
        f"pytest` in {project}, exit 4): {message.format(project)}"
    ), err


def test_a_metric_no_compared_file_holds_exits_2(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    old, new = trees
    for metric, why in (
        ("underflow_frac", "range statistics are measured with compare(..., range_stats=True) only"),
        ("rho", "cross-engine ones (rho, rms_e_*) in cross-engine reports"),
    ):
        code, _, err = cli(capsys, "diff", old, new, "--metric", "rms_rel", "--metric", metric)
        assert code == 2 and err.startswith(
            f"pytest-precision diff: --metric: no tensor of the compared files holds {metric}"
        )
        assert why in err
    one = "tests/test_a/test_one.cpu.json"
    code, _, err = cli(capsys, "diff", old / one, new / one, "--metric", "rho")
    assert code == 2 and "holds rho" in err
    assert cli(capsys, "diff", old, new, "--metric", "kl_mean")[0] == 0  # the logprob rows hold it


def test_an_unknown_metric_lists_every_metric(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    from pytest_precision.base.records import METRIC_DIRECTIONS

    code, _, err = cli(capsys, "diff", *trees, "--metric", "max_rell")
    assert code == 2 and err.startswith("pytest-precision diff: --metric: unknown metric(s) max_rell; choose from ")
    listed = err.split("choose from ")[1].strip().split(", ")
    assert listed == list(METRIC_DIRECTIONS)


def session_report(gates: dict[str, Any], **factors: float) -> dict[str, Any]:
    """A --precision-report document of TEST_A (every max_rel times factors["max_rel"]) whose entry records
    `gates` as its gate (none when empty)."""
    from pytest_precision.gate.baseline import json_ready

    content = document(report_from_document(json.loads(SOURCE.read_text()), SOURCE), TEST_A, {})
    for _, record in records(content):
        if record.get("max_rel") is not None:
            record["max_rel"] *= factors.get("max_rel", 1.0)
    report = report_from_document(content, SOURCE).to_dict()
    entry = {"baseline": "x.json", "reference": report["reference"], "variants": report["variants"]}
    if gates:
        entry["gate"] = gates
    written: dict[str, Any] = json_ready({"schema_version": 1, "baseline_dir": "baselines", "tests": {TEST_A: entry}})
    return written


def test_a_session_reports_recorded_gate_serves_where_nothing_else_sets_one(
    capsys: pytest.CaptureFixture[str], project: Path
) -> None:
    from pytest_precision.gate.tolerance_rules import ToleranceRules

    gate = {**ToleranceRules().to_dict(), "metrics": ["rms_rel", "max_rel"]}
    (project / "old.json").write_text(json.dumps(session_report(gate)))
    (project / "new.json").write_text(json.dumps(session_report(gate, max_rel=10.0)))
    code, out, _ = cli(capsys, "diff", "old.json", "new.json")
    assert code == 1
    recorded = "rtol 0.1 on rms_rel, max_rel (the gate its session report recorded)"
    assert f"== {TEST_A}: 220 of 440 tensor metrics worse beyond {recorded}" in out
    # The recorded gate's tolerances too: max_rel loose enough.
    loose = {**ToleranceRules(rtol={"max_rel": 10.0}).to_dict(), "metrics": ["rms_rel", "max_rel"]}
    (project / "new.json").write_text(json.dumps(session_report(loose, max_rel=10.0)))
    assert cli(capsys, "diff", "old.json", "new.json")[0] == 0
    # The recorded gate is what the test's gate checked (its call's metrics= over the config file's): it wins
    # over the config file, and --metric over both.
    (project / "pytest.ini").write_text("[pytest]\nprecision_metrics = rms_rel\nprecision_rtol = 50\n")
    (project / "new.json").write_text(json.dumps(session_report(gate, max_rel=10.0)))
    assert cli(capsys, "diff", "old.json", "new.json")[0] == 1
    assert cli(capsys, "diff", "old.json", "new.json", "--metric", "rms_rel")[0] == 0
    assert cli(capsys, "diff", "old.json", "new.json", "--metric", "max_rel")[0] == 1
    assert cli(capsys, "diff", "old.json", "new.json", "--rtol", "50")[0] == 0
    # A malformed recorded gate is named.
    (project / "pytest.ini").unlink()
    (project / "new.json").write_text(json.dumps(session_report({"metrics": ["max_rell"]}, max_rel=10.0)))
    code, _, err = cli(capsys, "diff", "old.json", "new.json")
    assert code == 2 and f"test {TEST_A}: its recorded gate is malformed (metrics: unknown metric 'max_rell'" in err


def test_a_tolerance_given_twice_is_refused(capsys: pytest.CaptureFixture[str], trees: Any) -> None:
    for text, message in (
        ("max_rel=0.1 max_rel=50", "max_rel is given twice in 'max_rel=0.1 max_rel=50'"),
        ("0.1 50", "two numbers for every metric in '0.1 50'"),
    ):
        for flag in ("--rtol", "--atol"):
            with pytest.raises(SystemExit):
                main(["diff", *map(str, trees), flag, text])
            assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_help_says_what_is_gated_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["diff", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the project's own gate" in text
    assert "else what the project's pytest resolves: diff runs `python -m pytest --precision-resolved-gate" in text
    assert "Where pytest refuses the configuration, diff exits 2 with pytest's message" in text
    assert "--metric, --rtol and --atol, each on its own; else, for a test of a session report" in text
    assert text.index("that gate (what the test checked") < text.index("what the project's pytest resolves")
