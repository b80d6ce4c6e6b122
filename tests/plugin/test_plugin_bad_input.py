"""Bad input as a user meets it: each shows a one-screen message naming what is wrong and the fix, and no
traceback from inside the library."""

from __future__ import annotations

import json
import types

import pytest
import torch
from plugin_testing import (
    SIMPLE_TEST,
    assert_no_traceback,
    baseline_file,
    failure,
    output,
    project,
    run,
    table_rows,
)

REFRESH = "Re-create it with: pytest test_gate.py::test_name --update-baselines"
SHOWN = "baselines/test_gate/test_name.cpu.json"


def assert_no_traceback_but(result: pytest.RunResult, *allowed: str) -> None:
    """assert_no_traceback, where the message itself may mention `allowed` (e.g. `pytest_precision.Variant`)."""

    def scrub(lines: list[str]) -> list[str]:
        for fragment in allowed:
            lines = [line.replace(fragment, "") for line in lines]
        return lines

    assert_no_traceback(types.SimpleNamespace(outlines=scrub(result.outlines), errlines=scrub(result.errlines)))


def baseline_error(result: pytest.RunResult) -> str:
    """The BaselineError line of test_gate.py::test_name's failure, which must open its section."""
    section = failure(result, "test_name")
    assert section[0].startswith("BaselineError: precision baseline "), "\n".join(section)
    assert len(section) <= 3, "\n".join(section)  # one screen: the message, not a traceback
    return section[0]


def gate_with(pytester, monkeypatch, text):
    """A one-test project whose baseline file holds `text`."""
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    path = baseline_file(pytester, "test_gate", "test_name")
    path.parent.mkdir(parents=True)
    path.write_text(text, encoding="utf-8")
    return path


# Baseline files -------------------------------------------------------------------------------------------


def test_empty_baseline(pytester, monkeypatch):
    gate_with(pytester, monkeypatch, "\n")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    assert baseline_error(result) == f"BaselineError: precision baseline {SHOWN} is empty. {REFRESH}"
    result.stdout.fnmatch_lines(["precision baselines (compare, baselines): 1 failed"])
    assert_no_traceback(result)


def test_truncated_baseline(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: len(text) // 3], encoding="utf-8")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    message = baseline_error(result)
    assert message.startswith(f"BaselineError: precision baseline {SHOWN} is not valid JSON (line ")
    assert "; it may be truncated or have a merge conflict. " in message
    assert message.endswith(REFRESH)
    assert_no_traceback(result)


def test_baseline_that_is_not_json(pytester, monkeypatch):
    gate_with(pytester, monkeypatch, "<<<<<<< HEAD\nbaseline: yes\n=======\n>>>>>>> main\n")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    message = baseline_error(result)
    assert message.startswith(
        f"BaselineError: precision baseline {SHOWN} is not valid JSON (line 1, column 1: Expecting value)"
    )
    assert message.endswith(f"; it may be truncated or have a merge conflict. {REFRESH}")
    assert_no_traceback(result)


def test_baseline_of_another_schema_version(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    path = baseline_file(pytester, "test_gate", "test_name")
    data = json.loads(path.read_text(encoding="utf-8"))
    data["schema_version"] = 7
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    assert baseline_error(result) == (
        f"BaselineError: precision baseline {SHOWN} has schema_version 7; this pytest-precision reads version 1. "
        f"{REFRESH}"
    )
    assert_no_traceback(result)


def test_baseline_without_schema_version(pytester, monkeypatch):
    gate_with(pytester, monkeypatch, '{"variants": {}}\n')
    result = run(pytester)
    result.assert_outcomes(failed=1)
    assert baseline_error(result) == (
        f"BaselineError: precision baseline {SHOWN} has schema_version None; this pytest-precision reads version 1. "
        f"{REFRESH}"
    )
    assert_no_traceback(result)


MODULES_TEST = """
import os

from tinymodel import tiny_batch, tiny_model


def test_layers(precision, assert_precision_within):
    modules = os.environ["TINY_MODULES"].split(",")
    report = precision.run(tiny_model(), tiny_batch(), variants=["bf16"], modules=modules, backward=False)
    assert_precision_within(report)
"""


def test_baseline_of_other_layers(pytester, monkeypatch):
    project(pytester, monkeypatch, test_layers=MODULES_TEST)
    monkeypatch.setenv("TINY_MODULES", r"embed,blocks\.0,blocks\.1")
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    monkeypatch.setenv("TINY_MODULES", r"blocks\.1,blocks\.2")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_layers")
    # The rows in both (blocks.1 among them) hold; the rest is counted apart, never as "3 / 3 tensors (100.0%)".
    assert section[0] == (
        "precision regressed: 0 / 3 tensors (0.0%) in 1 variant(s), and 2 tensor(s) missing from this run, "
        "1 tensor(s) new (not in the baseline); first: bf16 blocks.2 (fw)"
    )
    assert table_rows(section) == [
        ["bf16", "blocks.2", "fw", "new", "tensor", "not", "in", "the", "baseline"],
        ["bf16", "embed", "fw", "missing", "tensor", "not", "in", "this", "run"],
        ["bf16", "blocks.0", "fw", "missing", "tensor", "not", "in", "this", "run"],
    ]
    assert "Baseline: baselines/test_layers/test_layers.cpu.json" in section
    assert "If the change is intended, refresh it: pytest test_layers.py::test_layers --update-baselines" in section
    assert_no_traceback(result)


# Arguments of precision.run -------------------------------------------------------------------------------


def run_error(pytester, monkeypatch, body: str, *, allowed: tuple[str, ...] = ()) -> str:
    """Run a one-test project whose test runs `body`: the first line of its failure section, which shows no
    library internals (`allowed` fragments aside) and fits on one screen."""
    source = "\n".join(
        [
            "import torch",
            "from torch import nn",
            "from tinymodel import tiny_batch, tiny_model",
            "",
            "",
            "def test_bad(precision, assert_precision_within):",
            *[f"    {line}" if line else "" for line in body.strip("\n").splitlines()],
            "",
        ]
    )
    project(pytester, monkeypatch, test_bad=source)
    result = run(pytester)
    result.assert_outcomes(failed=1)
    section = failure(result, "test_bad")
    assert len(section) <= 3, "\n".join(section)  # the message, not a traceback
    assert_no_traceback_but(result, *allowed)
    assert not (pytester.path / "baselines").exists()
    return section[0]


def test_modules_regex_matching_nothing(pytester, monkeypatch):
    first = run_error(
        pytester,
        monkeypatch,
        r'precision.run(tiny_model(), tiny_batch(), variants=["bf16"], modules=["embed", "decoder\.layers\..*"])',
    )
    assert first.startswith(
        "ConfigurationError: modules: 'decoder\\\\.layers\\\\..*' matches no module of TinyLM (full match on names "
        "from named_modules(), e.g. embed, blocks, blocks.0"
    )


def test_unknown_variant_name(pytester, monkeypatch):
    first = run_error(
        pytester,
        monkeypatch,
        'precision.run(tiny_model(), tiny_batch(), variants=["bf16", "bf61"])',
        allowed=("pytest_precision.Variant(",),
    )
    head, _, listed = first.partition(" Built-in variants: ")
    assert head == "ConfigurationError: variants: unknown variant 'bf61'."
    names, _, fix = listed.partition("; ")
    assert {"fp64", "fp32", "bf16", "fp16", "bf16_autocast", "fp16_fp32_head", "bf16_sdpa"} <= set(names.split(", "))
    assert fix == "or pass pytest_precision.Variant(name=..., dtype=..., ...)"


def test_unknown_variant_field(pytester, monkeypatch):
    first = run_error(
        pytester,
        monkeypatch,
        'precision.run(tiny_model(), tiny_batch(), variants=[{"name": "half", "dtpye": "float16"}])',
    )
    head, _, fields = first.partition("; valid fields: ")
    assert head == "ConfigurationError: variants: unknown Variant field(s) dtpye"
    assert {"name", "dtype", "autocast", "fp32_modules", "prepare"} <= set(fields.split(", "))


def test_inputs_the_model_rejects(pytester, monkeypatch):
    first = run_error(
        pytester,
        monkeypatch,
        """
batch = {"input_ids": torch.full((2, 5), 999), "labels": torch.zeros(2, 5, dtype=torch.long)}
precision.run(tiny_model(), batch, variants=["bf16"])
""",
    )
    assert first == (
        "ModelRunError: TinyLM raised IndexError: index out of range in self in forward of run 'fp32' (inputs "
        "{'input_ids': [2, 5], 'labels': [2, 5]}); an index out of range: are the token ids below the model's "
        "vocabulary size?"
    )


def test_inputs_of_wrong_names(pytester, monkeypatch):
    first = run_error(
        pytester,
        monkeypatch,
        'precision.run(tiny_model(), {"ids": tiny_batch()["input_ids"]}, variants=["bf16"])',
    )
    assert first.startswith("ModelRunError: run 'fp32': TinyLM rejected the inputs {'ids': [2, 16]}: TypeError: ")
    assert "'ids'" in first
    assert first.endswith(
        "(check that the inputs' keys match forward()'s arguments, and their shapes, dtypes and token ids what it "
        "expects)"
    )


NO_LOSS = """
class Features(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        return self.layers(x)


torch.manual_seed(0)
precision.run(Features(), torch.randn(3, 8), variants=["bf16"], modules=[r"layers\\.\\d"])
"""


def test_backward_without_a_loss(pytester, monkeypatch):
    first = run_error(pytester, monkeypatch, NO_LOSS)
    assert first == (
        "ConfigurationError: run 'fp32': backward=True needs a loss: the model's output has no `.loss`; "
        "pass loss_fn=lambda output, inputs: ... or backward=False"
    )


def test_model_without_parameters(pytester, monkeypatch):
    first = run_error(
        pytester,
        monkeypatch,
        'precision.run(nn.Sequential(nn.Tanh(), nn.ReLU()), torch.randn(3, 8), variants=["bf16"], backward=False)',
    )
    assert first == (
        "ConfigurationError: Sequential has no floating-point parameters to measure: pass the model that holds "
        "the weights (or a factory building it), not a wrapper or a parameter-free module"
    )


def test_loss_that_is_not_a_scalar(pytester, monkeypatch):
    first = run_error(
        pytester,
        monkeypatch,
        """
def per_token(output, inputs):
    return output["logits"].float().logsumexp(-1)


precision.run(tiny_model(), tiny_batch(), variants=["bf16"], loss_fn=per_token)
""",
    )
    assert first == (
        "ConfigurationError: run 'fp32': the loss must be a scalar tensor, got (2, 16); reduce it in loss_fn "
        "(e.g. .mean())"
    )


# Command line ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_precision_gpu_without_cuda(pytester, monkeypatch):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    result = run(pytester, "--precision-gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --precision-gpu (or ini precision_gpu) needs a CUDA device, and torch sees none (torch *); run "
            "without it to test on CPU"
        ]
    )
    assert "passed" not in output(result) and "failed" not in output(result)
    assert_no_traceback(result)
    assert not (pytester.path / "baselines").exists()


@pytest.mark.parametrize(
    ("ini", "args", "named"),
    [("", ["--precision-strict"], "--precision-strict"), ("precision_strict = true", [], "precision_strict")],
    ids=["command-line", "ini"],
)
def test_update_baselines_with_precision_strict(pytester, monkeypatch, ini, args, named):
    project(pytester, monkeypatch, test_gate=SIMPLE_TEST)
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = run(pytester, "--update-baselines", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = "\n".join(result.errlines)
    assert "unrecognized arguments" not in errors
    (line,) = [line for line in result.errlines if line.startswith("ERROR: ")]
    assert "--update-baselines" in line
    assert named in line
    assert_no_traceback(result)
    assert not (pytester.path / "baselines").exists()
