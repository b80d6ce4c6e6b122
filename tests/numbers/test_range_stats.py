"""Range statistics (compare(range_stats=True), range_stats.RangeStats) against an independent float64 NumPy
computation from the formats' definitions and against what a cast to the dtype actually does: the fp16 and
bf16 boundaries (smallest normal, half a subnormal step below it, half the smallest subnormal, the overflow
threshold max + ulp/2), loss-scaled gradients, chunked tensors; then end to end on a tiny Llama: each
record's statistics are its reference tensor's, a larger fp16 loss scale lowers bw underflow, limits and
baselines gate them, JSON and baseline files carry them, and they are off (absent from JSON) by default."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pytest_precision
import pytest_precision.numbers.metrics as metrics_module
from conftest import random_tokens, tiny_llama
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.gate.baseline import document, load_baseline, render
from pytest_precision.gate.checks import check_against_baseline, check_limits
from pytest_precision.gate.tolerance_rules import ToleranceRules
from pytest_precision.numbers.range_stats import (
    RANGE_METRICS,
    RangeStats,
    combine_range_sums,
    range_from_sums,
    range_stats,
    range_sums,
)
from pytest_precision.reports.report import PrecisionReport

#: Each format from its definition (sign, exponent bits, fraction bits): smallest normal 2^(1 - bias),
#: smallest subnormal 2^(1 - bias - fraction bits), largest finite (2 - 2^-fraction) 2^bias.
FORMATS = {torch.float16: (5, 10), torch.bfloat16: (8, 7), torch.float32: (8, 23)}


def format_limits(dtype: torch.dtype) -> tuple[float, float, float, float]:
    """(smallest normal, smallest subnormal, largest finite, ulp of the largest) from the bit layout."""
    exponent_bits, fraction_bits = FORMATS[dtype]
    bias = 2 ** (exponent_bits - 1) - 1
    normal = 2.0 ** (1 - bias)
    subnormal = 2.0 ** (1 - bias - fraction_bits)
    ulp_max = 2.0 ** (bias - fraction_bits)
    largest = 2.0 ** (bias + 1) - ulp_max
    return normal, subnormal, largest, ulp_max


def numpy_range(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> dict[str, float | None]:
    """RangeStats from the definitions in float64 NumPy: round to nearest, ties to even, at each boundary."""
    normal, subnormal, largest, ulp_max = format_limits(dtype)
    x = values.detach().to(torch.float64).reshape(-1).numpy()
    finite = x[np.isfinite(x)]
    magnitude = np.abs(finite)
    nonzero = magnitude[magnitude > 0]
    scaled = nonzero * scale
    # Below normal - subnormal/2 a value rounds to a subnormal or zero; at or below subnormal/2, to zero; at or
    # above largest + ulp/2, to inf.
    underflow = np.count_nonzero(scaled < normal - subnormal / 2)
    zero = np.count_nonzero(scaled <= subnormal / 2)
    overflow = np.count_nonzero(magnitude * scale >= largest + ulp_max / 2)
    return {
        "underflow_frac": underflow / nonzero.size if nonzero.size else None,
        "zero_frac": zero / nonzero.size if nonzero.size else None,
        "overflow_frac": overflow / finite.size if finite.size else None,
        "ref_absmax": float(magnitude.max()) if finite.size else None,
        "dynamic_range_log2": float(np.log2(magnitude.max() / nonzero.min())) if nonzero.size else None,
    }


def cast_range(values: torch.Tensor, dtype: torch.dtype, scale: float) -> tuple[float, float, float]:
    """(underflow, zero, overflow) fractions as a cast of x * scale (exact in float32: scale a power of two)
    to `dtype` gives them."""
    x = values.reshape(-1).to(torch.float32)
    x = x[torch.isfinite(x)]
    nonzero = x[x != 0] * scale
    held = nonzero.to(dtype).to(torch.float64).abs()
    normal = torch.finfo(dtype).tiny
    return (
        float((held < normal).double().mean()),
        float((held == 0).double().mean()),
        float(torch.isinf((x * scale).to(dtype)).double().mean()),
    )


def assert_matches(actual: RangeStats, expected: dict[str, float | None]) -> None:
    for name in RANGE_METRICS:
        got, want = getattr(actual, name), expected[name]
        if want is None:
            assert got is None, f"{name}: {got!r}, expected None"
        elif name == "dynamic_range_log2":
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12), name
        else:
            assert got == want, f"{name}: {got!r} != {want!r}"


def below(value: float) -> float:
    """The largest float32 below `value`."""
    return float(np.nextafter(np.float32(value), np.float32(0)))


def above(value: float) -> float:
    return float(np.nextafter(np.float32(value), np.float32(np.inf)))


def boundary_values(dtype: torch.dtype) -> list[float]:
    """Every boundary of `dtype`, each with its float32 neighbours, and a few ordinary values."""
    normal, subnormal, largest, ulp_max = format_limits(dtype)
    values = [0.0, -0.0, 1.0, -3.0, normal, -normal, below(normal), normal - subnormal / 2]
    values += [below(normal - subnormal / 2), normal - subnormal, subnormal, -subnormal, subnormal / 2]
    values += [above(subnormal / 2), below(subnormal / 2), largest, -largest]
    if dtype != torch.float32:  # float32's own overflow threshold is past every float32
        values += [largest + ulp_max / 2, -(largest + ulp_max / 2), below(largest + ulp_max / 2)]
        values += [above(largest + ulp_max / 2)]
    values += [2.0**-149, 3.0e38]  # float32's smallest subnormal and a value near its largest
    return values


def test_the_format_definitions_match_torch() -> None:
    """The test's own format table agrees with torch.finfo (the definitions, not the code under test)."""
    for dtype in FORMATS:
        normal, subnormal, largest, _ = format_limits(dtype)
        info = torch.finfo(dtype)
        assert (normal, subnormal, largest) == (info.tiny, info.tiny * info.eps, info.max)
    assert format_limits(torch.float16)[:3] == (6.103515625e-05, 2.0**-24, 65504.0)
    assert format_limits(torch.bfloat16)[0] == 2.0**-126 == pytest.approx(1.1755e-38, rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_boundaries_match_numpy_and_the_cast(dtype: torch.dtype) -> None:
    values = torch.tensor(boundary_values(dtype), dtype=torch.float32)
    stats = range_stats(values, dtype)
    assert_matches(stats, numpy_range(values, dtype))
    assert (stats.underflow_frac, stats.zero_frac, stats.overflow_frac) == cast_range(values, dtype, 1.0)


def test_fp16_boundaries_one_by_one() -> None:
    """Each fp16 boundary alone: 65504 stays, 65520 overflows (65519.996 rounds down to 65504); the smallest
    normal 6.1035e-05 is normal, so is a value half a subnormal step below it (it rounds up), the largest
    subnormal underflows; 2^-25 (half of 5.96e-08) becomes zero, the float32 just above it a subnormal."""

    def one(value: float) -> tuple[float | None, float | None, float | None]:
        stats = range_stats(torch.tensor([value]), "fp16")
        return stats.underflow_frac, stats.zero_frac, stats.overflow_frac

    assert one(65504.0) == (0.0, 0.0, 0.0)
    assert one(below(65520.0)) == (0.0, 0.0, 0.0)
    assert one(65520.0) == (0.0, 0.0, 1.0)
    assert one(-65520.0) == (0.0, 0.0, 1.0)
    assert one(6.103515625e-05) == (0.0, 0.0, 0.0)
    assert one(6.103515625e-05 - 2.0**-25) == (0.0, 0.0, 0.0)
    assert one(below(6.103515625e-05 - 2.0**-25)) == (1.0, 0.0, 0.0)
    assert one(6.103515625e-05 - 2.0**-24) == (1.0, 0.0, 0.0)
    assert one(2.0**-25) == (1.0, 1.0, 0.0)
    assert one(above(2.0**-25)) == (1.0, 0.0, 0.0)
    assert one(0.0) == (None, None, 0.0)


def test_bf16_boundaries_one_by_one() -> None:
    """bf16: 1.1755e-38 (2^-126) normal, 2^-134 zero, 1.5 * 2^-134 the smallest subnormal, (2 - 2^-8) 2^127
    overflows (float32 holds values past bf16's largest)."""

    def one(value: float) -> tuple[float | None, float | None, float | None]:
        stats = range_stats(torch.tensor([value]), torch.bfloat16)
        return stats.underflow_frac, stats.zero_frac, stats.overflow_frac

    assert one(2.0**-126) == (0.0, 0.0, 0.0)
    assert one(2.0**-126 - 2.0**-133) == (1.0, 0.0, 0.0)
    assert one(2.0**-134) == (1.0, 1.0, 0.0)
    assert one(1.5 * 2.0**-134) == (1.0, 0.0, 0.0)
    assert one((2 - 2.0**-7) * 2.0**127) == (0.0, 0.0, 0.0)
    assert one((2 - 2.0**-8) * 2.0**127) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize("scale", [1.0, 2.0**10, 2.0**16, 2.0**-4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_random_magnitudes_with_a_scale(dtype: torch.dtype, scale: float) -> None:
    """Log-uniform magnitudes over the whole fp16 range and past it, at several loss scales."""
    generator = torch.Generator().manual_seed(7)
    exponents = torch.rand(20_000, generator=generator) * 60 - 40
    signs = torch.where(torch.rand(20_000, generator=generator) < 0.5, -1.0, 1.0)
    values = signs * torch.exp2(exponents)
    values[::97] = 0.0
    stats = range_stats(values, dtype, scale=scale)
    assert_matches(stats, numpy_range(values, dtype, scale))
    assert (stats.underflow_frac, stats.zero_frac, stats.overflow_frac) == cast_range(values, dtype, scale)
    if dtype == torch.float16 and scale == 1:
        assert 0 < stats.zero_frac < stats.underflow_frac < 1  # the test exercises every count


def test_chunks_non_finite_and_wider_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small chunks give the same numbers as one; NaN/Inf are left out; float64, fp16 and bf16 references
    count the same as float32 ones holding the same values."""
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(5000, generator=generator) * 1e-4
    values[17] = math.nan
    values[4000] = math.inf
    whole = range_stats(values, "fp16", scale=8.0)
    monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", 256)
    assert range_stats(values, "fp16", scale=8.0) == whole
    assert_matches(whole, numpy_range(values, torch.float16, 8.0))
    assert range_stats(values.double(), "fp16", scale=8.0) == whole
    for narrow in (torch.float16, torch.bfloat16):
        held = values.to(narrow)
        assert range_stats(held, "fp16") == range_stats(held.float(), "fp16")


def test_parts_combine_into_the_whole() -> None:
    """combine_range_sums (each rank's part under torch.distributed) gives the whole tensor's statistics."""
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(3000, generator=generator) * torch.exp2(torch.randint(-30, 5, (3000,), generator=generator))
    parts = [range_sums(part, torch.float16, scale=4.0).tolist() for part in values.split([1000, 0, 1500, 500])]
    assert range_from_sums(combine_range_sums(parts)) == range_stats(values, "fp16", scale=4.0)
    with pytest.raises(ValueError, match="3 values, expected 7"):
        combine_range_sums([[0.0, 0.0, 0.0]])


def test_empty_and_all_zero_tensors() -> None:
    assert range_stats(torch.zeros(0), "fp16") == RangeStats(None, None, None, None, None)
    zeros = range_stats(torch.zeros(5), "bf16")
    assert zeros == RangeStats(None, None, 0.0, 0.0, None)


@pytest.mark.parametrize("scale", [0, -1.0, math.inf, math.nan, True, "8"])
def test_a_bad_scale_is_refused_by_name(scale: Any) -> None:
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        range_stats(torch.ones(3), "fp16", scale=scale)


# End to end: compare(range_stats=True) on a tiny Llama.


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ids = random_tokens(length=16)
    return tiny_llama(layers=2), {"input_ids": ids, "labels": ids.clone()}


def small_loss(output: Any, inputs: Any) -> torch.Tensor:
    """The model's loss times 1e-6: gradients small enough that fp16 needs its loss scale."""
    return output.loss * 1e-6


@pytest.fixture(scope="module")
def reference(llama: tuple[torch.nn.Module, dict[str, torch.Tensor]]) -> pytest_precision.Reference:
    model, inputs = llama
    return pytest_precision.reference(model, inputs, loss_fn=small_loss)


def test_each_record_holds_its_reference_tensors_statistics(reference: pytest_precision.Reference) -> None:
    """Every fw/bw/grad/weight record's statistics are those of its reference tensor in the variant's compute
    dtype (autocast: the autocast dtype), bw and grad at the variant's loss scale; logprob and loss rows none."""
    report = pytest_precision.compare(
        reference, variants=["fp16", "fp16_autocast", "bf16_autocast", "fp32"], range_stats=True, weight_cast=True
    )
    dtypes = {
        "fp16": torch.float16,
        "fp16_autocast": torch.float16,
        "bf16_autocast": torch.bfloat16,
        "fp32": torch.float32,
    }
    assert report.runs["fp16"].loss_scale is not None and report.runs["fp16"].loss_scale > 1
    weights = dict(reference.model.named_parameters())  # type: ignore[union-attr]
    checked = 0
    for variant, dtype in dtypes.items():
        scale = report.runs[variant].loss_scale or 1.0
        for record in report.records(variant):
            if record.kind in ("logprob", "loss"):
                assert all(record.metric(m) is None for m in RANGE_METRICS), record
                continue
            if record.kind == "weight_cast":
                tensor = weights[record.name].detach()
            else:
                tensor = reference.stored[(record.name, record.kind)]
            if record.count != tensor.numel():
                continue  # positions masked out of the metrics (none here)
            expected = numpy_range(tensor, dtype, scale if record.kind in ("bw", "grad") else 1.0)
            assert_matches(RangeStats(*(record.metric(m) for m in RANGE_METRICS)), expected)
            checked += 1
    assert checked >= 4 * 30
    # Autocast counts in its compute dtype, fp16, not its fp32 weights': some activations underflow there.
    assert any(r.underflow_frac for r in report.records("fp16_autocast", "fw"))
    # fp32 holds these 1e-6-sized gradients; fp16 too, at the scale sized from the largest gradient.
    for variant in ("fp16", "fp32"):
        assert all(r.underflow_frac == 0 for r in report.records(variant, "bw")), variant


def test_a_larger_loss_scale_lowers_fp16_backward_underflow(reference: pytest_precision.Reference) -> None:
    """The same fp16 gradients counted at loss scale 1, 2^8, 2^16 and 2^24: underflow (and flushing to zero)
    falls as the scale grows, row by row; the total strictly, once the scale brings values into range."""
    totals: list[tuple[float, float]] = []
    rows = []
    for scale in (1.0, 2.0**8, 2.0**16, 2.0**24):
        report = pytest_precision.compare(reference, variants=["fp16"], loss_scale=scale, range_stats=True)
        assert report.runs["fp16"].loss_scale == scale
        bw = {r.name: (r.underflow_frac or 0.0, r.zero_frac or 0.0) for r in report.records("fp16", "bw")}
        rows.append(bw)
        totals.append((sum(u for u, _ in bw.values()), sum(z for _, z in bw.values())))
    # At scale 1 every 1e-6-sized gradient underflows fp16, and most flush to zero.
    assert totals[0][0] == len(rows[0]) and totals[0][1] > 0.5 * len(rows[0])
    assert totals[0][1] > totals[1][1] > totals[2][1]  # flushed to zero: fewer with every step
    assert totals[1][0] > totals[2][0] > totals[3][0]  # underflowing: fewer once the scale is 2^8 or more
    for smaller, larger in itertools.pairwise(rows):
        for name, (underflow, zero) in smaller.items():
            assert larger[name][0] <= underflow and larger[name][1] <= zero, name


def test_limits_and_baselines_gate_range_statistics(reference: pytest_precision.Reference) -> None:
    """check_limits fails a row whose underflow breaks its bound and passes a loose one; a baseline at a large
    loss scale against a run at scale 1 regresses on underflow_frac."""
    unscaled = pytest_precision.compare(reference, variants=["fp16"], loss_scale=1.0, range_stats=True)
    scaled = pytest_precision.compare(reference, variants=["fp16"], loss_scale=2.0**16, range_stats=True)
    records = {"fp16": unscaled.records("fp16")}
    broken = check_limits(records, {"bw": {"underflow_frac": 0.01}})
    assert broken and {v.kind for v in broken} == {"bw"} and {v.metric for v in broken} == {"underflow_frac"}
    assert all(v.reason == "limit" and v.obtained is not None and v.obtained > 0.01 for v in broken)
    assert check_limits(records, {"bw": {"underflow_frac": 1.0, "overflow_frac": 0.0}}) == []
    worst = max(r.ref_absmax or 0.0 for r in unscaled.records("fp16", "fw"))
    assert check_limits(records, {"fw": {"ref_absmax": worst}}) == []
    assert [v.name for v in check_limits(records, {"fw": {"ref_absmax": worst / 2}})]
    # Logprob and loss rows carry none: a limit on them alone would check nothing, so it is an error; a key that
    # also matches rows carrying the metric skips the loss row.
    with pytest.raises(ConfigurationError, match=r"limits\['loss'\]\['underflow_frac'\]: no tensor it applies to"):
        check_limits(records, {"loss": {"underflow_frac": 0.0}})
    assert not [v for v in check_limits(records, {".": {"underflow_frac": 1.0}}) if v.kind == "loss"]
    gate = check_against_baseline(
        {"fp16": scaled.records("fp16")}, records, ToleranceRules(), metrics=["underflow_frac"]
    )
    assert gate.violations and {v.reason for v in gate.violations} == {"regressed"}
    assert {v.metric for v in gate.violations} == {"underflow_frac"}
    assert check_against_baseline(records, records, ToleranceRules(), metrics=["underflow_frac"]).violations == []


def test_json_and_baseline_files_carry_them_and_off_by_default(
    reference: pytest_precision.Reference, tmp_path: Path
) -> None:
    on = pytest_precision.compare(reference, variants=["bf16", "fp16"], range_stats=True)
    off = pytest_precision.compare(reference, variants=["bf16", "fp16"])
    back = PrecisionReport.from_dict(on.to_dict())
    for variant in on.variants:
        assert back.records(variant) == on.records(variant)
        for record in off.to_dict()["variants"][variant]["records"]:
            assert not set(RANGE_METRICS) & set(record)
        kinds = {r["kind"]: r for r in on.to_dict()["variants"][variant]["records"]}
        assert set(RANGE_METRICS) <= set(kinds["bw"]) and not set(RANGE_METRICS) & set(kinds["loss"])
    assert all(r.metric(m) is None for v in off.variants for r in off.records(v) for m in RANGE_METRICS)
    path = tmp_path / "test_x.cpu.json"
    path.write_text(render(document(on, "test_x.py::test_x", {})), encoding="utf-8")
    loaded = load_baseline(path, "")
    for variant in on.variants:
        for written, record in zip(loaded.records()[variant], on.records(variant), strict=True):
            for metric in RANGE_METRICS:
                value = record.metric(metric)
                assert written.metric(metric) == (None if value is None else pytest.approx(value, rel=1e-5))
    assert "underflow" in on.format() and "range_log2" in on.format()
    assert "underflow" not in off.format()


def test_a_fraction_out_of_range_in_a_baseline_is_refused(
    reference: pytest_precision.Reference, tmp_path: Path
) -> None:
    report = pytest_precision.compare(reference, variants=["bf16"], range_stats=True)
    data = document(report, "test_x.py::test_x", {})
    data["variants"]["bf16"]["records"][0]["underflow_frac"] = 1.5
    path = tmp_path / "test_x.cpu.json"
    path.write_text(render(data), encoding="utf-8")
    with pytest.raises(pytest_precision.BaselineError, match=r"underflow_frac.*1\.5.*not a fraction"):
        load_baseline(path, "")


@pytest.mark.parametrize("argument", ["range_stats", "weight_cast"])
def test_the_flags_must_be_booleans(llama: tuple[torch.nn.Module, dict[str, torch.Tensor]], argument: str) -> None:
    model, inputs = llama
    with pytest.raises(ConfigurationError, match=f"{argument} must be True or False, got 'yes'"):
        pytest_precision.compare(model, inputs, ["bf16"], **{argument: "yes"})


def test_range_statistics_cost_no_host_sync() -> None:
    """The statistics ride the pass's one transfer: the same sync count with them as without."""
    from test_host_syncs import counted_compare

    plain, _ = counted_compare(4, ["bf16", "fp16"])
    with_stats, report = counted_compare(4, ["bf16", "fp16"], range_stats=True, weight_cast=True)
    assert report.records("fp16", "weight_cast") and report.records("fp16", "bw")[0].underflow_frac is not None
    assert with_stats.counts == plain.counts, f"without: {plain.describe()}\nwith: {with_stats.describe()}"
