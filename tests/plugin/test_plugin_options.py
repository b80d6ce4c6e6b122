"""Options, header, tables, the GPU marker, xdist, and loading the plugin without importing torch."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from plugin_testing import SIMPLE_TEST, baseline_file, output, project, record_rows, run

GPU_TESTS = """
import pytest


@pytest.mark.precision_gpu
def test_on_gpu(precision_device):
    assert precision_device == "cuda"


def test_on_cpu(precision_device):
    assert precision_device == "cpu"
"""


def test_precision_gpu_marker_is_skipped_without_the_option(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gpu=GPU_TESTS)
    result = run(pytester, "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]1[]] test_gpu.py:*: precision_gpu: needs a CUDA device; run with --precision-gpu"]
    )
    markers = run(pytester, "--markers")
    markers.stdout.fnmatch_lines(
        [
            "@pytest.mark.precision(rtol=None, atol=None, isolate=None): tolerances of this test's precision gate "
            "(a number, or {metric: number}); isolate=True also measures each module's isolated error in precision.run",
            "@pytest.mark.precision_gpu: needs a CUDA device; runs only with --precision-gpu",
        ]
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize(("ini", "args"), [("", ["--precision-gpu"]), ("precision_gpu = true", [])])
def test_precision_gpu_without_cuda_is_a_usage_error(pytester, monkeypatch, ini, args):
    project(pytester, monkeypatch, test_gpu=GPU_TESTS)
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: --precision-gpu (or ini precision_gpu) needs a CUDA device, and torch sees none "
            f"(torch {torch.__version__}); run without it to test on CPU"
        ]
    )
    assert "Traceback" not in output(result)


def test_report_header(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    for args, mode in (([], "compare"), (["--update-baselines"], "update")):
        result = run(pytester, "--co", *args)
        (header,) = [line for line in result.outlines if line.startswith("precision:")]
        assert header.startswith(f"precision: torch {importlib.metadata.version('torch')}, ")
        assert ", device cpu, threads " in header
        assert header.endswith(f", baselines {pytester.path / 'baselines'} ({mode})")


def test_precision_tables(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    monkeypatch.setenv("TINY_VARIANTS", "bf16,fp16")
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    quiet = run(pytester)
    quiet.assert_outcomes(passed=1)
    assert "precision tables" not in quiet.stdout.str()

    lines = [
        "*=== precision tables ===*",
        "test_gate.py::test_name",
        "precision: rms_rel against the fp32 reference on cpu, in execution order",
        "  fw    first (embed)  mid median  mid max  last (norm)",
        "  bf16  *%  *%  *%  *%",
        "  fp16  *%  *%  *%  *%",
        "  bw    first (logits) * last (blocks.0)",
        "  grad  first (head.bias) * last (embed.weight)",
        # Gradients by category; the head has no get_output_embeddings(), so it counts as a linear weight.
        "  grad  lm_head  linear med  linear max  norm med  norm max  bias med  bias max  embedding  loss scale",
        "  bf16  *n/a *% *% *% *% *% *% *%  *-",  # no loss scale
        "  fp16  *n/a *% *% *% *% *% *% *%  *[1-9]*[0-9]",  # a loss scale
        "  logprob  rms_rel *bias_rel *resid_rel *corr *slope *max_abs *scale *delta_mean *delta_rms *delta_max"
        " *clip *kl_mean *top1",
        "  bf16 *%",
        "  fp16 *%",
        "  loss  rms_rel",
        "precision baselines (compare, baselines): 1 passed",
    ]
    result = run(pytester, "--precision-tables")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(lines)
    pytester.makeini("[pytest]\nprecision_tables = true\n")
    result = run(pytester)
    result.stdout.fnmatch_lines(lines)


def test_xdist_writes_and_compares(pytester, monkeypatch):
    pytest.importorskip("xdist")
    project(
        pytester,
        monkeypatch,
        test_many="""
        import pytest
        from tinymodel import run


        @pytest.mark.parametrize("variant", ["bf16", "fp16", "bf16_autocast", "fp16_fp32_head"])
        def test_variant(precision, assert_precision_within, variant):
            if variant == "fp16_fp32_head":
                variant = {"name": "fp16_fp32_head", "dtype": "float16", "fp32_modules": ["head"]}
            assert_precision_within(run(precision, variants=[variant]))
        """,
    )
    result = run(pytester, "-n", "2", "--update-baselines")
    result.assert_outcomes(passed=4)
    folder = pytester.path / "baselines" / "test_many"
    names = ["bf16", "fp16", "bf16_autocast", "fp16_fp32_head"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"test_variant_{n}.cpu.json" for n in names)
    for name in names:
        path = baseline_file(pytester, "test_many", f"test_variant_{name}")
        assert json.loads(path.read_text(encoding="utf-8"))["variant_order"] == [name]
        assert record_rows(path, name)[0] == ("embed", "fw")

    result = run(pytester, "-n", "2", "--precision-tables")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*=== precision tables ===*", "test_many.py::test_variant[[]*[]]", "  fw  *"])


def test_xdist_summary_line(pytester, monkeypatch):
    pytest.importorskip("xdist")
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    result = run(pytester, "-n", "1", "--update-baselines")
    result.assert_outcomes(passed=1)
    assert baseline_file(pytester, "test_gate", "test_name").exists()
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 written"])


def test_plugin_is_loaded_from_its_entry_point(pytester, monkeypatch):
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.name == "precision"]
    assert entry_point.value == "pytest_precision.plugin"

    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    result = run(pytester, "--help")
    result.stdout.fnmatch_lines(
        [
            "numerical precision gates (pytest-precision):",
            "  --update-baselines*",
            "  --precision-gpu*",
            "  --precision-baseline-dir=DIR*",
            "  --precision-update-mode={all,failing,missing}*",
            "  --precision-rtol=RTOL*",
            "  --precision-atol=ATOL*",
            "  --precision-metrics=METRICS*",
            "  --precision-fail-stale*",
            "  --precision-tables*",
        ]
    )
    result.stdout.fnmatch_lines(["  precision_baseline_dir (string):*"])
    assert "update_baselines (" not in result.stdout.str()

    result = run(pytester, "-p", "no:precision")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'precision' not found*"])


def test_importing_the_plugin_does_not_import_torch():
    code = textwrap.dedent(
        """
        import sys
        import pytest_precision.plugin
        import pytest_precision
        assert pytest_precision.__version__
        print(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_session_without_precision_tests_does_not_import_torch(pytester):
    pytester.makepyfile(
        test_plain="""
        import sys


        def test_no_torch():
            assert "torch" not in sys.modules
        """
    )
    # After the plugin's own session-end hooks: which of its modules a session without precision tests loaded.
    pytester.makeconftest(
        """
        import sys


        def pytest_unconfigure(config):
            loaded = sorted(m for m in sys.modules if m.startswith("pytest_precision.") or m == "torch")
            print("loaded:", " ".join(loaded))
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"precision: torch {importlib.metadata.version('torch')}, device cpu, threads *"])
    # The summary, stale-file and report paths return before importing the baseline, message, table and
    # metric modules (tens of milliseconds of a pytest start otherwise).
    result.stdout.fnmatch_lines(
        [
            "loaded: "
            + " ".join(
                f"pytest_precision.{name}"
                for name in (
                    "base",
                    "base.errors",
                    "base.torchao_notices",  # a logging filter, before transformers imports torchao
                    "plugin",
                    "plugin.assertion",
                    "plugin.launcher",
                    "plugin.options",
                    "plugin.precision_fixture",
                    "plugin.session",
                    "plugin.session_end",
                    "reports",
                    "reports.environment",
                )
            )
        ]
    )


def test_compare_is_importable_after_the_fixture_ran(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_order="""
        from tinymodel import tiny_batch, tiny_model


        def test_1_fixture(precision):
            precision.run(tiny_model(), tiny_batch(), variants=["bf16"])


        def test_2_function():
            from pytest_precision import compare

            assert compare(tiny_model(), tiny_batch(), ["bf16"]).variants == ["bf16"]
        """,
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("args", "given"),
    [
        # An unset CI variable: `--precision-metrics "$M"`. Read as "not given", it dropped the ini's metrics.
        (["--precision-metrics", ""], "--precision-metrics"),
        (["--precision-metrics=  "], "--precision-metrics"),
        (["--precision-rtol", ""], "--precision-rtol"),
        (["--precision-atol="], "--precision-atol"),
        (["--precision-baseline-dir", ""], "--precision-baseline-dir"),
        (["--precision-report", ""], "--precision-report"),
        (["-o", "precision_metrics="], "ini precision_metrics (in "),
        (["-o", "precision_rtol= "], "ini precision_rtol (in "),
        (["-o", "precision_baseline_dir="], "ini precision_baseline_dir (in "),
    ],
)
def test_an_empty_option_is_a_usage_error_naming_it(pytester, monkeypatch, args, given):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.makeini("[pytest]\nprecision_metrics = rms_rel max_rel\nprecision_rtol = 0.1\nprecision_atol = 1e-5\n")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert f"ERROR: {given}" in output(result)
    assert "is empty (an unset variable?): give it a value, or leave it out for the default" in output(result)
    assert "Traceback" not in output(result)


def test_an_empty_line_in_the_ini_is_a_usage_error(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.makeini("[pytest]\nprecision_metrics =\n")
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: ini precision_metrics (in {pytester.path / 'tox.ini'} or -o) is empty" in output(result)
    # Unset, every option has its default: the run goes ahead.
    pytester.makeini("[pytest]\n")
    run(pytester, "--update-baselines").assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("ini", "args", "message"),
    [
        ("", ["--precision-rtol", "max_rel=0.1 max_rel=50"], "precision_rtol: max_rel is given twice in"),
        ("", ["--precision-rtol=0.1 50"], "precision_rtol: two numbers for every metric in '0.1 50'"),
        ("precision_atol = 1e-5, max_abs=1 max_abs=2", [], "precision_atol: max_abs is given twice in"),
        ("precision_atol = 1e-5 1e-3", [], "precision_atol: two numbers for every metric in '1e-5 1e-3'"),
    ],
)
def test_a_tolerance_given_twice_at_one_level_is_a_usage_error(pytester, monkeypatch, ini, args, message):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert message in output(result)
