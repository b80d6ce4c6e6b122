"""Weight-cast rows (compare(weight_cast=True), kind "weight_cast"): each parameter as the variant's model holds
it against the reference's, like torch.ao.ns compare_weights. Checked against an independent float64 NumPy
computation of the cast's error; fp32 and autocast variants hold the reference's weights (exactly 0); an
fp32 head computes with its low-precision stored weight upcast (the bf16 rounding error, as the head uses it)
while transformers' _keep_in_fp32_modules keep theirs (0); the user's model is left as it was; tied,
factory-built, arranged and isolated runs; tables, baselines, cli and the off-by-default JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from numpy_metrics import numpy_metrics

import pytest_precision
from conftest import load_tiny_llama, random_tokens, tiny_llama
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import KINDS
from pytest_precision.cli.main import main as cli_main
from pytest_precision.gate.baseline import document, load_baseline, render
from pytest_precision.reports.report import PrecisionReport


def inputs(length: int = 16) -> dict[str, torch.Tensor]:
    ids = random_tokens(length=length)
    return {"input_ids": ids, "labels": ids.clone()}


def floating(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if p.is_floating_point()}


def assert_cast_error(report: PrecisionReport, variant: str, weights: dict[str, torch.Tensor], dtype: Any) -> None:
    """Every weight row of `variant` holds the NumPy error of rounding the fp32 weight to `dtype`."""
    rows = {r.name: r for r in report.records(variant, "weight_cast")}
    assert list(rows) == list(weights)
    for name, weight in weights.items():
        expected = numpy_metrics(weight, weight.to(dtype))
        record = rows[name]
        assert record.count == expected["count"] == weight.numel()
        assert record.shape == tuple(weight.shape)
        for metric in ("rms_rel", "max_abs", "max_rel", "rms_abs", "ref_rms"):
            want = expected[metric]
            assert want is not None
            assert record.metric(metric) == pytest.approx(want, rel=1e-6, abs=1e-12), (name, metric)
        assert record.nonfinite == 0


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def report(llama: torch.nn.Module) -> PrecisionReport:
    return pytest_precision.compare(
        llama, inputs(), ["bf16", "fp16", "fp32", "bf16_autocast", "bf16_fp32_head"], weight_cast=True
    )


def test_bf16_and_fp16_rows_are_the_rounding_error_of_each_weight(
    llama: torch.nn.Module, report: PrecisionReport
) -> None:
    weights = floating(llama)
    assert_cast_error(report, "bf16", weights, torch.bfloat16)
    assert_cast_error(report, "fp16", weights, torch.float16)
    linear = report.get("bf16", "model.layers.0.mlp.up_proj.weight", "weight_cast")
    assert linear.rms_rel is not None and 1e-3 < linear.rms_rel < 3e-3  # bf16: ~2^-9 / sqrt(3)


@pytest.mark.parametrize("variant", ["fp32", "bf16_autocast"])
def test_fp32_and_autocast_variants_hold_the_reference_weights(report: PrecisionReport, variant: str) -> None:
    rows = report.records(variant, "weight_cast")
    assert len(rows) == len(report.records("bf16", "weight_cast"))
    for record in rows:
        assert (record.rms_abs, record.max_abs, record.rms_rel, record.sqnr_db) == (0.0, 0.0, 0.0, float("inf"))


def test_an_fp32_head_computes_with_its_stored_low_precision_weight(
    llama: torch.nn.Module, report: PrecisionReport
) -> None:
    """fp32_modules run in fp32 on an upcast of the weight the run stores in bf16 (model_build.compute_in_fp32):
    the head's weight row is the bf16 rounding, as in the bf16 variant."""
    assert_cast_error(report, "bf16_fp32_head", floating(llama), torch.bfloat16)
    head = report.get("bf16_fp32_head", "lm_head.weight", "weight_cast")
    assert head == report.get("bf16", "lm_head.weight", "weight_cast")
    assert head.rms_rel is not None and head.rms_rel > 0


def test_modules_kept_in_fp32_have_exact_weights() -> None:
    """transformers' _keep_in_fp32_modules stay fp32 in an fp16 run (as from_pretrained keeps them): their
    rows are 0, the others are fp16's rounding. (The head also computes in fp32 here: Llama's own forward
    does not upcast its input for it.)"""
    model = tiny_llama(layers=1)
    model._keep_in_fp32_modules = ["lm_head"]
    fp16 = pytest_precision.Variant("fp16", dtype="float16", fp32_modules=("<output head>",))
    bf16 = pytest_precision.Variant("bf16", dtype="bfloat16", fp32_modules=("<output head>",))
    result = pytest_precision.compare(model, inputs(), [fp16, bf16], weight_cast=True)
    weights = floating(model)
    head = result.get("fp16", "lm_head.weight", "weight_cast")
    assert head.rms_abs == 0.0 and head.max_abs == 0.0
    others = {name: weight for name, weight in weights.items() if name != "lm_head.weight"}
    for name, weight in others.items():
        expected = numpy_metrics(weight, weight.half())["rms_abs"]
        assert result.get("fp16", name, "weight_cast").rms_abs == pytest.approx(expected, rel=1e-6, abs=0), name
    assert sum(1 for name in others if result.get("fp16", name, "weight_cast").rms_abs) >= 7  # norms of ones: exact
    assert result.get("bf16", "lm_head.weight", "weight_cast").rms_rel  # fp16 only, as transformers does


def test_the_users_model_is_left_as_it_was() -> None:
    model = tiny_llama(layers=1)
    model.model.embed_tokens.weight.requires_grad_(False)
    before = {name: (p.detach().clone(), p.dtype, p.requires_grad) for name, p in model.named_parameters()}
    result = pytest_precision.compare(model, inputs(), ["bf16", "fp16_autocast"], weight_cast=True)
    assert result.get("bf16", "model.embed_tokens.weight", "weight_cast").rms_rel  # a frozen weight is cast too
    after = {name: (p.detach(), p.dtype, p.requires_grad) for name, p in model.named_parameters()}
    assert list(after) == list(before)
    for name, (value, dtype, requires_grad) in before.items():
        assert after[name][1:] == (dtype, requires_grad), name
        assert torch.equal(after[name][0], value), name
    assert all(p.grad is None for p in model.parameters())


def test_a_tied_head_is_one_row_and_a_factory_builds_the_reference() -> None:
    tied = pytest_precision.compare(tiny_llama(layers=1, tied=True), inputs(), ["bf16"], weight_cast=True)
    names = [r.name for r in tied.records("bf16", "weight_cast")]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    built = pytest_precision.compare(load_tiny_llama, inputs(), ["bf16", "fp32"], weight_cast=True)
    assert_cast_error(built, "bf16", floating(load_tiny_llama()), torch.bfloat16)
    assert all(r.max_abs == 0 for r in built.records("fp32", "weight_cast"))


def test_a_float64_reference() -> None:
    model = tiny_llama(layers=1)
    result = pytest_precision.compare(model, inputs(), ["fp32", "bf16"], reference="fp64", weight_cast=True)
    assert all(r.max_abs == 0 for r in result.records("fp32", "weight_cast"))
    assert_cast_error(result, "bf16", floating(model), torch.bfloat16)


def test_arrangements_isolation_and_a_reused_reference(llama: torch.nn.Module) -> None:
    """An arranged variant has weight rows (a weight does not depend on how the tokens run); an isolated pass
    adds no weight rows of its own; a Reference measures with and without them."""
    ref = pytest_precision.reference(llama, inputs())
    result = pytest_precision.compare(ref, variants=["bf16_decode", "bf16"], weight_cast=True, isolate=True)
    assert result.records("bf16_decode", "weight_cast") == result.records("bf16", "weight_cast")
    assert {r.kind for r in result.records("bf16")} >= {"weight_cast", "fw_isolated", "grad_isolated"}
    assert len(result.records("bf16", "weight_cast")) == len(result.records("bf16_decode", "weight_cast"))  # once
    assert result.missing["bf16"] == [] and result.missing["bf16_decode"] == []
    plain = pytest_precision.compare(ref, variants=["bf16"])
    assert not plain.records("bf16", "weight_cast")
    assert ("lm_head.weight", "weight_cast") not in ref.stored and ("lm_head.weight", "weight_cast") not in ref.sums


def test_repeats_give_weight_rows_no_spread(llama: torch.nn.Module) -> None:
    result = pytest_precision.compare(llama, inputs(), ["bf16"], weight_cast=True, repeats=2)
    assert all(r.spread == 0 for r in result.records("bf16", "weight_cast"))


def test_a_sharded_model_is_refused_by_name(llama: torch.nn.Module) -> None:
    sharded = pytest_precision.sharded(llama, lambda model, variant: model)
    with pytest.raises(ConfigurationError, match=r"weight_cast=True: .*not under torch.distributed"):
        pytest_precision.compare(sharded, inputs(), ["bf16"], weight_cast=True)


def test_tables_baselines_and_cli_know_the_weight_kind(report: PrecisionReport, tmp_path: Path) -> None:
    assert KINDS.index("grad") < KINDS.index("weight_cast") < KINDS.index("fw_isolated")
    text = report.format()
    assert "  weight_cast  " in text and "lm_head.weight" in text
    summary = report.format(full=False)
    weight_table = summary[summary.index("  weight_cast ") :].splitlines()
    assert weight_table[0].split()[:3] == ["weight_cast", "lm_head", "linear"]
    assert weight_table[3].split()[0] == "fp32" and set(weight_table[3].split()[1:]) == {"0.000%"}
    kinds = [r.kind for r in report.records("bf16")]
    assert kinds.index("weight_cast") > max(i for i, kind in enumerate(kinds) if kind == "grad")
    path = tmp_path / "test_x.cpu.json"
    path.write_text(render(document(report, "test_x.py::test_x", {})), encoding="utf-8")
    loaded = load_baseline(path, "").records()
    assert [(r.name, r.kind) for r in loaded["bf16"]] == [(r.name, r.kind) for r in report.records("bf16")]
    assert cli_main(["show", str(path), "--kind", "weight_cast"]) == 0
    round_trip = PrecisionReport.from_dict(report.to_dict())
    assert round_trip.records("fp16", "weight_cast") == report.records("fp16", "weight_cast")


def test_off_by_default(llama: torch.nn.Module) -> None:
    result = pytest_precision.compare(llama, inputs(), ["bf16"])
    assert not result.records("bf16", "weight_cast")
    assert "  weight_cast  " not in result.format()
