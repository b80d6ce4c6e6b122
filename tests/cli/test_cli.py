"""The `pytest-precision` command: show, diff and run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_LLAMA_DIR
from pytest_precision.cli.main import build_parser, main

BASELINE = Path(__file__).parents[2] / "baselines/examples/test_tiny_llama_gate/test_tiny_llama_low_precision.cpu.json"


def test_show_prints_the_plugins_tables(capsys):
    assert main(["show", str(BASELINE), "--summary"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== examples/test_tiny_llama_gate.py::test_tiny_llama_low_precision\n")
    assert "  fw              first (model.embed_tokens)  mid median  mid max  last (lm_head)" in out
    for variant in ("bf16", "fp16", "bf16_fp32_head", "fp16_fp32_head"):
        assert f"\n  {variant} " in out
    assert "every tensor" not in out


def test_show_filters_variant_and_kind(capsys):
    assert main(["show", str(BASELINE), "--variant", "fp16", "--kind", "grad"]) == 0
    out = capsys.readouterr().out
    assert "fp16: every tensor" in out
    assert "bf16" not in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  model.") or line.startswith("  lm_head")]
    assert rows and {row[1] for row in rows} == {"grad"}


def test_show_errors_name_the_file_and_the_choices(capsys, tmp_path):
    assert main(["show", str(BASELINE), "--variant", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pytest-precision show: {BASELINE}: no variant 'fp8'; variants: bf16, fp16")
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema_version": 1,')
    assert main(["show", str(broken)]) == 2
    assert f"{broken} is not valid JSON" in capsys.readouterr().err


def test_diff_orders_by_change_and_exits_1_when_worse(capsys, tmp_path):
    data = json.loads(BASELINE.read_text())
    for record in data["variants"]["fp16"]["records"]:
        if (record["name"], record["kind"]) == ("model.layers.2", "fw"):
            record["rms_rel"] *= 2
        if (record["name"], record["kind"]) == ("model.layers.3", "fw"):
            record["rms_rel"] *= 0.5
    new = tmp_path / "new.json"
    new.write_text(json.dumps(data))
    assert main(["diff", str(BASELINE), str(new), "--limit", "3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("1 of 220 tensor metrics worse beyond rtol 0.1")
    first, second = lines[2].split(), lines[3].split()
    assert first[:4] == ["fp16", "model.layers.2", "fw", "rms_rel"] and first[-1] == "WORSE"
    assert second[:4] == ["fp16", "model.layers.3", "fw", "rms_rel"] and second[-1] == "0.5x"
    assert main(["diff", str(BASELINE), str(BASELINE)]) == 0
    assert main(["diff", str(BASELINE), str(new), "--rtol", "1.5"]) == 0


def test_run_measures_a_local_checkpoint(capsys):
    code = main(["run", str(TINY_LLAMA_DIR), "--variants", "bf16,fp16", "--length", "16", "--forward-only"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("precision: rms_rel against the fp32 reference on cpu")
    assert "  logprob " in out and "\n  bf16 " in out and "\n  fp16 " in out


def test_run_refuses_a_folder_that_is_not_a_checkpoint(capsys, tmp_path):
    assert main(["run", str(tmp_path)]) == 2
    assert "is not a transformers checkpoint folder (no config.json)" in capsys.readouterr().err


def test_help_explains_each_command_with_an_example():
    text = build_parser().format_help()
    for command in ("show", "diff", "run"):
        assert f"pytest-precision {command} " in text
    with pytest.raises(SystemExit):
        main(["diff", "--help"])
