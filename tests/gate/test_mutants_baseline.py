"""Baseline files (gate/baseline.py) against issue 34's mutants: where a damaged file's problem is named (the
reference; a record without a kind), a long stem cut at a letter, a Windows-style absolute stem, and a document's
round trip back into a report (the reference's spec, the default device, no missing tensors)."""

from __future__ import annotations

import hashlib
import re
import types
from pathlib import Path
from typing import Any

import pytest

import pytest_precision.gate.baseline as baseline_module
from pytest_precision.base.errors import BaselineError
from pytest_precision.base.records import Record, RunInfo, TensorError
from pytest_precision.gate.baseline import (
    MAX_STEM_BYTES,
    baseline_stem,
    document,
    load_baseline,
    render,
    report_from_document,
    stem_problem,
)
from pytest_precision.reports.report import PrecisionReport

REFRESH = "pytest t.py::t --update-baselines"
REFERENCE_SPEC = {"name": "fp32", "dtype": "float32"}


def run_info(spec: dict[str, Any]) -> RunInfo:
    return RunInfo(
        variant=spec,
        parameter_dtypes={spec["dtype"]: 2},
        buffer_dtypes={},
        input_shapes={"x": [2, 3]},
        token_count=None,
        backend={"settings": {}},
    )


def record(name: str, kind: str = "fw") -> Record:
    error = TensorError(6, 1.0, 0.01, 0.01, 0.03, 0.03, -0.001, -0.001, 0.999, 1.0, 0.01, 0.999, 40.0, 0)
    return Record.from_error(name, kind, (2, 3), error)


def sample_document() -> dict[str, Any]:
    report = PrecisionReport(reference=run_info(REFERENCE_SPEC), device="cpu")
    report.add("bf16", run_info({"name": "bf16", "dtype": "bfloat16"}), [record("head"), record("head", "bw")], [])
    report.add("fp16", run_info({"name": "fp16", "dtype": "float16"}), [record("head")], [])
    return document(report, "t.py::t", {"torch": "2.13"})


def load_error(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    with pytest.raises(BaselineError) as raised:
        load_baseline(path, REFRESH, shown=Path("baselines/t.cpu.json"))
    return str(raised.value)


def test_a_key_twice_in_the_reference_is_placed_in_the_reference(tmp_path: Path) -> None:
    text = render(sample_document())
    assert text.count('"reference": {') == 1
    message = load_error(tmp_path / "t.cpu.json", text.replace('"reference": {', '"reference": {"spec": {}, ', 1))
    assert message.startswith("precision baseline baselines/t.cpu.json: the reference: field 'spec' appears twice")
    assert message.endswith(f"Re-create it with: {REFRESH}")


def test_a_damaged_record_without_a_kind_is_named_by_its_tensor_alone(tmp_path: Path) -> None:
    """No kind to show: the tensor's name and nothing after it (a kind that is not a string is not shown either)."""
    data = sample_document()
    del data["variants"]["bf16"]["records"][0]["kind"]
    data["variants"]["fp16"]["records"][0]["kind"] = 7
    text = render(data)
    starts = [m.start() for m in re.finditer(r'"rms_rel": 0\.01', text)]  # bf16's two records, then fp16's
    for start, variant in ((starts[0], "bf16"), (starts[-1], "fp16")):
        damaged = text[:start] + '"rms_rel": 0.5, ' + text[start:]
        message = load_error(tmp_path / "t.cpu.json", damaged)
        assert f"precision baseline baselines/t.cpu.json: variant {variant!r}, tensor 'head': field 'rms_rel' " in (
            message
        )
        assert "appears twice" in message


def test_a_long_stem_is_cut_keeping_the_letter_at_the_cut() -> None:
    """Only dots are dropped at the cut (a name ending in '.' is lost on Windows), never a letter."""
    name = "test_x[" + "X" * 300 + "]"
    stem = baseline_stem(f"t.py::{name}")
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    assert stem == ("test_x_" + "X" * 300)[: MAX_STEM_BYTES - 13] + "-" + digest
    assert len(stem) == MAX_STEM_BYTES
    assert stem_problem(stem) is None


def windows_isabs(path: str) -> bool:
    """ntpath.isabs of Python >= 3.13: a drive and a separator, or a UNC name; "/x" and "\\x" are not absolute."""
    return re.match(r"^([A-Za-z]:[/\\]|[/\\]{2})", path) is not None


@pytest.mark.parametrize("stem", ["/etc/t", "\\t", "//server/share/t"])
def test_a_rooted_stem_is_an_absolute_path_where_isabs_says_it_is_not(
    stem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Windows with Python >= 3.13 os.path.isabs("/etc/t") is False: the stem is still named absolute."""
    fake_os = types.SimpleNamespace(path=types.SimpleNamespace(isabs=windows_isabs))
    monkeypatch.setattr(baseline_module, "os", fake_os)
    assert stem_problem(stem) == "it is an absolute path"


def test_a_document_reads_back_as_the_report_it_was_written_from(tmp_path: Path) -> None:
    data = sample_document()
    assert data["reference"]["spec"] == REFERENCE_SPEC
    path = tmp_path / "t.cpu.json"
    path.write_text(render(data), encoding="utf-8")
    report = report_from_document(load_baseline(path, REFRESH).data, path)
    assert report.reference.variant == REFERENCE_SPEC
    assert report.reference.parameter_dtypes == {"float32": 2}
    assert report.variants == ["bf16", "fp16"]
    assert report.runs["fp16"].variant == {"name": "fp16", "dtype": "float16"}
    assert report.missing == {"bf16": [], "fp16": []}
    as_dict = report.to_dict()  # what `pytest-precision show` renders
    assert as_dict["variants"]["bf16"]["missing"] == []
    assert [(r["name"], r["kind"]) for r in as_dict["variants"]["bf16"]["records"]] == [("head", "fw"), ("head", "bw")]


def test_a_document_without_a_device_reads_back_on_cpu(tmp_path: Path) -> None:
    """As a session report without one does (report_files): the lower-case device key of the file names."""
    data = sample_document()
    del data["device"]
    assert report_from_document(data, tmp_path / "t.cpu.json").device == "cpu"
