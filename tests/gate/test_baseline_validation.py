"""Baseline files as written and as read: exact loss scales, infinities that survive the round trip,
"unchanged" that ignores the environment, and a BaselineError naming file, variant, tensor and field for
every kind of damage a hand edit or a bad merge can do."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_precision.base.errors import BaselineError
from pytest_precision.base.records import Record, RunInfo, TensorError
from pytest_precision.gate.baseline import document, json_ready, load_baseline, numbers_unchanged, render
from pytest_precision.reports.report import PrecisionReport

REFRESH = "pytest t.py::t --update-baselines"


def run_info(name: str, loss_scale: float | None = None) -> RunInfo:
    return RunInfo(
        variant={"name": name, "dtype": "float16"},
        parameter_dtypes={"float16": 2},
        buffer_dtypes={},
        input_shapes={"x": [2, 3]},
        token_count=None,
        backend={"settings": {}},
        loss_scale=loss_scale,
    )


def tensor(name: str, kind: str = "fw", *, sqnr_db: float = 40.0, rms_rel: float | None = 0.0123456789) -> Record:
    error = TensorError(6, 1.0, 0.01, rms_rel, 0.03, 0.03, -0.001, -0.001, 0.999, 1.0, 0.01, 0.999, sqnr_db, 0)
    return Record.from_error(name, kind, (2, 3), error)


def sample_report(loss_scale: float | None = 2.0**21) -> PrecisionReport:
    report = PrecisionReport(reference=run_info("fp32"), device="cpu")
    records = [tensor("inf"), tensor("head", sqnr_db=-math.inf), tensor("head", "bw", sqnr_db=math.inf)]
    report.add("fp16", run_info("fp16", loss_scale), records, [])
    report.add("bf16", run_info("bf16"), [tensor("inf")], [])
    return report


def write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(render(data), encoding="utf-8")
    return path


@pytest.fixture
def written(tmp_path: Path) -> Path:
    return write(tmp_path / "t.cpu.json", document(sample_report(), "t.py::t", {"torch": "2.13"}))


def test_a_valid_baseline_reads_back_with_its_infinities_and_names(written: Path) -> None:
    baseline = load_baseline(written, REFRESH)
    records = baseline.records()
    assert baseline.variant_order == ["fp16", "bf16"]
    assert [(r.name, r.kind, r.sqnr_db) for r in records["fp16"]] == [
        ("inf", "fw", 40.0),
        ("head", "fw", -math.inf),  # written "-inf", read back -inf, not inf
        ("head", "bw", math.inf),
    ]
    text = written.read_text()
    assert '"sqnr_db": "-inf"' in text and '"sqnr_db": "inf"' in text
    assert records["fp16"][0].rms_rel == 0.0123457  # other floats: 6 significant digits


def test_json_ready_writes_each_infinity_with_its_sign() -> None:
    assert json_ready([math.inf, -math.inf, math.nan, 1.234567891]) == ["inf", "-inf", None, 1.23457]


@pytest.mark.parametrize("scale", [2.0**11, 2.0**17, 2.0**20, 2.0**21, 2.0**-3, 2.0**70])
def test_loss_scales_are_written_and_read_back_exactly(tmp_path: Path, scale: float) -> None:
    path = write(tmp_path / "t.cpu.json", document(sample_report(scale), "t.py::t", {}))
    assert json.loads(path.read_text())["variants"]["fp16"]["run"]["loss_scale"] == scale
    assert load_baseline(path, REFRESH).loss_scales() == {"fp16": scale}


#: A whole environment block as environment() writes it, on the machine that wrote the baseline.
MACHINE = {
    "torch": "2.13.0+cpu",
    "device": "cpu: x86_64",
    "threads": 2,
    "cpu_capability": "AVX2",
    "world_size": 1,
    "mesh": None,
    "commit": "a" * 40,
    "python": "3.11.7",
}


def test_unchanged_ignores_the_commit_and_versions_but_not_the_numbers(tmp_path: Path) -> None:
    written = write(tmp_path / "t.cpu.json", document(sample_report(), "t.py::t", MACHINE))
    later = {**MACHINE, "commit": "b" * 40, "python": "3.12.1", "date": "2026-12-05T00:00:00+00:00"}
    assert numbers_unchanged(written, document(sample_report(), "t.py::t", later))
    assert not numbers_unchanged(written, document(sample_report(2.0**20), "t.py::t", MACHINE))
    report = sample_report()
    report.add("bf16", run_info("bf16"), [tensor("inf", rms_rel=0.02)], [])
    assert not numbers_unchanged(written, document(report, "t.py::t", MACHINE))


@pytest.mark.parametrize(
    "field, value", [("torch", "2.14.0"), ("threads", 64), ("cpu_capability", "AVX512"), ("world_size", 2)]
)
def test_a_refresh_rewrites_a_file_measured_where_a_drift_field_differed(
    tmp_path: Path, field: str, value: object
) -> None:
    """Unchanged numbers on another machine still rewrite the file, or its drift warning would outlive the refresh."""
    written = write(tmp_path / "t.cpu.json", document(sample_report(), "t.py::t", MACHINE))
    assert not numbers_unchanged(written, document(sample_report(), "t.py::t", {**MACHINE, field: value}))


@pytest.mark.parametrize("missing", ["cpu_capability", "world_size", "mesh"])
def test_a_refresh_rewrites_a_file_that_lacks_a_drift_field(tmp_path: Path, missing: str) -> None:
    """Files from before a field was recorded get it at the next refresh (the ISA-drift warning needs it)."""
    old = {k: v for k, v in MACHINE.items() if k != missing}
    written = write(tmp_path / "t.cpu.json", document(sample_report(), "t.py::t", old))
    assert not numbers_unchanged(written, document(sample_report(), "t.py::t", MACHINE))


def record_of(data: dict[str, Any], variant: str = "fp16", index: int = 1) -> dict[str, Any]:
    record: dict[str, Any] = data["variants"][variant]["records"][index]
    return record


def set_record(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        record_of(data)[field] = value

    return edit


def drop_record_field(field: str) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        del record_of(data)[field]

    return edit


def set_run(field: str, value: Any, variant: str = "fp16") -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["variants"][variant]["run"][field] = value

    return edit


def set_top(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data[field] = value

    return edit


def drop_top(field: str) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        del data[field]

    return edit


def set_reference(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["reference"][field] = value

    return edit


def set_variant(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["variants"]["fp16"] = value

    return edit


HEAD = "variant 'fp16', tensor 'head' (fw)"

DAMAGE = [
    (set_record("rms_rel", "0.01"), f"{HEAD}: field 'rms_rel' is '0.01', not a number, null, \"inf\" or \"-inf\""),
    (set_record("sqnr_db", True), f"{HEAD}: field 'sqnr_db' is True, not a number"),
    (set_record("cosine", [0.9]), f"{HEAD}: field 'cosine' is [0.9], not a number"),
    (set_record("spread", {"a": 1}), f"{HEAD}: field 'spread' is {{'a': 1}}, not a number"),
    (drop_record_field("rms_rel"), f"{HEAD}: field 'rms_rel' is missing"),
    (drop_record_field("kind"), "variant 'fp16', tensor 'head': field 'kind' is None, not one of routing, fw, "),
    (drop_record_field("name"), "variant 'fp16', records[1]: field 'name' is null, not a string"),
    (
        set_record("kind", "forward"),
        "variant 'fp16', tensor 'head': field 'kind' is 'forward', not one of routing, fw, ",
    ),
    (set_record("name", 3), "variant 'fp16', records[1]: field 'name' is a number, not a string"),
    (set_record("shape", "2x3"), f"{HEAD}: field 'shape' is '2x3', not a list of non-negative integers"),
    (set_record("shape", [2, -3]), f"{HEAD}: field 'shape' is [2, -3], not a list"),
    (set_record("shape", [2.0, 3]), f"{HEAD}: field 'shape' is [2.0, 3], not a list"),
    (set_record("count", -1), f"{HEAD}: field 'count' is -1, not a non-negative integer"),
    (set_record("count", 6.5), f"{HEAD}: field 'count' is 6.5, not a non-negative integer"),
    (set_record("nonfinite", None), f"{HEAD}: field 'nonfinite' is None, not a non-negative integer"),
    (set_record("nonfinite", False), f"{HEAD}: field 'nonfinite' is False, not a non-negative integer"),
    (set_run("loss_scale", 3.0), "variant 'fp16': field 'loss_scale' is 3.0, not a finite positive power of two"),
    (set_run("loss_scale", 0), "variant 'fp16': field 'loss_scale' is 0, not a finite positive power of two"),
    (set_run("loss_scale", -2.0), "variant 'fp16': field 'loss_scale' is -2.0, not a finite positive power"),
    (set_run("loss_scale", "inf"), "variant 'fp16': field 'loss_scale' is 'inf', not a finite positive power"),
    (set_run("loss_scale", True), "variant 'fp16': field 'loss_scale' is True, not a finite positive power"),
    (set_run("loss_scale", 1e308 * 10), "variant 'fp16': field 'loss_scale' is 'Infinity', not a finite"),
    (set_variant([]), "variant 'fp16' is a list, not an object"),
    (set_variant({"records": {}}), "variant 'fp16': 'records' is an object, not a list of records"),
    (set_variant({"records": [], "run": []}), "variant 'fp16': 'run' is a list, not an object"),
    (set_top("variants", []), "'variants' is a list, not an object of variants"),
    (set_top("variant_order", ["fp16"]), "'variant_order' ['fp16'] does not list each variant of 'variants' once"),
    (set_top("variant_order", ["fp16", "bf16", "bf16"]), "'variant_order' ['fp16', 'bf16', 'bf16'] does not list"),
    (
        set_top("variant_order", "fp16,bf16"),
        "'variant_order' 'fp16,bf16' does not list each variant of 'variants' once (bf16, fp16).",
    ),
    (set_top("test", 1.5), "field 'test' is a number, not a string"),
    (
        set_top("variant_order", ["fp16", 1]),
        "'variant_order' ['fp16', 1] does not list each variant of 'variants' once",
    ),
    (set_variant({"run": {}}), "variant 'fp16': 'records' is null, not a list of records"),
    (set_record("zero_frac", "-inf"), f"{HEAD}: field 'zero_frac' is '-inf', not a fraction in [0, 1] (or null)"),
    (set_top("test", 5), "field 'test' is a number, not a string"),
    (set_top("environment", "cpu"), "field 'environment' is a string, not an object"),
    (set_top("reference", None), "field 'reference' is null, not an object"),
    (set_top("test", True), "field 'test' is a boolean, not a string"),
    (set_top("device", ["cpu"]), "field 'device' is a list, not a string"),
    (drop_top("variants"), "'variants' is null, not an object of variants"),
    (
        set_top("variant_order", ["bf16"]),
        "'variant_order' ['bf16'] does not list each variant of 'variants' once (bf16, fp16).",
    ),
    (set_reference("run", []), "the reference: 'run' is a list, not an object"),
    (set_reference("spec", "fp32"), "the reference: 'spec' is a string, not an object"),
    (
        set_record("underflow_frac", "0.5"),
        f"{HEAD}: field 'underflow_frac' is '0.5', not a number, null, \"inf\" or \"-inf\"",
    ),
    (set_record("underflow_frac", 1.5), f"{HEAD}: field 'underflow_frac' is 1.5, not a fraction in [0, 1] (or null)"),
    (set_record("zero_frac", "inf"), f"{HEAD}: field 'zero_frac' is 'inf', not a fraction in [0, 1] (or null)"),
    (set_record("ref_absmax", -1.0), f"{HEAD}: field 'ref_absmax' is -1.0, not a non-negative number (or null)"),
    # Values no measurement gives, which would make the gate on the error (1 - cosine, ...) accept anything.
    (set_record("cosine", -5.0), f"{HEAD}: field 'cosine' is -5.0, not a number in [-1, 1] (or null)"),
    (set_record("correlation", 1.5), f"{HEAD}: field 'correlation' is 1.5, not a number in [-1, 1] (or null)"),
    (set_record("cosine", "-inf"), f"{HEAD}: field 'cosine' is '-inf', not a number in [-1, 1] (or null)"),
    (
        set_record("expert_agreement", 1.2),
        f"{HEAD}: field 'expert_agreement' is 1.2, not a fraction in [0, 1] (or null)",
    ),
    (set_record("top1_agreement", -0.1), f"{HEAD}: field 'top1_agreement' is -0.1, not a fraction in [0, 1] (or null)"),
    (set_record("rms_rel", -0.01), f"{HEAD}: field 'rms_rel' is -0.01, not a non-negative number, \"inf\" (or null)"),
    (set_record("max_abs", "-inf"), f"{HEAD}: field 'max_abs' is '-inf', not a non-negative number, \"inf\" (or null)"),
]


@pytest.mark.parametrize(("edit", "message"), DAMAGE)
def test_damage_is_a_baseline_error_naming_file_variant_tensor_and_field(
    written: Path, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    data = json.loads(written.read_text())
    edit(data)
    written.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(BaselineError) as raised:
        load_baseline(written, REFRESH, shown=Path("baselines/t.cpu.json"))
    text = str(raised.value)
    assert text.startswith(f"precision baseline baselines/t.cpu.json: {message}"), text
    assert text.endswith(f"Re-create it with: {REFRESH}")


def test_a_record_that_is_not_an_object(written: Path) -> None:
    data = json.loads(written.read_text())
    data["variants"]["bf16"]["records"][0] = ["inf", "fw"]
    written.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(BaselineError, match=r"variant 'bf16', records\[0\] is a list, not an object"):
        load_baseline(written, REFRESH)


def test_a_tensor_listed_twice(written: Path) -> None:
    data = json.loads(written.read_text())
    data["variants"]["bf16"]["records"].append(dict(data["variants"]["bf16"]["records"][0]))
    written.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(BaselineError, match=r"variant 'bf16': tensor 'inf' \(fw\) is listed twice"):
        load_baseline(written, REFRESH)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_non_standard_literal_in_a_record_is_refused(written: Path, literal: str) -> None:
    text = written.read_text()
    assert text.count('"max_rel": 0.03,') == 4
    written.write_text(text.replace('"max_rel": 0.03,', f'"max_rel": {literal},', 2), encoding="utf-8")
    with pytest.raises(BaselineError) as raised:
        load_baseline(written, REFRESH)
    # Keys are sorted: bf16's record comes first in the file.
    assert f"variant 'bf16', tensor 'inf' (fw): field 'max_rel' holds the literal {literal}, which JSON" in str(
        raised.value
    )


def test_a_non_standard_literal_anywhere_else_is_refused(written: Path) -> None:
    text = written.read_text().replace('"torch": "2.13"', '"torch": NaN')
    written.write_text(text, encoding="utf-8")
    with pytest.raises(BaselineError, match=r"field environment\.torch holds the literal NaN"):
        load_baseline(written, REFRESH)


def test_undefined_and_infinite_metrics_are_valid(written: Path) -> None:
    data = json.loads(written.read_text())
    record_of(data)["rms_rel"] = None
    record_of(data)["max_rel"] = "inf"
    record_of(data)["bias_rel"] = "-inf"
    record_of(data)["count"] = 0
    written.write_text(json.dumps(data), encoding="utf-8")
    head = load_baseline(written, REFRESH).records()["fp16"][1]
    assert (head.rms_rel, head.max_rel, head.bias_rel, head.count) == (None, math.inf, -math.inf, 0)


def test_a_file_that_is_not_utf8(written: Path) -> None:
    written.write_bytes(b"\xff\xfe{}")
    with pytest.raises(BaselineError, match="cannot read precision baseline"):
        load_baseline(written, REFRESH)


def test_the_published_schema_is_a_valid_schema_every_written_file_satisfies(tmp_path: Path) -> None:
    """Another tool validates with the schema alone (plain jsonschema): every committed baseline and a file this
    package writes conform, and the schema names exactly the record fields and kinds the package writes."""
    import jsonschema

    from pytest_precision.base.records import KINDS
    from pytest_precision.gate.baseline_schema import schema

    published = schema(1)
    jsonschema.Draft202012Validator.check_schema(published)
    committed = sorted(Path(__file__).resolve().parents[2].glob("baselines/**/*.json"))
    assert committed, "no committed baseline found"
    written = write(tmp_path / "t.cpu.json", document(sample_report(), "t.py::t", MACHINE))
    for path in [*committed, written]:
        jsonschema.validate(json.loads(path.read_text()), published)
    record = published["$defs"]["record"]
    assert set(record["properties"]) == {f.name for f in dataclasses.fields(Record)}
    assert record["properties"]["kind"]["enum"] == list(KINDS)


@pytest.mark.parametrize(("edit", "message"), DAMAGE)
def test_plain_jsonschema_refuses_what_the_schema_can_say(
    written: Path, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    """Every damage but the few a schema cannot express (a count written 2.0, a loss scale that is not a power of
    two, a variant order that lists a variant twice or leaves one out) is refused by the schema alone."""
    import jsonschema

    from pytest_precision.gate.baseline_schema import schema

    data = json.loads(written.read_text())
    edit(data)
    beyond_a_schema = (
        "is 3.0, not a finite",  # a power of two
        "is 'Infinity', not a finite",  # finite (the literal reads back as a float infinity)
        "'variant_order' ['fp16'] does",  # each variant once
        "'variant_order' ['bf16'] does",
        "'variant_order' ['fp16', 'bf16', 'bf16'] does",
        "is [2.0, 3]",  # JSON Schema counts 2.0 as an integer
    )
    errors = list(jsonschema.Draft202012Validator(schema(1)).iter_errors(json.loads(json.dumps(data))))
    assert bool(errors) == (not any(fragment in message for fragment in beyond_a_schema)), errors


def test_of_several_problems_the_first_in_document_order_is_named(written: Path) -> None:
    """The document's own fields before its variants, a variant's block before its records, and within a record
    who it is (name, kind) before its counts, then what is missing, then its metrics."""
    data = json.loads(written.read_text())
    record = record_of(data)
    record["rms_rel"] = "x"
    del record["max_rel"]
    record["count"] = -1
    cases = [
        (f"{HEAD}: field 'count' is -1", None),
        (f"{HEAD}: field 'max_rel' is missing", ("count", 6)),
        (f"{HEAD}: field 'rms_rel' is 'x'", ("max_rel", 0.1)),
    ]
    for message, repair in cases:
        if repair:
            record[repair[0]] = repair[1]
        record["kind"] = "forward"
        written.write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(BaselineError, match="field 'kind' is 'forward'"):
            load_baseline(written, REFRESH)
        record["kind"] = "fw"
        data["test"] = 5
        written.write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(BaselineError, match="field 'test' is a number"):
            load_baseline(written, REFRESH)
        data["test"] = "t.py::t"
        written.write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(BaselineError) as raised:
            load_baseline(written, REFRESH)
        assert f": {message}" in str(raised.value)


# --- what Python's json reader lets through: a key twice (the last wins) and numbers beyond a float (inf) -------


def test_a_metric_written_twice_in_a_record_is_refused_not_the_last_taken(written: Path) -> None:
    """Keeping both sides of a merge conflict gives a record with two rms_rel values; neither may silently win."""
    text = written.read_text()
    assert text.count('"rms_rel": 0.0123457') == 4
    written.write_text(text.replace('"rms_rel": 0.0123457', '"rms_rel": 0.5, "rms_rel": 0.0123457', 1))
    with pytest.raises(BaselineError) as raised:
        load_baseline(written, REFRESH, shown=Path("baselines/t.cpu.json"))
    assert str(raised.value) == (
        "precision baseline baselines/t.cpu.json: variant 'bf16', tensor 'inf' (fw): field 'rms_rel' appears twice "
        f"in one object (both sides of a merge conflict?). Re-create it with: {REFRESH}"
    )


@pytest.mark.parametrize(
    ("where", "replaced", "named"),
    [
        ('"test": "t.py::t"', '"test": "t.py::t", "test": "u.py::u"', "field 'test' appears twice"),
        ('"torch": "2.13"', '"torch": "2.13", "torch": "2.14"', "field 'environment.torch' appears twice"),
        (
            '"loss_scale": 2097152.0',
            '"loss_scale": 1.0, "loss_scale": 2097152.0',
            "variant 'fp16': field 'run.loss_scale'",
        ),
        ('"bf16": {', '"bf16": {"records": [], ', "variant 'bf16': field 'records' appears twice"),
    ],
)
def test_a_key_twice_anywhere_is_refused_naming_where(written: Path, where: str, replaced: str, named: str) -> None:
    text = written.read_text()
    assert where in text
    written.write_text(text.replace(where, replaced, 1))
    with pytest.raises(BaselineError, match=re.escape(named)):
        load_baseline(written, REFRESH)


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1.5E+309", "1" + "0" * 400, "-" + "9" * 5000])
def test_a_metric_beyond_the_largest_float_is_refused_not_read_as_infinity(written: Path, number: str) -> None:
    """1e400 reads as inf in Python, which would pass as an infinite metric although the Infinity literal is
    refused; an integer of 5000 digits would be a ValueError past Python's int conversion limit."""
    assert float(number.replace("9" * 5000, "9" * 400)) in (math.inf, -math.inf)  # what json alone would give
    text = written.read_text()
    written.write_text(text.replace('"max_rel": 0.03', f'"max_rel": {number}', 1))
    with pytest.raises(BaselineError) as raised:
        load_baseline(written, REFRESH)
    message = str(raised.value)
    assert "variant 'bf16', tensor 'inf' (fw): field 'max_rel' is " in message, message
    assert "beyond the largest float (it would read as infinity)" in message


def test_the_largest_finite_float_and_tiny_numbers_still_read(written: Path) -> None:
    text = written.read_text().replace('"max_rel": 0.03', '"max_rel": 1.7976931348623157e308', 1)
    written.write_text(text.replace('"max_abs": 0.03', '"max_abs": 1e-400', 1))
    bf16 = load_baseline(written, REFRESH).records()["bf16"][0]
    assert bf16.max_rel == 1.7976931348623157e308 and bf16.max_abs == 0.0


def test_a_refresh_rewrites_a_file_holding_a_key_twice(tmp_path: Path) -> None:
    """Its last values equal the new numbers, but the file is not what --update-baselines would write."""
    new = document(sample_report(), "t.py::t", MACHINE)
    written = write(tmp_path / "t.cpu.json", new)
    assert numbers_unchanged(written, new)
    text = written.read_text()
    written.write_text(text.replace('"rms_rel": 0.0123457', '"rms_rel": 0.5, "rms_rel": 0.0123457', 1))
    assert not numbers_unchanged(written, new)


# --- a low-bit run's block: what the gate compares (gate.lowbit_check) ---------------------------------------------

LOWBIT = {"format": "fp8 training, rowwise recipe", "kernels": "emulated", "modules": 2, "torchao": "0.18.0"}


def lowbit_baseline(tmp_path: Path, lowbit: dict[str, Any]) -> Path:
    report = sample_report()
    report.add("fp8", dataclasses.replace(run_info("fp8"), lowbit=lowbit), [tensor("inf")], [])
    return write(tmp_path / "t.cpu.json", document(report, "t.py::t", {}))


@pytest.mark.parametrize("names", [["b.up", "a.down"], None])  # None: a file from before names were recorded
def test_a_lowbit_block_with_or_without_module_names_reads(tmp_path: Path, names: list[str] | None) -> None:
    lowbit = LOWBIT if names is None else {**LOWBIT, "module_names": names}
    path = lowbit_baseline(tmp_path, lowbit)
    assert load_baseline(path, REFRESH).data["variants"]["fp8"]["run"]["lowbit"] == lowbit


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"module_names": "a.down"}, "variant 'fp8': field 'run.lowbit' is {"),
        ({"module_names": ["a.down", "a.down"]}, "variant 'fp8': field 'run.lowbit' is {"),
        ({"modules": -1}, "variant 'fp8': field 'run.lowbit' is {"),
        ({"format": None}, "not null, or an object with the format (a string)"),
        ({"module_names": ["a.down"]}, "variant 'fp8': field 'run.lowbit.modules' is 2, but 'module_names' lists 1"),
    ],
)
def test_a_damaged_lowbit_block_is_refused(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    path = lowbit_baseline(tmp_path, {**LOWBIT, "module_names": ["a.down", "b.up"], **change})
    with pytest.raises(BaselineError, match=re.escape(message)):
        load_baseline(path, REFRESH)
