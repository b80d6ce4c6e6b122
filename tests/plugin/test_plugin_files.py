"""Files the plugin owns and no others: what --precision-prune may delete, which files are stale, legal baseline
names, one owner per file also under xdist, files that cannot be written, and --update-baselines owned by
another plugin or conftest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from plugin_testing import SIMPLE_TEST, assert_no_traceback, baseline_file, failure, output, project, run, stale_lines

TWO_TESTS = """
from tinymodel import run


def test_one(precision, assert_precision_within):
    assert_precision_within(run(precision))


def test_two(precision, assert_precision_within):
    assert_precision_within(run(precision))
"""


def copy_for(source: Path, target: Path, test: str, **changes: object) -> Path:
    """A copy of a baseline the plugin wrote, recording another test id (and other changed fields)."""
    document = json.loads(source.read_text(encoding="utf-8"))
    document.update(test=test, **changes)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document), encoding="utf-8")
    return target


def written_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, **tests: str) -> Path:
    """A project whose test_two.py baselines are written; returns test_one's file."""
    project(pytester, monkeypatch, test_two=TWO_TESTS, **tests)
    pytester.makeini("[pytest]\ntestpaths = .\n")
    run(pytester, "--update-baselines", "test_two.py").assert_outcomes(passed=2)
    return baseline_file(pytester, "test_two", "test_one")


def test_prune_deletes_only_files_the_plugin_wrote(pytester, monkeypatch):
    used = written_project(pytester, monkeypatch)
    folder = pytester.path / "baselines"
    orphan = copy_for(used, folder / "test_two" / "test_removed.cpu.json", "test_two.py::test_removed")
    foreign = {
        # Not the plugin's name pattern, even with a plugin document inside.
        "settings.json": json.dumps({"schema_version": 1, "test": "test_two.py::test_removed", "variants": {}}),
        "package.json": '{"name": "x", "version": "1.0.0"}',
        "test_two/notes.json": "[1, 2]",
        "test_two/test_removed.json": used.read_text(),
        # The plugin's name pattern, but not its document.
        "test_two/other_schema.cpu.json": json.dumps({"schema_version": 99, "test": "test_two.py::test_gone"}),
        "test_two/no_test_id.cpu.json": json.dumps({"schema_version": 1, "test": 42, "variants": {}}),
        "test_two/a_list.cpu.json": "[]",
        "test_two/broken.cpu.json": '{"schema_version": 1, "test": "test_two.py::test_gone", ',
        "README.md": "baselines, see the docs\n",
    }
    for name, text in foreign.items():
        (folder / name).write_text(text, encoding="utf-8")

    result = run(pytester, "--precision-prune")
    result.assert_outcomes(passed=2)
    assert stale_lines(result) == [
        "precision stale baselines: 1 (deleted (--precision-prune)):",
        "baselines/test_two/test_removed.cpu.json",
    ]
    assert not orphan.exists()
    assert used.exists()
    assert {name for name in foreign if (folder / name).exists()} == set(foreign)


def test_the_stale_check_keeps_other_devices_files_of_a_test_that_ran(pytester, monkeypatch):
    used = written_project(pytester, monkeypatch)
    gpu = copy_for(used, used.with_name("test_one.cuda-sm90.json"), "test_two.py::test_one")
    renamed = copy_for(used, used.with_name("test_old_name.cpu.json"), "test_two.py::test_one")

    result = run(pytester, "--precision-prune")
    result.assert_outcomes(passed=2)
    # The same test's cpu file under a stem it no longer uses is stale; its GPU file is not.
    assert stale_lines(result) == [
        "precision stale baselines: 1 (deleted (--precision-prune)):",
        "baselines/test_two/test_old_name.cpu.json",
    ]
    assert gpu.exists() and not renamed.exists()


TEST_X = "\n\ndef test_x():\n    pass\n"
MODULES_NOT_COLLECTED = {
    "test_broken": "import no_such_module_for_precision" + TEST_X,
    "test_skipped_module": "import pytest\n\npytest.skip('not here', allow_module_level=True)" + TEST_X,
    "test_importorskip": "import pytest\n\npytest.importorskip('no_such_module_for_precision')" + TEST_X,
    "test_ignored": TEST_X,
    "test_ignored_by_glob": TEST_X,
}


def test_files_of_tests_that_could_not_be_collected_are_not_stale(pytester, monkeypatch):
    used = written_project(pytester, monkeypatch, **MODULES_NOT_COLLECTED)
    pytester.mkpydir("sub")
    (pytester.path / "sub" / "test_in_ignored_folder.py").write_text("def test_x():\n    pass\n")
    kept = [
        copy_for(used, baseline_file(pytester, name, "test_x"), f"{name}.py::test_x") for name in MODULES_NOT_COLLECTED
    ]
    kept.append(
        copy_for(
            used,
            baseline_file(pytester, "sub/test_in_ignored_folder", "test_x"),
            "sub/test_in_ignored_folder.py::test_x",
        )
    )
    deselected = baseline_file(pytester, "test_two", "test_two")
    orphan = copy_for(used, baseline_file(pytester, "test_two", "test_removed"), "test_two.py::test_removed")
    args = [
        "--precision-prune",
        "--continue-on-collection-errors",
        "--ignore=test_ignored.py",
        "--ignore-glob=*_by_glob.py",
        "--ignore=sub",
        "--deselect=test_two.py::test_two",
    ]

    result = run(pytester, *args)
    result.assert_outcomes(passed=1, errors=1, skipped=2, deselected=1)
    assert stale_lines(result) == [
        "precision stale baselines: 1 (deleted (--precision-prune)):",
        "baselines/test_two/test_removed.cpu.json",
    ]
    assert not orphan.exists()
    assert [path for path in kept if not path.exists()] == []
    assert deselected.exists() and used.exists()


def test_under_xdist_the_workers_tell_the_controller_what_they_could_not_collect(pytester, monkeypatch):
    pytest.importorskip("xdist")
    names = ("test_skipped_module", "test_importorskip", "test_ignored")
    skipped = {name: MODULES_NOT_COLLECTED[name] for name in names}
    used = written_project(pytester, monkeypatch, **skipped)
    kept = [copy_for(used, baseline_file(pytester, name, "test_x"), f"{name}.py::test_x") for name in skipped]
    orphan = copy_for(used, baseline_file(pytester, "test_two", "test_removed"), "test_two.py::test_removed")

    result = run(pytester, "-n", "2", "--precision-prune", "--ignore=test_ignored.py")
    result.assert_outcomes(passed=2, skipped=2)
    assert stale_lines(result) == [
        "precision stale baselines: 1 (deleted (--precision-prune)):",
        "baselines/test_two/test_removed.cpu.json",
    ]
    assert not orphan.exists()
    assert [path for path in kept if not path.exists()] == []


def test_a_collection_error_in_a_folder_protects_the_whole_folder(pytester, monkeypatch):
    used = written_project(pytester, monkeypatch)
    pytester.mkpydir("pkg")
    (pytester.path / "pkg" / "conftest.py").write_text("raise RuntimeError('broken conftest')\n")
    (pytester.path / "pkg" / "test_deep.py").write_text("def test_x():\n    pass\n")
    kept = copy_for(used, baseline_file(pytester, "pkg/test_deep", "test_x"), "pkg/test_deep.py::test_x")
    orphan = copy_for(used, baseline_file(pytester, "test_two", "test_removed"), "test_two.py::test_removed")

    result = run(pytester, "--precision-prune", "--continue-on-collection-errors")
    result.assert_outcomes(passed=2, errors=1)
    assert not orphan.exists()
    assert kept.exists()


BAD_NAMES = """
import pytest
from tinymodel import run


@pytest.mark.parametrize("name", ["../outside", "/tmp/absolute", "sub/name", "a:b", "CON", "trailing.", "x" * 201])
def test_check(precision, assert_precision_within, name):
    assert_precision_within(run(precision), baseline=name)


def test_run(precision):
    precision.run(None, None, baseline="..\\\\up")
"""


def test_bad_baseline_names_fail_before_anything_is_written(pytester, monkeypatch):
    project(pytester, monkeypatch, test_names=BAD_NAMES)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(failed=8)
    expected = {
        "test_check[../outside]": "baseline='../outside' cannot name a baseline file: it climbs out of the baseline "
        "folder with '..'.",
        "test_check[/tmp/absolute]": "baseline='/tmp/absolute' cannot name a baseline file: it is an absolute path.",
        "test_check[sub/name]": "baseline='sub/name' cannot name a baseline file: it holds a path separator ('/' or "
        "'\\'); subfolders are not supported.",
        "test_check[a:b]": "baseline='a:b' cannot name a baseline file: it holds ':', not allowed in a file name on "
        "every system.",
        "test_check[CON]": "baseline='CON' cannot name a baseline file: 'CON' is a device name Windows reserves.",
        "test_check[trailing.]": "baseline='trailing.' cannot name a baseline file: it ends with a dot or a space "
        "(Windows drops those).",
        "test_run": "baseline='..\\\\up' cannot name a baseline file: it climbs out of the baseline folder with '..'.",
    }
    for test, headline in expected.items():
        first = failure(result, test)[0]
        assert first.startswith(f"ConfigurationError: {headline} Give a plain file name stem"), (test, first)
    long_name = [line for line in result.outlines if line.startswith("ConfigurationError: baseline='xxxx")]
    assert long_name and "it is 201 bytes long in UTF-8, more than the 200 that fit every filesystem" in long_name[0]
    assert_no_traceback(result)
    assert not (pytester.path / "baselines").exists()
    assert sorted(p.name for p in pytester.path.parent.iterdir() if p.name.endswith(".json")) == []
    assert not Path("/tmp/absolute.cpu.json").exists()


def test_a_long_parametrized_id_gets_a_short_stable_file_name(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_long="""
        import pytest
        from tinymodel import run


        @pytest.mark.parametrize("case", [1, 2], ids=["a" * 300, "a" * 299 + "b"])
        def test_case(precision, assert_precision_within, case):
            assert_precision_within(run(precision))
        """,
    )
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=2)
    names = sorted(p.name for p in (pytester.path / "baselines" / "test_long").iterdir())
    assert len(names) == 2
    for name in names:
        assert len(name.encode()) == 200 + len(".cpu.json")
        assert name.startswith("test_case_aaaa") and name[-22:-9].startswith("-")
    result = run(pytester)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["precision baselines (compare, baselines): 2 passed"])


def test_two_tests_on_two_xdist_workers_cannot_share_a_file(pytester, monkeypatch):
    pytest.importorskip("xdist")
    project(
        pytester,
        monkeypatch,
        test_share="""
        import pytest
        from tinymodel import run


        @pytest.mark.xdist_group("first")
        def test_one(precision, assert_precision_within):
            assert_precision_within(run(precision), baseline="same")


        @pytest.mark.xdist_group("second")
        def test_two(precision, assert_precision_within):
            assert_precision_within(run(precision), baseline="same")
        """,
    )
    for args in (("--update-baselines",), ()):
        result = run(pytester, "-n", "2", "--dist", "loadgroup", *args)
        # Each worker sees one of the two tests, so each passes there; the controller sees both owners.
        result.assert_outcomes(passed=2)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        (line,) = [line for line in result.outlines if line.startswith("precision error:")]
        assert line.startswith("precision error: test_share.py::test_")
        assert line.endswith(
            " (on different xdist workers) share the baseline file baselines/test_share/same.cpu.json; give one of "
            "them its own baseline='...'"
        )
        assert "test_share.py::test_one" in line and "test_share.py::test_two" in line
        result.stdout.fnmatch_lines(["*= 2 passed in *"])


def test_a_folder_where_the_baseline_file_should_be(pytester, monkeypatch):
    project(pytester, monkeypatch, test_two=TWO_TESTS)
    (pytester.path / "baselines" / "test_two" / "test_one.cpu.json").mkdir(parents=True)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert failure(result, "test_one")[0] == (
        "BaselineError: cannot write precision baseline baselines/test_two/test_one.cpu.json (Is a directory: "
        f"{pytester.path / 'baselines' / 'test_two' / 'test_one.cpu.json'}); make its folder writable and the "
        "path free for a file, or choose another folder with --precision-baseline-dir"
    )
    result.stdout.fnmatch_lines(
        ["precision baselines (update, baselines): 1 written, 1 failed", "*= 1 failed, 1 passed*"]
    )
    assert_no_traceback(result)


def test_a_file_where_the_baseline_folder_should_be(pytester, monkeypatch):
    project(pytester, monkeypatch, test_two=TWO_TESTS)
    (pytester.path / "baselines").mkdir()
    (pytester.path / "baselines" / "test_two").write_text("a file\n")
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(failed=2)
    first = failure(result, "test_one")[0]
    assert first.startswith("BaselineError: cannot write precision baseline baselines/test_two/test_one.cpu.json (")
    assert "File exists" in first or "Not a directory" in first
    assert_no_traceback(result)


def test_a_read_only_baseline_folder(pytester, monkeypatch):
    # Tests run as root here, where chmod cannot make a folder read-only: refuse the rename instead, as a
    # read-only folder (or a file system mounted read-only) would.
    project(pytester, monkeypatch, test_two=TWO_TESTS)
    replace = os.replace

    def read_only(source, target):
        if str(target).endswith("test_one.cpu.json"):
            raise PermissionError(13, "Permission denied", str(target))
        return replace(source, target)

    monkeypatch.setattr(os, "replace", read_only)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    assert failure(result, "test_one")[0] == (
        "BaselineError: cannot write precision baseline baselines/test_two/test_one.cpu.json (Permission denied: "
        f"{pytester.path / 'baselines' / 'test_two' / 'test_one.cpu.json'}); make its folder writable and the "
        "path free for a file, or choose another folder with --precision-baseline-dir"
    )
    assert sorted(p.name for p in (pytester.path / "baselines" / "test_two").iterdir()) == ["test_two.cpu.json"]


def test_a_name_too_long_for_the_file_system(pytester, monkeypatch):
    # baseline= names are capped at 200 bytes, but a deep --precision-baseline-dir can still exceed the limit
    # of the path as a whole: the OS error names the file.
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    deep = "/".join(["d" * 250] * 20)
    result = run(pytester, "--update-baselines", f"--precision-baseline-dir={deep}")
    result.assert_outcomes(failed=1)
    first = failure(result, "test_name")[0]
    assert first.startswith("BaselineError: cannot write precision baseline ")
    assert "File name too long" in first
    assert_no_traceback(result)


def test_a_report_folder_that_is_a_file_is_a_usage_error(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.path.joinpath("out").write_text("a file\n")
    result = run(pytester, "--precision-report", "out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: --precision-report (or ini precision_report) out: {pytester.path / 'out'} is a file, not a folder*"]
    )


def test_a_baseline_folder_that_is_a_file_is_a_usage_error(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.path.joinpath("baselines").write_text("a file\n")
    result = run(pytester, "--update-baselines")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --precision-baseline-dir (or ini precision_baseline_dir): "
            f"{pytester.path / 'baselines'} is a file, not a folder"
        ]
    )
    assert pytester.path.joinpath("baselines").read_text() == "a file\n"


def test_a_report_that_cannot_be_written_fails_the_run_with_one_line(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    pytester.path.joinpath("blocker").write_text("a file\n")
    result = run(pytester, "--precision-report", "blocker/out")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            f"precision error: precision report not written to {pytester.path / 'blocker' / 'out'}: [Errno 20] Not a "
            f"directory: '{pytester.path / 'blocker' / 'out'}'",
            "*= 1 passed in *",
        ]
    )
    assert_no_traceback(result)


def test_a_step_summary_that_is_a_folder_fails_the_run_with_one_line(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    summary = pytester.mkdir("step-summary")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = run(pytester, "--precision-report", "out")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            f"precision error: precision report not written to {pytester.path / 'out'}: [Errno 21] cannot append "
            f"the summary to GITHUB_STEP_SUMMARY (Is a directory): '{summary}'",
            "*= 1 passed in *",
        ]
    )
    assert (pytester.path / "out" / "precision-report.json").is_file()
    assert (pytester.path / "out" / "summary.md").is_file()
    assert_no_traceback(result)


def test_leftovers_of_an_interrupted_update_are_removed_by_the_next_one(pytester, monkeypatch):
    used = written_project(pytester, monkeypatch)
    folder = used.parent
    dead_pid = 2**22 + 12345  # above Linux's pid_max: no such process
    leftover = folder / f".test_one.cpu.json.{dead_pid}.k2j4_x9a.precision-tmp"
    leftover.write_text('{"schema_version": 1, "te')
    os.utime(leftover, (0, 0))
    elsewhere = pytester.path / "baselines" / f".x.cpu.json.{dead_pid}.abcdefgh.precision-tmp"
    elsewhere.write_text("")
    os.utime(elsewhere, (0, 0))

    result = run(pytester)  # compare runs leave them alone
    result.assert_outcomes(passed=2)
    assert leftover.exists() and elsewhere.exists()
    result = run(pytester, "--update-baselines")  # every file unchanged: the sweep at the end removes them
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 2 unchanged"])
    assert not leftover.exists() and not elsewhere.exists()


CONFTEST_OPTION = """
def pytest_addoption(parser):
    parser.addoption("--update-baselines", action="store_true", help="the project's own snapshot refresh")
"""

OTHER_PLUGIN = """
def pytest_addoption(parser):
    parser.getgroup("snapshots").addoption("--update-baselines", action="store_true", dest="snapshots_update")
"""

OWN_OPTION_TEST = """
from tinymodel import run


def test_name(precision, assert_precision_within, request):
    print("project option:", request.config.getoption("--update-baselines"))
    assert_precision_within(run(precision))
"""


@pytest.mark.parametrize("where", ["conftest", "plugin", "conftest loading this plugin"])
def test_update_baselines_defined_elsewhere_leaves_precision_update(pytester, monkeypatch, where):
    project(pytester, monkeypatch, test_gate=OWN_OPTION_TEST)
    args: tuple[str, ...] = ()
    if where == "conftest":
        pytester.makeconftest(CONFTEST_OPTION)
    elif where == "conftest loading this plugin":
        # Loaded by a conftest's pytest_plugins (not by its entry point), after the conftest's own option.
        pytester.makeconftest(CONFTEST_OPTION + '\npytest_plugins = ["pytest_precision.plugin"]\n')
        args = ("-p", "no:precision")
    else:
        pytester.makepyfile(otherplugin=OTHER_PLUGIN)
        monkeypatch.syspath_prepend(pytester.path)
        args = ("-p", "otherplugin")
    note = (
        "precision note: --update-baselines belongs to another plugin or conftest here and keeps its meaning "
        "there; write precision baselines with --precision-update"
    )

    result = run(pytester, *args, "-s", "--update-baselines")
    result.assert_outcomes(failed=1)  # the project's option: this plugin compares, and no baseline exists yet
    result.stdout.fnmatch_lines(["*project option: True", note, "precision baselines (compare, baselines): 1 missing"])
    assert output(result).count("--update-baselines belongs to another plugin") == 1
    assert not (pytester.path / "baselines").exists()
    # The failure tells the command that works here, not the project's own --update-baselines.
    result.stdout.fnmatch_lines(["*Create it with: pytest test_gate.py::test_name --precision-update*"])

    result = run(pytester, *args, "-s", "--precision-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*project option: False", note, "precision baselines (update, baselines): 1 written"])
    assert baseline_file(pytester, "test_gate", "test_name").exists()


def test_loaded_from_a_conftest_the_plugin_still_has_update_baselines(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.makeconftest('pytest_plugins = ["pytest_precision.plugin"]\n')
    result = run(pytester, "-p", "no:precision", "--update-baselines")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 written"])
    assert "precision note" not in output(result)


def test_precision_update_is_the_same_as_update_baselines(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    result = run(pytester, "--precision-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 written"])
    assert "precision note" not in output(result)
    result = run(pytester, "--update-baselines")
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 unchanged"])
    result = run(pytester, "--help")
    result.stdout.fnmatch_lines(
        ["numerical precision gates (pytest-precision):", "  --update-baselines*", "  --precision-update*"]
    )
