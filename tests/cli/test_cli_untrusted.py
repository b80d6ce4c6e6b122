"""The `pytest-precision` command on untrusted and careless input: checkpoints that carry code, bad options,
binary or malformed files, a closed pipe, and `diff` rules that no lost check passes silently."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY_LLAMA_DIR, TRAINED_LM_DIR
from pytest_precision.cli.main import main
from pytest_precision.gate.baseline import json_ready, report_from_document

ROOT = Path(__file__).parents[2]
BASELINE = ROOT / "baselines/examples/test_tiny_llama_gate/test_tiny_llama_low_precision.cpu.json"
TEST_ID = "examples/test_tiny_llama_gate.py::test_tiny_llama_low_precision"

#: The custom code of a hostile checkpoint: importing it leaves a marker file next to it.
MARKER_CODE = """
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("custom code ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizer

class MarkerConfig(LlamaConfig):
    model_type = "marker_model"

class MarkerModel(LlamaForCausalLM):
    config_class = MarkerConfig

class MarkerTokenizer(PreTrainedTokenizer):
    pass
"""


#: A progress line of `pytest-precision run` on stderr ("[   1.2s] reference fp32 (1/3): forward").
PROGRESS_LINE = re.compile(r"\[ *[0-9.]+[hms][0-9hms]*\] .*\n")


def without_progress(err: str) -> str:
    """stderr without the progress lines that may come before an error."""
    return PROGRESS_LINE.sub("", err)


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr without progress lines) of the command, checking that an error is one line
    and no traceback."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    err = without_progress(err)
    if code == 2:
        assert err.count("\n") == 1 and err.startswith(f"pytest-precision {args[0]}: "), err
    return code, out, err


def cli_process(*args: str | Path, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """The command in its own interpreter, stdin closed (no terminal, as in CI)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest_precision.cli.main", *map(str, args)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        **kwargs,
    )


# ---------------------------------------------------------------- run: checkpoints never run their own code


def hostile_checkpoint(folder: Path, config: dict[str, Any], **files: dict[str, Any]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "marker.py").write_text(MARKER_CODE)
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder


def test_run_refuses_a_checkpoint_whose_config_names_custom_code(tmp_path: Path) -> None:
    config = json.loads((TINY_LLAMA_DIR / "config.json").read_text())
    config.update(
        model_type="marker_model",
        architectures=["MarkerModel"],
        auto_map={"AutoConfig": "marker.MarkerConfig", "AutoModelForCausalLM": "marker.MarkerModel"},
    )
    folder = hostile_checkpoint(tmp_path / "ckpt", config)
    result = cli_process("run", folder, "--variants", "bf16", "--length", "4", "--forward-only", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"pytest-precision run: {folder / 'config.json'} names custom code (auto_map: ")
    assert "never executes code from a checkpoint" in result.stderr
    assert not (folder / "IMPORTED").exists()
    assert "[y/N]" not in result.stdout + result.stderr


def test_run_refuses_custom_code_even_under_a_built_in_model_type(tmp_path: Path) -> None:
    # transformers would quietly measure its own Llama here: not the model the checkpoint means.
    config = json.loads((TINY_LLAMA_DIR / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "marker.MarkerModel"}
    folder = hostile_checkpoint(tmp_path / "ckpt", config)
    shutil.copy(TINY_LLAMA_DIR / "model.safetensors", folder)
    result = cli_process("run", folder, "--variants", "bf16", "--length", "4", "--forward-only", cwd=tmp_path)
    assert result.returncode == 2 and "names custom code (auto_map: AutoModelForCausalLM -> marker.MarkerModel)" in (
        result.stderr
    )
    assert not (folder / "IMPORTED").exists()


def test_run_never_runs_a_custom_tokenizers_code(tmp_path: Path) -> None:
    """The tokenizer's own auto_map (tokenizer_config.json) is refused by transformers itself because the
    command passes trust_remote_code=False: one line, exit 2, the code never imported."""
    config = json.loads((TRAINED_LM_DIR / "config.json").read_text())
    tokenizer_config = {
        "tokenizer_class": "MarkerTokenizer",
        "auto_map": {"AutoTokenizer": ["marker.MarkerTokenizer", None]},
    }
    folder = hostile_checkpoint(tmp_path / "ckpt", config, tokenizer_config=tokenizer_config)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time")
    result = cli_process("run", folder, "--text", prompt, "--length", "4", "--forward-only", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    err = without_progress(result.stderr)
    assert err.startswith(f"pytest-precision run: cannot load the tokenizer of {folder}: ValueError: ")
    assert err.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (folder / "IMPORTED").exists()


def test_run_passes_trust_remote_code_false_to_every_loader(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import transformers

    calls: list[tuple[str, dict[str, Any]]] = []
    for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):
        auto = getattr(transformers, name)
        original = auto.from_pretrained

        def recorded(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append((_name, kwargs))
            return _original(*args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", recorded)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("It was the best of times, it was the worst of times.")
    args = ("run", TRAINED_LM_DIR, "--variants", "bf16", "--length", "8", "--batch", "1", "--text", prompt)
    code, out, _ = cli(capsys, *args, "--forward-only")
    assert code == 0 and "\n  bf16 " in out
    assert {name for name, _ in calls} == {"AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"}
    for name, kwargs in calls:
        assert kwargs.get("trust_remote_code") is False, name
        assert kwargs.get("local_files_only") is True, name


# ---------------------------------------------------------------- run: bad options and broken checkpoints


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--length", "1"], "--length must be >= 2 (got 1)"),
        (["--length", "0"], "--length must be >= 2 (got 0)"),
        (["--batch", "0"], "--batch must be >= 1 (got 0)"),
        (["--variants", ""], "--variants '' names no variant"),
        (["--variants", " , "], "--variants ' , ' names no variant"),
        (["--variants", "bf16,fp7"], "--variants: unknown variant 'fp7'"),
        (["--device", "tpu9"], "--device tpu9: not a device name"),
        (["--text", "no-such-prompt.txt"], "--text no-such-prompt.txt: cannot read it: No such file or directory"),
    ],
)
def test_run_refuses_bad_options_in_one_line(
    capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    code, _, err = cli(capsys, "run", TINY_LLAMA_DIR, *options)
    assert code == 2
    assert err.startswith(f"pytest-precision run: {message}"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_run_refuses_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "run", TINY_LLAMA_DIR, "--device", "cuda")
    assert code == 2
    assert err == "pytest-precision run: --device cuda: CUDA is not available on this machine; use --device cpu\n"


def test_run_refuses_text_that_is_not_utf8(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"caf\xe9 \xff\xfe")
    code, _, err = cli(capsys, "run", TRAINED_LM_DIR, "--text", prompt)
    assert code == 2 and f"--text {prompt}: not UTF-8 text" in err


def test_run_with_text_needs_a_tokenizer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    code, _, err = cli(capsys, "run", TINY_LLAMA_DIR, "--text", prompt, "--length", "4")
    assert code == 2
    assert err.startswith(f"pytest-precision run: {TINY_LLAMA_DIR} has no tokenizer (none of tokenizer.json, ")
    assert "leave out --text for random tokens" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"model_type": "llama",', "config.json is not valid JSON"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "config.json is not valid JSON"),
        (b"[1, 2]", "config.json holds a JSON list, not a model configuration"),
        (b'{"model_type": "no_such_architecture"}', "cannot load the configuration of"),
        (b"{}", "cannot load the configuration of"),
    ],
)
def test_run_refuses_a_broken_config_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: bytes, message: str
) -> None:
    (tmp_path / "config.json").write_bytes(content)
    code, _, err = cli(capsys, "run", tmp_path, "--length", "4")
    assert code == 2 and message in err and str(tmp_path) in err


def test_run_refuses_a_checkpoint_without_weights_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    shutil.copy(TINY_LLAMA_DIR / "config.json", tmp_path)
    code, _, err = cli(capsys, "run", tmp_path, "--variants", "bf16", "--length", "4", "--forward-only")
    assert code == 2 and err.startswith(f"pytest-precision run: cannot load the model in {tmp_path}: ")


def test_run_refuses_truncated_weights_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    shutil.copy(TINY_LLAMA_DIR / "config.json", tmp_path)
    weights = (TINY_LLAMA_DIR / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    code, _, err = cli(capsys, "run", tmp_path, "--variants", "bf16", "--length", "4", "--forward-only")
    assert code == 2 and err.startswith(f"pytest-precision run: cannot load the model in {tmp_path}: ")


# ---------------------------------------------------------------- show and diff on files that are not reports


def baseline_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(BASELINE.read_text())
    return data


def session_report(tests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A --precision-report document holding the given baseline documents under their test ids."""
    entries = {}
    for test_id, data in tests.items():
        report = report_from_document(data, BASELINE).to_dict()
        entries[test_id] = {"baseline": "x.json", "reference": report["reference"], "variants": report["variants"]}
    # As the session writes it: infinities as the strings "inf" / "-inf".
    written: dict[str, Any] = json_ready({"schema_version": 1, "baseline_dir": "baselines", "tests": entries})
    return written


def malformed(mutate: Any) -> dict[str, Any]:
    data = baseline_data()
    mutate(data)
    return data


def _first_record(data: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = data["variants"]["fp16"]["records"][0]
    return record


MALFORMED: dict[str, Any] = {
    "binary": b"\x00\x01\x02\x03PK\x03\x04" * 64,
    "not-utf8": b'{"test": "caf\xe9"}',
    "a-list": b"[1, 2, 3]",
    "deeply-nested": b"[" * 100_000,
    "variants-a-list": malformed(lambda d: d.update(variants=[1, 2])),
    "records-not-a-list": malformed(lambda d: d["variants"]["fp16"].update(records={"a": 1})),
    "record-a-number": malformed(lambda d: d["variants"]["fp16"]["records"].append(7)),
    "record-without-name": malformed(lambda d: _first_record(d).pop("name")),
    "metric-a-string": malformed(lambda d: _first_record(d).update(rms_rel="small")),
    "metric-a-bool": malformed(lambda d: _first_record(d).update(max_abs=True)),
    "metric-a-list": malformed(lambda d: _first_record(d).update(rms_rel=[1.0])),
    "shape-of-strings": malformed(lambda d: _first_record(d).update(shape=["a"])),
    "count-a-word": malformed(lambda d: _first_record(d).update(count="many")),
    "reference-a-string": malformed(lambda d: d.update(reference="fp32")),
    "loss-scale-a-word": malformed(lambda d: d["variants"]["fp16"]["run"].update(loss_scale="big")),
    "tests-a-list": {"schema_version": 1, "tests": [1, 2]},
    "test-entry-a-string": {"schema_version": 1, "tests": {"t::a": "x"}},
    "test-without-reference": {"schema_version": 1, "tests": {"t::a": {"variants": {}}}},
    "test-variants-a-list": {"schema_version": 1, "tests": {"t::a": {"reference": {}, "variants": [1]}}},
    "test-record-a-number": {
        "schema_version": 1,
        "tests": {"t::a": {"reference": {}, "variants": {"bf16": {"run": {}, "records": [3]}}}},
    },
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_show_and_diff_name_a_malformed_file_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, case: str
) -> None:
    content = MALFORMED[case]
    path = tmp_path / f"{case}.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    for args in (["show", path], ["show", path, "--summary"], ["diff", BASELINE, path], ["diff", path, BASELINE]):
        code, _, err = cli(capsys, *args)
        assert code == 2, (args, err)
        assert str(path) in err, err


def test_show_reads_a_session_report_with_infinities(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = baseline_data()
    _first_record(data)["max_rel"] = "inf"
    document = session_report({TEST_ID: data})
    path = tmp_path / "precision-report.json"
    path.write_text(json.dumps(document))
    assert '"max_rel": "inf"' in path.read_text()
    code, out, _ = cli(capsys, "show", path)
    assert code == 0 and out.startswith(f"== {TEST_ID}\n")


# ---------------------------------------------------------------- | head


def test_a_closed_pipe_ends_show_quietly(tmp_path: Path) -> None:
    data = baseline_data()
    big = tmp_path / "big.json"
    big.write_text(json.dumps(session_report({f"t.py::test_{i}": data for i in range(40)})))
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest_precision.cli.main", "show", str(big)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=environment,
    )
    assert process.stdout is not None and process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()  # `| head -1`: the reader goes away while the command still writes
    err = process.stderr.read().decode()
    code = process.wait(timeout=120)
    assert first.startswith(b"== t.py::test_")
    assert err == "" and code == 141


def test_a_pipe_closed_before_any_output_ends_show_quietly() -> None:
    # The output is small enough to sit in stdout's buffer: the closed pipe shows when it is flushed.
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest_precision.cli.main", "show", str(BASELINE), "--summary"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=environment,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    err = process.stderr.read().decode()
    assert err == "" and process.wait(timeout=120) == 141


# ---------------------------------------------------------------- diff: no lost check passes


def diff_against(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, new: dict[str, Any], *options: str
) -> tuple[int, list[str]]:
    path = tmp_path / "new.json"
    path.write_text(json.dumps(new))  # NaN written as the NaN literal, as a careless writer would
    code, out, _ = cli(capsys, "diff", BASELINE, path, *options)
    return code, out.splitlines()


def record_of(data: dict[str, Any], variant: str, name: str, kind: str) -> dict[str, Any]:
    for record in data["variants"][variant]["records"]:
        if (record["name"], record["kind"]) == (name, kind):
            found: dict[str, Any] = record
            return found
    raise KeyError(name)


def test_diff_of_a_file_with_itself_passes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, lines = diff_against(capsys, tmp_path, baseline_data())
    assert code == 0 and lines[0].endswith(": 0 of 220 tensor metrics worse beyond rtol 0.1")
    assert not any("dropped" in line or "undefined" in line or "nonfinite" in line for line in lines)


def test_diff_fails_when_new_drops_a_variant(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = baseline_data()
    del data["variants"]["fp16"]
    data["variant_order"].remove("fp16")
    code, lines = diff_against(capsys, tmp_path, data)
    assert code == 1
    assert lines[0].endswith(": 0 of 165 tensor metrics worse beyond rtol 0.1; 1 check lost or newly non-finite")
    assert lines[1] == "  dropped variant fp16"


def test_diff_fails_when_new_drops_a_tensor(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = baseline_data()
    records = data["variants"]["bf16"]["records"]
    records.remove(record_of(data, "bf16", "model.layers.0", "fw"))
    code, lines = diff_against(capsys, tmp_path, data)
    assert code == 1 and lines[1] == "  dropped tensor bf16 model.layers.0 (fw)"


@pytest.mark.parametrize("undefined", [None, math.nan])
def test_diff_fails_when_a_metric_becomes_undefined(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, undefined: float | None
) -> None:
    data = baseline_data()
    record_of(data, "fp16", "model.layers.1", "fw")["rms_rel"] = undefined
    code, lines = diff_against(capsys, tmp_path, data)
    assert code == 1
    assert lines[1] == "  fp16 model.layers.1 (fw): rms_rel became undefined"
    row = lines[3].split()  # the undefined row heads the table
    assert row[:4] == ["fp16", "model.layers.1", "fw", "rms_rel"] and row[-1] == "UNDEFINED"


@pytest.mark.parametrize("count", [1, 12])  # a single new NaN counts
def test_diff_fails_when_nonfinite_values_appear(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, count: int
) -> None:
    data = baseline_data()
    record_of(data, "bf16", "lm_head", "fw")["nonfinite"] = count
    code, lines = diff_against(capsys, tmp_path, data)
    assert code == 1 and lines[1] == f"  bf16 lm_head (fw): nonfinite 0 -> {count}"


def test_diff_passes_fewer_nonfinite_and_a_new_variant(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old, new = baseline_data(), baseline_data()
    record_of(old, "bf16", "lm_head", "fw")["nonfinite"] = 3
    new["variants"]["fp8"] = copy.deepcopy(new["variants"]["bf16"])
    new["variant_order"].append("fp8")
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(old))
    new_path = tmp_path / "new.json"
    new_path.write_text(json.dumps(new))
    code, out, _ = cli(capsys, "diff", old_path, new_path)
    assert code == 0 and "  variants only in new: fp8" in out.splitlines()


def test_diff_pairs_a_baseline_with_its_own_test_in_a_session_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    worse = baseline_data()
    record_of(worse, "fp16", "model.layers.2", "fw")["rms_rel"] *= 3
    report = tmp_path / "precision-report.json"
    # Another test of the session got worse: the baseline of TEST_ID says nothing about it.
    report.write_text(json.dumps(session_report({TEST_ID: baseline_data(), "other.py::test_x": worse})))
    code, out, _ = cli(capsys, "diff", BASELINE, report)
    assert code == 0
    assert out.startswith(f"== {TEST_ID}: 0 of 220 tensor metrics") and "other.py::test_x" not in out
    report.write_text(json.dumps(session_report({TEST_ID: worse, "other.py::test_x": baseline_data()})))
    code, out, _ = cli(capsys, "diff", BASELINE, report)
    assert code == 1 and out.startswith(f"== {TEST_ID}: 1 of 220 tensor metrics")


def test_diff_refuses_a_session_report_without_the_baselines_test(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "precision-report.json"
    report.write_text(json.dumps(session_report({"a.py::test_a": baseline_data(), "b.py::test_b": baseline_data()})))
    code, _, err = cli(capsys, "diff", BASELINE, report)
    assert code == 2
    assert err.startswith(f"pytest-precision diff: no test is in both {BASELINE} ({TEST_ID}) and {report} (a.py::")


def test_diff_of_session_reports_fails_on_a_dropped_test(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(session_report({"a.py::test_a": baseline_data(), "b.py::test_b": baseline_data()})))
    new.write_text(json.dumps(session_report({"a.py::test_a": baseline_data(), "c.py::test_c": baseline_data()})))
    code, out, _ = cli(capsys, "diff", old, new)
    assert code == 1
    assert f"== b.py::test_b: dropped, in {old} but not in {new}" in out
    assert f"== c.py::test_c: not in {old} (a new test)" in out


@pytest.mark.parametrize(
    "options",
    [["--rtol", "nan"], ["--rtol", "-0.1"], ["--atol", "inf"], ["--atol", "-1e-5"], ["--rtol", "x"], ["--limit", "0"]],
)
def test_diff_refuses_bad_tolerances_and_limits(capsys: pytest.CaptureFixture[str], options: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["diff", str(BASELINE), str(BASELINE), *options])
    assert exit_info.value.code == 2
    assert f"argument {options[0]}: " in capsys.readouterr().err
