"""The gate itself: an injected regression fails with a readable message; tolerances, limits and errors."""

from __future__ import annotations

import json
import re

import pytest
from plugin_testing import (
    SIMPLE_TEST,
    assert_no_traceback,
    baseline_file,
    degrade,
    failed_tests,
    failure,
    output,
    project,
    run,
    table_rows,
)


def test_injected_regression_names_the_first_degraded_tensor(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    written = baseline_file(pytester, "test_gate", "test_name").read_bytes()

    degrade(monkeypatch)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_name")
    assert re.fullmatch(
        r"precision regressed: \d+ / 23 tensors \(\d+\.\d%\) in 1 variant\(s\); first: bf16 blocks\.1 \(fw\)",
        section[0],
    ), section[0]
    rows = table_rows(section)
    assert rows[0][:4] == ["bf16", "blocks.1", "fw", "rms_rel"]
    assert rows[0][6].endswith("x") and float(rows[0][6][:-1]) > 2  # the ratio: at least doubled
    # Rows in execution order: forward, log-probabilities, loss, backward, gradients; block 0 and the
    # embedding are untouched.
    kinds = [row[2] for row in rows]
    assert kinds == sorted(kinds, key=["fw", "logprob", "loss", "bw", "grad"].index)
    assert ["bf16", "blocks.0", "fw"] not in [row[:3] for row in rows]
    assert ["bf16", "embed", "fw"] not in [row[:3] for row in rows]
    assert ["bf16", "blocks.1", "bw"] in [row[:3] for row in rows]
    assert section[-2:] == [
        "Baseline: baselines/test_gate/test_name.cpu.json",
        "If the change is intended, refresh it: pytest test_gate.py::test_name --update-baselines",
    ]
    result.stdout.fnmatch_lines(
        [
            "precision baselines (compare, baselines): 1 failed",
            "FAILED test_gate.py::test_name - Failed: precision regressed: *",
        ]
    )
    assert_no_traceback(result)
    # A compare run never touches the baseline.
    assert baseline_file(pytester, "test_gate", "test_name").read_bytes() == written


TOLERANCE_TESTS = """
import pytest
from tinymodel import run

EVERY_KIND = {kind: {"rtol": 100} for kind in ("fw", "logprob", "loss", "bw", "grad")}


def test_default(precision, assert_precision_within):
    assert_precision_within(run(precision))


def test_call_rtol(precision, assert_precision_within):
    assert_precision_within(run(precision), rtol=100)


@pytest.mark.precision(rtol=100)
def test_marker(precision, assert_precision_within):
    assert_precision_within(run(precision))


@pytest.mark.precision(rtol=100)
def test_call_beats_marker(precision, assert_precision_within):
    assert_precision_within(run(precision), rtol=0)


def test_block_1_only(precision, assert_precision_within):
    assert_precision_within(run(precision), tolerances={r"blocks\\.1": {"rtol": 100}})


def test_every_kind(precision, assert_precision_within):
    assert_precision_within(run(precision), tolerances=EVERY_KIND)


@pytest.mark.precision(rtol=100)
def test_tensor_beats_marker(precision, assert_precision_within):
    assert_precision_within(run(precision), tolerances={"fw": {"rtol": 0}})


def test_call_beats_tensor(precision, assert_precision_within):
    assert_precision_within(run(precision), rtol=100, tolerances={"fw": {"rtol": 0}})


def test_atol(precision, assert_precision_within):
    assert_precision_within(run(precision), atol=1.0)


@pytest.mark.precision(rtol=0)
def test_marker_beats_ini(precision, assert_precision_within):
    assert_precision_within(run(precision))
"""


def _degraded_tolerance_project(pytester, monkeypatch):
    project(pytester, monkeypatch, test_tol=TOLERANCE_TESTS)
    run(pytester, "--update-baselines").assert_outcomes(passed=10)
    degrade(monkeypatch)


def test_tolerance_precedence(pytester, monkeypatch):
    _degraded_tolerance_project(pytester, monkeypatch)
    result = run(pytester)
    assert failed_tests(result) == [
        "test_block_1_only",
        "test_call_beats_marker",
        "test_default",
        "test_marker_beats_ini",
        "test_tensor_beats_marker",
    ]
    result.assert_outcomes(passed=5, failed=5)
    result.stdout.fnmatch_lines(["precision baselines (compare, baselines): 5 passed, 5 failed"])

    # The regex covers block 1's rows of every kind (fw, bw and its parameters' gradients), but the error
    # propagates: block 2 is now the first row, and nothing of block 1 is left in the table.
    block_1_only = failure(result, "test_block_1_only")
    assert block_1_only[0].endswith("first: bf16 blocks.2 (fw)")
    rows = table_rows(block_1_only)
    assert rows[0][:3] == ["bf16", "blocks.2", "fw"]
    assert not [row for row in rows if row[1].startswith("blocks.1")]
    # A per-tensor tolerance beats the marker: only forward rows fail.
    assert {row[2] for row in table_rows(failure(result, "test_tensor_beats_marker"))} == {"fw"}
    assert table_rows(failure(result, "test_call_beats_marker"))[0][:3] == ["bf16", "blocks.1", "fw"]
    # The allowed column is baseline * (1 + rtol) + atol: rtol=0 leaves the default atol 1e-5.
    row = table_rows(failure(result, "test_call_beats_marker"))[0]
    assert float(row[7]) == pytest.approx(float(row[4]) + 1e-5, rel=1e-3)


INI_TESTS = """
import pytest
from tinymodel import run


def test_default(precision, assert_precision_within):
    assert_precision_within(run(precision))


@pytest.mark.precision(rtol=0)
def test_marker(precision, assert_precision_within):
    assert_precision_within(run(precision))
"""


def test_tolerance_ini_and_command_line(pytester, monkeypatch):
    # Below the marker: command line > ini > default; the marker's rtol=0 beats both.
    project(pytester, monkeypatch, test_tol=INI_TESTS)
    run(pytester, "--update-baselines").assert_outcomes(passed=2)
    degrade(monkeypatch)
    cases = [
        ("precision_rtol = 100", [], ["test_marker"]),
        ("", ["--precision-rtol", "100"], ["test_marker"]),
        ("precision_rtol = 100", ["--precision-rtol=0"], ["test_default", "test_marker"]),
        ("precision_atol = 1", [], []),
    ]
    for ini, args, failed in cases:
        pytester.makeini(f"[pytest]\n{ini}\n")
        result = run(pytester, *args)
        assert failed_tests(result) == failed, (ini, args)
        result.assert_outcomes(passed=2 - len(failed), failed=len(failed))


CALL_METRICS_TESTS = """
from tinymodel import run


def test_call_gates_max_rel(precision, assert_precision_within):
    assert_precision_within(run(precision), metrics=["rms_rel", "max_rel"])


def test_call_gates_rms_rel(precision, assert_precision_within):
    assert_precision_within(run(precision), metrics=["rms_rel"])


def test_session_metrics(precision, assert_precision_within):
    assert_precision_within(run(precision))
"""


def test_a_calls_metrics_win_over_the_ini_and_the_command_line(pytester, monkeypatch):
    """metrics= of a call is what its gate checks, whatever the ini or the command line say; a call that names
    none gets theirs (command line > ini > rms_rel). The session report's gate.metrics says what was gated."""
    project(pytester, monkeypatch, test_call_metrics=CALL_METRICS_TESTS)
    run(pytester, "--update-baselines").assert_outcomes(passed=3)
    for path in (pytester.path / "baselines/test_call_metrics").iterdir():
        document = json.loads(path.read_text(encoding="utf-8"))
        for entry in document["variants"].values():
            for record in entry["records"]:
                if record.get("max_rel"):
                    record["max_rel"] /= 10  # this run's max_rel is 10x the baseline's; rms_rel as it was
        path.write_text(json.dumps(document, indent=1), encoding="utf-8")
    both = ["rms_rel", "max_rel"]
    cases = [
        ("precision_metrics = rms_rel", [], ["rms_rel"], ["test_call_gates_max_rel"]),
        ("precision_metrics = rms_rel max_rel", [], both, ["test_call_gates_max_rel", "test_session_metrics"]),
        ("", ["--precision-metrics", "rms_rel,max_rel"], both, ["test_call_gates_max_rel", "test_session_metrics"]),
        ("precision_metrics = max_rel", ["--precision-metrics=rms_rel"], ["rms_rel"], ["test_call_gates_max_rel"]),
    ]
    for ini, args, session_metrics, failed in cases:
        pytester.makeini(f"[pytest]\n{ini}\n")
        result = run(pytester, "--precision-report", "report", *args)
        assert failed_tests(result) == failed, (ini, args, output(result))
        if "test_call_gates_max_rel" in failed:
            rows = table_rows(failure(result, "test_call_gates_max_rel"))
            assert {row[3] for row in rows} == {"max_rel"}
        report = json.loads((pytester.path / "report/precision-report.json").read_text(encoding="utf-8"))
        gated = {nodeid.split("::")[1]: entry["gate"]["metrics"] for nodeid, entry in report["tests"].items()}
        assert gated == {
            "test_call_gates_max_rel": both,
            "test_call_gates_rms_rel": ["rms_rel"],
            "test_session_metrics": session_metrics,
        }, (ini, args)


def test_bad_marker_and_tolerance_arguments(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_bad="""
        import pytest
        from tinymodel import run


        @pytest.mark.precision(rtl=1)
        def test_marker_typo(precision, assert_precision_within):
            assert_precision_within(run(precision))


        def test_tolerance_typo(precision, assert_precision_within):
            assert_precision_within(run(precision), tolerances={"fw": {"rtl": 1}})


        def test_metric_typo(precision, assert_precision_within):
            assert_precision_within(run(precision), metrics=["rms_rell"])
        """,
    )
    pytester.makeini("[pytest]\nprecision_rtol = lots\n")
    result = run(pytester, "--update-baselines")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "precision_rtol must be a number, got 'lots'" in output(result)

    (pytester.path / "tox.ini").unlink()
    # The marker, the tolerances and the gated metrics are all checked in both modes: a typo never passes.
    run(pytester, "--update-baselines").assert_outcomes(failed=3)
    result = run(pytester)
    result.assert_outcomes(failed=3)
    text = output(result)
    assert "ConfigurationError: @pytest.mark.precision takes the keywords rtol, atol, isolate only, got ['rtl']" in text
    assert "ConfigurationError: tolerances['fw']: unknown key 'rtl'; use 'rtol' and/or 'atol', or metric names" in text
    assert "ConfigurationError: metrics: unknown metric 'rms_rell'; gateable metrics: " in text
    assert_no_traceback(result)


LIMIT_TESTS = """
from tinymodel import run


def test_limit(precision, assert_precision_within):
    assert_precision_within(run(precision), limits={"fw": {"rms_rel": 1e-9}})


def test_loose_limit(precision, assert_precision_within):
    assert_precision_within(run(precision), limits={"fw": {"rms_rel": 0.5}, "head": {"correlation": 0.9}})


def test_no_such_tensor(precision, assert_precision_within):
    assert_precision_within(run(precision), limits={"decoder_layers": {"rms_rel": 1}})
"""


def test_limits_hold_without_a_baseline(pytester, monkeypatch):
    project(pytester, monkeypatch, test_limits=LIMIT_TESTS)
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=2)
    section = failure(result, "test_limit")
    assert section[0] == "precision limits exceeded by 5 tensor metric(s) (limits hold without a baseline)"
    assert [row[:3] for row in table_rows(section)] == [
        ["bf16", "embed", "fw"],
        ["bf16", "blocks.0", "fw"],
        ["bf16", "blocks.1", "fw"],
        ["bf16", "blocks.2", "fw"],
        ["bf16", "norm", "fw"],
    ]
    assert {(row[3], row[4], row[-1]) for row in table_rows(section)} == {("rms_rel", "(limit)", "1e-09")}
    no_match = [line for line in failure(result, "test_no_such_tensor") if line.startswith("ConfigurationError")]
    assert no_match == [
        "ConfigurationError: limits: 'decoder_layers' matches no tensor name or kind of this report "
        "(kinds: routing, fw, logprob, loss, bw, grad, weight_cast, routing_isolated, fw_isolated, bw_isolated, "
        "grad_isolated; "
        "names are matched with re.search)"
    ]
    assert_no_traceback(result)
    # A limit key that matches nothing is an error before anything is written, and a run breaking its limits
    # is not written as the expectation.
    assert not baseline_file(pytester, "test_limits", "test_no_such_tensor").exists()
    assert not baseline_file(pytester, "test_limits", "test_limit").exists()
    assert section[-1] == "Not written: baselines/test_limits/test_limit.cpu.json"
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 written, 2 failed"])

    # Without a baseline in compare mode, the limits are reported beside the missing file.
    result = run(pytester, "test_limits.py::test_limit")
    result.assert_outcomes(failed=1)
    section = failure(result, "test_limit")
    assert section[0] == "no precision baseline for test_limits.py::test_limit"
    assert any(line.startswith("precision limits exceeded by 5 tensor metric(s)") for line in section)
    run(pytester, "test_limits.py::test_loose_limit").assert_outcomes(passed=1)


def test_unknown_variant_lists_the_builtins(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_typo="""
        from tinymodel import run


        def test_bf17(precision, assert_precision_within):
            assert_precision_within(run(precision, variants=["bf17"]))
        """,
    )
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(failed=1)
    section = failure(result, "test_bf17")
    assert len(section) < 10
    message = (
        "ConfigurationError: variants: unknown variant 'bf17'. Built-in variants: fp64, fp32, tf32, bf16, fp16, "
        "bf16_autocast, fp16_autocast, bf16_fp32_head, fp16_fp32_head, bf16_reduced_reduction, fp32_eager, "
        "fp32_sdpa, bf16_eager, bf16_sdpa, fsdp_bf16, fsdp_bf16_reduce_bf16, fp32_decode, bf16_decode, fp16_decode, "
        "bf16_fp32_head_decode, fp32_batch_alone, bf16_batch_alone, fp32_left_padded, bf16_left_padded, "
        "fp8_tensorwise, fp8_rowwise, fp8_rowwise_gw_hp, int8_weight_only, int8_dynamic, fp8_weight_only, "
        "fp8_dynamic, fp8_e4m3_weights, fp8_e5m2_weights, fp32_replay, bf16_replay, fp32_compiled, bf16_compiled, "
        "bf16_compiled_emulated, bf16_compiled_aot_eager; or pass "
        "pytest_precision.Variant(name=..., dtype=..., ...)"
    )
    assert message in section
    assert "precision tables" not in result.stdout.str()
    assert "Traceback" not in output(result)
    assert not (pytester.path / "baselines").exists()


@pytest.mark.parametrize("where", ["precision.run", "assert_precision_within"])
def test_precision_errors_are_shown_once(pytester, monkeypatch, where):
    project(
        pytester,
        monkeypatch,
        test_errors="""
        from tinymodel import run


        def test_error(precision, assert_precision_within):
            if WHERE == "precision.run":
                run(precision, variants=["bf17"])
            else:
                assert_precision_within(run(precision), limits={"decoder_layers": {"rms_rel": 1}})
        """.replace("WHERE", repr(where)),
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    assert "During handling of the above exception" not in output(result)
    (line,) = [line for line in failure(result, "test_error") if line.strip()]
    assert line.startswith("ConfigurationError: ")


def test_importable_assert_precision_within(pytester, monkeypatch):
    project(
        pytester,
        monkeypatch,
        test_imported="""
        from tinymodel import run

        from pytest_precision import assert_precision_within


        def test_name(precision):
            assert_precision_within(run(precision))


        def test_limits(precision):
            assert_precision_within(run(precision), baseline="with_limits", limits={"fw": {"rms_rel": 1e-9}})
        """,
    )
    result = run(pytester)
    result.assert_outcomes(failed=2)
    assert failure(result, "test_name")[:2] == [
        "no precision baseline for test_imported.py::test_name",
        "expected: baselines/test_imported/test_name.cpu.json",
    ]
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["precision baselines (update, baselines): 1 written, 1 failed"])
    assert failure(result, "test_limits")[0].startswith("precision limits exceeded by 5 tensor metric(s)")
    assert baseline_file(pytester, "test_imported", "test_name").exists()
    assert not baseline_file(pytester, "test_imported", "with_limits").exists()
    run(pytester, "-k", "test_name").assert_outcomes(passed=1)

    degrade(monkeypatch)
    result = run(pytester, "-k", "test_name")
    result.assert_outcomes(failed=1)
    assert failure(result, "test_name")[0].endswith("first: bf16 blocks.1 (fw)")


LLAMA_TEST = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pytest_precision import Variant


def tiny_llama(dtype=torch.float32, device="cpu"):
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def coarse_layer_1(model):
    layer = model.model.layers[1]
    forward = layer.forward

    def rounded(*args, **kwargs):
        out = forward(*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        hidden = hidden.to(torch.float8_e4m3fn).to(hidden.dtype)
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    layer.forward = rounded
    return model


def test_llama(precision, assert_precision_within):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    variants = ["bf16", "bf16_fp32_head"]
    if DEGRADE:
        variants[0] = Variant(name="bf16", dtype="bfloat16", prepare=coarse_layer_1)
    report = precision.run(tiny_llama(), {"input_ids": ids, "labels": ids}, variants=variants)
    assert_precision_within(report)
"""


@pytest.fixture(scope="module")
def transformers_loaded():
    """transformers and what a Llama run loads lazily, imported before the pytester fixture starts."""
    transformers = pytest.importorskip("transformers")
    import torch

    from pytest_precision import compare

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    ids = torch.zeros(1, 4, dtype=torch.long)
    compare(transformers.LlamaForCausalLM(config).eval(), {"input_ids": ids, "labels": ids}, ["bf16"])


def test_tiny_hf_llama(transformers_loaded, pytester, monkeypatch):
    project(pytester, monkeypatch, test_llama=LLAMA_TEST.replace("DEGRADE", "False"))
    result = run(pytester, "--update-baselines", "--precision-tables")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*= precision tables =*",
            "test_llama.py::test_llama",
            "  fw * first (model.embed_tokens) * last (lm_head)",
            "  bf16 *",
            "  bf16_fp32_head *",
            "precision baselines (update, baselines): 1 written",
        ]
    )
    path = baseline_file(pytester, "test_llama", "test_llama")
    names = [line for line in path.read_text(encoding="utf-8").splitlines() if '"kind": "fw"' in line]
    assert [re.search(r'"name": "([^"]+)"', line)[1] for line in names[:5]] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    run(pytester).assert_outcomes(passed=1)

    pytester.makepyfile(test_llama=LLAMA_TEST.replace("DEGRADE", "True"))
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_llama")
    assert section[0].endswith("in 1 variant(s); first: bf16 model.layers.1 (fw)")
    assert table_rows(section)[0][:3] == ["bf16", "model.layers.1", "fw"]
    assert_no_traceback(result)


KL_STATISTICS_TEST = """
from tinymodel import run

METRICS = ["kl_p99", "kl_median", "dp_rms", "dp_p1", "ppl_ratio", "ln_ppl_corr", "top1_agreement"]


def test_name(precision, assert_precision_within):
    assert_precision_within(run(precision), metrics=METRICS, tolerances={"fw": {"rtol": 100}})
"""


def test_the_kl_divergence_statistics_are_gated_and_written(pytester, monkeypatch):
    """llama.cpp's statistics gate like any metric: written to the baseline, held, and a degraded bf16 fails on
    the logprob row's KL percentiles."""
    project(pytester, monkeypatch, test_gate=KL_STATISTICS_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    document = json.loads(baseline_file(pytester, "test_gate", "test_name").read_text())
    (logprob,) = [r for r in document["variants"]["bf16"]["records"] if r["kind"] == "logprob"]
    assert {"kl_p99", "kl_p999", "dp_rms_se", "dp_p1", "ppl_ratio", "ppl_ratio_se", "ln_ppl_corr"} <= set(logprob)
    run(pytester).assert_outcomes(passed=1)
    degrade(monkeypatch)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    rows = table_rows(failure(result, "test_name"))
    assert ["bf16", "logprob", "logprob", "kl_p99"] in [row[:4] for row in rows]
